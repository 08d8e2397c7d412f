"""Blockwise 8-bit quantization of optimizer states (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", ICLR 2022): a state is stored as one byte
per element, an index into a table of 256 codes in ``[-1, 1]`` (``[0, 1]`` for a
state that is never negative, Adam's second moment), and one float32 scale per
block of :data:`BLOCK` elements, the block's largest magnitude. An element's value
is ``codes[q] * scale``.

The codes are a *dynamic* map, dense near zero in relative terms: each decade
``[10^-(k+1), 10^-k]`` gets half as many codes as the decade above it, so a value a
thousand times smaller than its block's largest is still kept to a few percent (a
linear map would round it to zero, and Adam's update would divide by ``sqrt(0)``).
Quantizing takes the nearest code, ties to the lower one (``searchsorted`` on the
midpoints, ``side="left"``), so the result is a pure function of the float32 inputs:
the same on every rank, at every world size, in a checkpoint written at one and read
at another.

Blocks are cut from the start of a flat array of one dtype (the model's parameters in
the layout's order), not from a shard's start: a shard may begin or end inside a
block, and then the ranks holding parts of it agree on its scale (the largest of
their parts).
"""

from __future__ import annotations

import numpy as np

#: Elements per block (one float32 scale each: 4 bytes per 256, 1.6 % on top of the
#: one byte per element).
BLOCK = 256


def _decades(counts: list[int]) -> list[float]:
    """Positive codes: decade ``k`` (``[10^-(k+1), 10^-k]``, ``k = 0`` the top) gets
    ``counts[k]`` codes, the midpoints of equal steps across it, and ``1.0``."""
    out = [1.0]
    for k, n in enumerate(counts):
        edges = np.linspace(0.1, 1.0, n + 1) * 10.0**-k
        out += ((edges[:-1] + edges[1:]) / 2).tolist()
    return out


def _table(values: list[float]) -> np.ndarray:
    codes = np.array(sorted(values), np.float32)
    assert codes.shape == (256,) and np.unique(codes).shape == (256,), "256 distinct codes"
    return codes


#: 256 codes for a signed state: 0, and 127 positive and 128 negative ones, the top
#: decade with 63 (+ 1.0), then 32, 16, 8, 4, 2, 1 (the last negative: -1e-7).
SIGNED = _table([0.0, -1e-7] + [s * v for v in _decades([63, 32, 16, 8, 4, 2, 1])
                                for s in (1.0, -1.0)])  # fmt: skip
#: 256 codes for a state that is never negative: 0, 1.0, and 254 over eight decades
#: (127, 64, 32, 16, 8, 4, 2, 1).
UNSIGNED = _table([0.0, *_decades([127, 64, 32, 16, 8, 4, 2, 1])])


def midpoints(codes: np.ndarray) -> np.ndarray:
    """The 255 midpoints between consecutive codes: the quantization thresholds."""
    return ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)


MIDS = {id(SIGNED): midpoints(SIGNED), id(UNSIGNED): midpoints(UNSIGNED)}


def search_table(mids: np.ndarray) -> np.ndarray:
    """For the compiled search: per value of a float32's top 15 bits (sign, exponent,
    six mantissa bits), the count of ``mids`` below the smallest float with those
    bits, where the search for the count of midpoints below ``y`` starts; then three
    bytes of padding (the AVX-512 loop reads four bytes from each entry)."""
    keys = np.arange(1 << 15, dtype=np.uint32)
    negative = keys >= 1 << 14
    smallest = np.where(negative, (keys << 17) | 0x1FFFF, keys << 17).view(np.float32)
    with np.errstate(invalid="ignore"):
        found = np.searchsorted(mids, smallest, side="left").astype(np.uint8)
    return np.append(found, np.zeros(3, np.uint8))  # (read 4 bytes at a time)


TABLES = {id(SIGNED): search_table(MIDS[id(SIGNED)]),
          id(UNSIGNED): search_table(MIDS[id(UNSIGNED)])}  # fmt: skip
#: The midpoints padded with two +inf (the compiled search's two steps past a table
#: entry never read beyond them).
PADDED = {k: np.append(m, np.float32([np.inf, np.inf])) for k, m in MIDS.items()}


