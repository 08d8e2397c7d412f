"""Blockwise 8-bit quantization of optimizer states (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", ICLR 2022): a state is stored as one byte
per element and one float32 scale per block of :data:`BLOCK` elements, the block's
largest magnitude. An element's value is ``format.table[q] * scale``.

The byte is a small float (:class:`Format`), so that its nearest code is computed
from the bits of ``|x| / scale`` (a rounding of the float32 mantissa, as a float32 ->
float8 conversion does) rather than searched in a table, and decoded the same way:
Adam's first moment in ``E4M3`` with a sign bit (magnitudes down to 2^-17 of the
block's largest: five decades), its second moment, never negative, in ``E5M3``
without one (down to 2^-33: ten decades, so that ``sqrt(v)`` of a small element of
a block is not rounded to 0 while its ``m`` is not). Like the dynamic maps of
Dettmers et al., the codes are dense near zero in relative terms (every binade has
eight), unlike a linear map, which would round a value a thousand times smaller than
its block's largest to zero. Rounding is to the nearest code, ties to the even code,
a pure function of the float32 inputs: the same on every rank, at every world size,
in a checkpoint written at one and read at another.

Blocks are cut from the start of a flat array of one dtype (the model's parameters in
the layout's order), not from a shard's start: a shard may begin or end inside a
block, and then the ranks holding parts of it agree on its scale (the largest of
their parts).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: Elements per block (one float32 scale each: 4 bytes per 256, 1.6 % on top of the
#: one byte per element).
BLOCK = 256
#: A scale below this (float32's smallest normal) quantizes its block to zeros: its
#: reciprocal would overflow.
TINY = np.float32(np.finfo(np.float32).tiny)


class Format(NamedTuple):
    """An 8-bit float of magnitudes up to 1 (``E`` exponent bits, three mantissa
    bits, the exponent ``2^E - 1`` for 1.0), with a sign bit in the top bit or not.
    Its magnitude ``c`` (the code's low ``7`` or ``8`` bits) is, for ``c >= 8``, the
    float32 whose bits are ``(c + 8 * offset) << 20``, and below that ``c * 2^-sub``
    (the subnormals, evenly spaced up to the smallest normal ``2^(3 - sub)``)."""

    name: str
    signed: bool
    #: float32's exponent bias less this format's (127 - (2^E - 1)).
    offset: int
    #: ``-log2`` of the subnormals' spacing.
    sub: int

    @property
    def min_normal(self) -> np.float32:
        return np.float32(2.0 ** (3 - self.sub))

    @property
    def table(self) -> np.ndarray:
        """The 256 codes' values, float32, indexed by the byte."""
        return TABLES[self.name]


#: Adam's first moment: sign, 4 exponent bits, 3 mantissa bits (2^-17 ... 1).
SIGNED = Format("e4m3", True, 127 - 15, 17)
#: Adam's second moment: 5 exponent bits, 3 mantissa bits, no sign (2^-33 ... 1).
UNSIGNED = Format("e5m3", False, 127 - 31, 33)


def _decode_magnitudes(fmt: Format, mags: np.ndarray) -> np.ndarray:
    mags = mags.astype(np.uint32)
    normal = ((mags + np.uint32(8 * fmt.offset)) << np.uint32(20)).view(np.float32)
    sub = mags.astype(np.float32) * np.float32(2.0**-fmt.sub)
    return np.where(mags < 8, sub, normal).astype(np.float32)


def _table(fmt: Format) -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    if not fmt.signed:
        return _decode_magnitudes(fmt, codes)
    value = _decode_magnitudes(fmt, codes & np.uint32(0x7F))
    return np.where(codes >= 128, -value, value).astype(np.float32)


TABLES = {f.name: _table(f) for f in (SIGNED, UNSIGNED)}


def encode(a: np.ndarray, fmt: Format) -> np.ndarray:
    """The nearest magnitude code (ties to even) of float32 ``a`` (>= 0, at most a
    little above 1), as uint8: below the smallest normal, ``a * 2^sub`` rounded to an
    integer (float32's own rounding: add and subtract 2^23); above, the float32's bits
    rounded to three mantissa bits and re-biased."""
    a = np.asarray(a, np.float32)
    big = np.float32(2.0**23)
    sub = ((a * np.float32(2.0**fmt.sub) + big) - big).astype(np.int64)
    u = a.view(np.uint32).astype(np.int64)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 8 * fmt.offset
    return np.where(a < fmt.min_normal, sub, normal).astype(np.uint8)


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


def block_max(x: np.ndarray, offset: int, block: int = BLOCK) -> np.ndarray:
    """The largest magnitude of ``x`` (elements ``offset...`` of the flat array) in
    each block it touches, in float32; a block touched in part: of that part."""
    pieces = spans(offset, x.shape[0], block)
    out = np.zeros(len(pieces), np.float32)
    if pieces:
        np.maximum.reduceat(np.abs(x), [lo for _, lo, _ in pieces], out=out)
    return out


def reciprocal(scale: np.float32) -> np.float32:
    """What a block's elements are multiplied by before encoding: ``1 / scale`` in
    float32, 0 for a scale below :data:`TINY` (its block quantizes to zeros)."""
    scale = np.float32(scale)
    return np.float32(1.0) / scale if scale >= TINY else np.float32(0.0)


def quantize(
    x: np.ndarray, offset: int, scales: np.ndarray, fmt: Format, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (uint8) = the codes of float32 ``x`` (elements ``offset...``): the
    nearest of ``|x| * (1 / scale)`` and, signed, ``x``'s sign bit, ``scales``
    holding one per block touched."""
    for slot, lo, hi in spans(offset, x.shape[0], block):
        part = x[lo:hi]
        mags = encode(np.abs(part) * reciprocal(scales[slot]), fmt)
        if fmt.signed:
            mags |= (part.view(np.uint32) >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
        out[lo:hi] = mags


def dequantize(
    q: np.ndarray, offset: int, scales: np.ndarray, fmt: Format, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (float32) = ``fmt.table[q] * scale`` of each element's block."""
    for slot, lo, hi in spans(offset, q.shape[0], block):
        np.multiply(fmt.table[q[lo:hi]], scales[slot], out=out[lo:hi])


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


def adam8_math(
    param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, step: int,
    config: object, divisor: float = 1.0,
) -> None:  # fmt: skip
    """Adam/AdamW in float32 on equal-length arrays, in place (``m``, ``v`` the
    dequantized moments, then the new ones; ``grad`` consumed), in Kingma & Ba's
    efficient form (2015, end of Section 2): ``alpha_t = sqrt(1 - beta2^t) / (1 -
    beta1^t)`` and ``eps_t = eps * sqrt(1 - beta2^t)`` fold the bias corrections into
    two scalars, so an element takes two divisions and a square root, not four and
    one: ``p -= lr * (m / (sqrt(v) + eps_t) * alpha_t + wd * p)`` (decoupled decay;
    L2: ``g += wd * p`` first), with ``g = grad / divisor``. Every operation is done
    on every element, in this order, as the compiled loop does: the same bits."""
    c = config
    alpha, eps_t, dv, l2, dec = scalars8(step, c, divisor)
    np.divide(grad, dv, out=grad)
    grad += param * l2
    np.multiply(m, np.float32(c.beta1), out=m)  # type: ignore[attr-defined]
    m += grad * np.float32(1.0 - c.beta1)  # type: ignore[attr-defined]
    np.multiply(v, np.float32(c.beta2), out=v)  # type: ignore[attr-defined]
    v += (grad * grad) * np.float32(1.0 - c.beta2)  # type: ignore[attr-defined]
    u = np.sqrt(v)
    u += eps_t
    np.divide(m, u, out=u)
    u *= alpha
    u += param * dec
    param -= u * np.float32(c.lr)  # type: ignore[attr-defined]


def scalars8(step: int, c: object, divisor: float) -> tuple[np.float32, ...]:
    """``(alpha_t, eps_t, divisor, L2 decay, decoupled decay)`` as float32, as
    :func:`adam8_math` and the compiled loop use them (a divisor of 1 divides by 1;
    the decay not in use is 0)."""
    bc1 = 1.0 - c.beta1**step  # type: ignore[attr-defined]
    root = math.sqrt(1.0 - c.beta2**step)  # type: ignore[attr-defined]
    wd, decoupled = c.weight_decay, c.decoupled  # type: ignore[attr-defined]
    return (np.float32(root / bc1), np.float32(c.eps * root),  # type: ignore[attr-defined]
            np.float32(divisor), np.float32(0.0 if decoupled else wd),
            np.float32(wd if decoupled else 0.0))  # fmt: skip


def adam8_step(
    param: np.ndarray, grad: np.ndarray, qm: np.ndarray, qv: np.ndarray,
    sm: np.ndarray, sv: np.ndarray, offset: int, step: int, config: object,
    divisor: float = 1.0, block: int = BLOCK, kernel: str | None = None,
    variant: str | None = None,
) -> Edges:  # fmt: skip
    """Adam/AdamW (:func:`adam8_math`'s arithmetic) on a piece of the
    flat float32 parameters starting at global element ``offset``, its moments held
    in 8 bits (``qm`` signed map, ``qv`` unsigned; ``sm``/``sv`` the scales of the
    blocks the piece touches). Each block is dequantized, stepped in float32 and
    re-quantized with its new largest magnitude; a block held only in part is stepped
    and left in the returned :class:`Edges` for :func:`finish_edges` once its scale
    is agreed. ``grad`` is consumed. ``kernel`` and ``variant`` as for ``adam_step``
    (the compiled loop takes the whole blocks)."""
    from .adam import KERNEL

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
            for k in range(nb):
                lo, hi = head + k * block, head + (k + 1) * block
                s = lo_slot + k
                np.multiply(SIGNED.table[qm[lo:hi]], sm[s], out=m)
                np.multiply(UNSIGNED.table[qv[lo:hi]], sv[s], out=v)
                adam8_math(param[lo:hi], grad[lo:hi], m, v, step, config, divisor)
                for x, q, scales, fmt in ((m, qm, sm, SIGNED), (v, qv, sv, UNSIGNED)):
                    scales[s] = np.max(np.abs(x))
                    quantize(x, offset + lo, scales[s : s + 1], fmt, q[lo:hi], block)
    for slot, lo, hi in partial:  # stepped here, quantized once the scale is agreed
        m = np.multiply(SIGNED.table[qm[lo:hi]], sm[slot])
        v = np.multiply(UNSIGNED.table[qv[lo:hi]], sv[slot])
        adam8_math(param[lo:hi], grad[lo:hi], m, v, step, config, divisor)
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
        for x, q, scales, fmt, a in ((m, qm, sm, SIGNED, am), (v, qv, sv, UNSIGNED, av)):
            scales[slot] = a
            quantize(x, offset + lo, scales[slot : slot + 1], fmt, q[lo:hi], block)


def _compiled():  # type: ignore[no-untyped-def]
    from . import adam

    k = adam._kernels
    return k if k is not None and hasattr(k, "adam8") else None


def _adam8_compiled(
    param: np.ndarray, grad: np.ndarray, qm: np.ndarray, qv: np.ndarray, sm: np.ndarray,
    sv: np.ndarray, step: int, c: object, divisor: float, block: int, variant: str | None,
) -> None:  # fmt: skip
    from . import adam

    alpha, eps_t, dv, l2, dec = scalars8(step, c, divisor)
    adam._kernels.adam8(
        param, grad, qm, qv, sm, sv, c.lr, c.beta1, c.beta2,  # type: ignore[attr-defined]
        float(alpha), float(eps_t), float(dv), float(l2), float(dec), block,
        variant=variant or adam.VARIANT,
    )