def blocks_of(offset: int, n: int, block: int = BLOCK) -> tuple[int, int]:
    """``(first, stop)``: the blocks that elements ``offset ... offset + n`` of the
    flat array touch (none for ``n == 0``)."""
    if n <= 0:
        return 0, 0
    return offset // block, (offset + n - 1) // block + 1


def spans(offset: int, n: int, block: int = BLOCK) -> list[tuple[int, int, int]]:
    """``(slot, lo, hi)`` per block that elements ``offset ... offset + n`` touch:
    its index counted from the first (the slot of its scale) and its elements in the
    piece."""
    first, stop = blocks_of(offset, n, block)
    return [(b - first, max(b * block - offset, 0), min((b + 1) * block - offset, n))
            for b in range(first, stop)]  # fmt: skip


def zero_code(codes: np.ndarray) -> int:
    """The index of the code 0.0."""
    return int(np.searchsorted(codes, 0.0))


def block_max(x: np.ndarray, offset: int, block: int = BLOCK) -> np.ndarray:
    """The largest magnitude of ``x`` (elements ``offset...`` of the flat array) in
    each block it touches, in float32; a block touched in part: of that part."""
    pieces = spans(offset, x.shape[0], block)
    out = np.zeros(len(pieces), np.float32)
    if pieces:
        np.maximum.reduceat(np.abs(x), [lo for _, lo, _ in pieces], out=out)
    return out


def quantize(
    x: np.ndarray, offset: int, scales: np.ndarray, codes: np.ndarray, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (uint8) = the nearest codes of float32 ``x`` (elements ``offset...``)
    divided by its block's scale, ``scales`` holding one per block touched. A zero
    scale (an all-zero block) gives the code of 0."""
    mids = MIDS[id(codes)]
    for slot, lo, hi in spans(offset, x.shape[0], block):
        scale = scales[slot]
        if scale == 0:
            out[lo:hi] = zero_code(codes)
            continue
        y = x[lo:hi] / scale  # float32
        out[lo:hi] = np.searchsorted(mids, y, side="left")


def dequantize(
    q: np.ndarray, offset: int, scales: np.ndarray, codes: np.ndarray, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (float32) = ``codes[q] * scale`` of each element's block."""
    for slot, lo, hi in spans(offset, q.shape[0], block):
        np.multiply(codes[q[lo:hi]], scales[slot], out=out[lo:hi])


class Edges:
    """What an 8-bit step leaves for the ranks to agree on: the float32 moments of its
    partial blocks (a block this piece holds only part of: at most its first and its
    last), which are quantized once the scale of each such block is the largest over
    every piece holding part of it."""

    __slots__ = ("moments", "spans")

    def __init__(self) -> None:
        #: per partial block: ``(slot in the piece's scales, lo, hi)`` in the piece
        self.spans: list[tuple[int, int, int]] = []
        #: per partial block, the float32 new moments (one array per state)
        self.moments: list[tuple[np.ndarray, ...]] = []


def adam8_step(
    param: np.ndarray, grad: np.ndarray, qm: np.ndarray, qv: np.ndarray,
    sm: np.ndarray, sv: np.ndarray, offset: int, step: int, config: object,
    divisor: float = 1.0, block: int = BLOCK, kernel: str | None = None,
    variant: str | None = None,
) -> Edges:  # fmt: skip
    """Adam/AdamW (:func:`zerompi.adam.adam_step`'s arithmetic) on a piece of the
    flat float32 parameters starting at global element ``offset``, its moments held
    in 8 bits (``qm`` signed map, ``qv`` unsigned; ``sm``/``sv`` the scales of the
    blocks the piece touches). Each block is dequantized, stepped in float32 and
    re-quantized with its new largest magnitude; a block held only in part is stepped
    and left in the returned :class:`Edges` for :func:`finish_edges` once its scale
    is agreed. ``grad`` is consumed. ``kernel`` and ``variant`` as for ``adam_step``
    (the compiled loop takes the whole blocks)."""
    from .adam import KERNEL, adam_step

    n = param.shape[0]
    edges = Edges()
    head = min(-offset % block, n)  # elements before the first whole block
    nb = (n - head) // block  # whole blocks
    tail = head + nb * block  # where the last, partial block starts
    lo_slot = 1 if head else 0  # the first whole block's scale
    partial = [(0, 0, head)] if head else []
    if tail < n:
        partial.append((lo_slot + nb, tail, n))
    if nb:
        if (kernel or KERNEL) == "c" and _compiled() is not None:
            _adam8_compiled(param[head:tail], grad[head:tail], qm[head:tail], qv[head:tail],
                            sm[lo_slot:lo_slot + nb], sv[lo_slot:lo_slot + nb], step, config,
                            divisor, block, variant)  # fmt: skip
        else:
            m = np.empty(block, np.float32)
            v = np.empty(block, np.float32)
            scratch = np.empty(block, np.float32)
            for k in range(nb):
                lo, hi = head + k * block, head + (k + 1) * block
                s = lo_slot + k
                np.multiply(SIGNED[qm[lo:hi]], sm[s], out=m)
                np.multiply(UNSIGNED[qv[lo:hi]], sv[s], out=v)
                adam_step(param[lo:hi], grad[lo:hi], m, v, step, config, scratch, divisor,
                          kernel=kernel)  # fmt: skip
                for x, q, scales, codes in ((m, qm, sm, SIGNED), (v, qv, sv, UNSIGNED)):
                    scales[s] = np.max(np.abs(x))
                    quantize(x, offset + lo, scales[s : s + 1], codes, q[lo:hi], block)
    for slot, lo, hi in partial:  # stepped here, quantized once the scale is agreed
        m = np.multiply(SIGNED[qm[lo:hi]], sm[slot])
        v = np.multiply(UNSIGNED[qv[lo:hi]], sv[slot])
        adam_step(param[lo:hi], grad[lo:hi], m, v, step, config,
                  np.empty(hi - lo, np.float32), divisor, kernel="numpy")  # fmt: skip
        edges.spans.append((slot, lo, hi))
        edges.moments.append((m, v))
    return edges


def edge_maxima(edges: Edges) -> list[tuple[float, float]]:
    """This piece's largest magnitudes of each partial block's new moments."""
    return [(float(np.max(np.abs(m))), float(np.max(np.abs(v)))) for m, v in edges.moments]


def finish_edges(
    edges: Edges, qm: np.ndarray, qv: np.ndarray, sm: np.ndarray, sv: np.ndarray,
    offset: int, agreed: list[tuple[float, float]], block: int = BLOCK,
) -> None:  # fmt: skip
    """Quantize the partial blocks' moments with the ``agreed`` scales (per partial
    block, the largest over every piece holding part of it)."""
    for (slot, lo, hi), (m, v), (am, av) in zip(edges.spans, edges.moments, agreed,
                                                 strict=True):  # fmt: skip
        for x, q, scales, codes, a in ((m, qm, sm, SIGNED, am), (v, qv, sv, UNSIGNED, av)):
            scales[slot] = a
            quantize(x, offset + lo, scales[slot : slot + 1], codes, q[lo:hi], block)


def _compiled():  # type: ignore[no-untyped-def]
    from . import adam

    k = adam._kernels
    return k if k is not None and hasattr(k, "adam8") else None


def _adam8_compiled(
    param: np.ndarray, grad: np.ndarray, qm: np.ndarray, qv: np.ndarray, sm: np.ndarray,
    sv: np.ndarray, step: int, c: object, divisor: float, block: int, variant: str | None,
) -> None:  # fmt: skip
    from . import adam

    bc1 = 1.0 - c.beta1**step  # type: ignore[attr-defined]
    bc2 = 1.0 - c.beta2**step  # type: ignore[attr-defined]
    adam._kernels.adam8(
        param, grad, qm, qv, sm, sv, c.lr, c.beta1, c.beta2, c.eps,  # type: ignore[attr-defined]
        c.weight_decay, c.decoupled, bc1, bc2, float(divisor), SIGNED,  # type: ignore[attr-defined]
        PADDED[id(SIGNED)], UNSIGNED, PADDED[id(UNSIGNED)], TABLES[id(SIGNED)],
        TABLES[id(UNSIGNED)], block, variant=variant or adam.VARIANT,
    )
