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


def blocks_of(offset: int, n: int, block: int = BLOCK) -> tuple[int, int]:
    """``(first, stop)``: the blocks that elements ``offset ... offset + n`` of the
    flat array touch (none for ``n == 0``)."""
    if n <= 0:
        return 0, 0
    return offset // block, (offset + n - 1) // block + 1


def block_max(x: np.ndarray, offset: int, block: int = BLOCK) -> np.ndarray:
    """The largest magnitude of ``x`` (elements ``offset...`` of the flat array) in
    each block it touches, in float32; a block touched in part: of that part."""
    first, stop = blocks_of(offset, x.shape[0], block)
    out = np.zeros(stop - first, np.float32)
    if x.shape[0] == 0:
        return out
    cuts = [max(b * block - offset, 0) for b in range(first, stop)]
    np.maximum.reduceat(np.abs(x), cuts, out=out)
    return out


def quantize(
    x: np.ndarray, offset: int, scales: np.ndarray, codes: np.ndarray, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (uint8) = the nearest codes of float32 ``x`` (elements ``offset...``)
    divided by its block's scale, ``scales`` holding one per block touched. A zero
    scale (an all-zero block) gives the code of 0."""
    first, stop = blocks_of(offset, x.shape[0], block)
    mids = MIDS[id(codes)]
    zero = int(np.searchsorted(codes, 0.0))
    for b in range(first, stop):
        lo = max(b * block - offset, 0)
        hi = min((b + 1) * block - offset, x.shape[0])
        scale = scales[b - first]
        if scale == 0:
            out[lo:hi] = zero
            continue
        y = x[lo:hi] / scale  # float32
        out[lo:hi] = np.searchsorted(mids, y, side="left")


def dequantize(
    q: np.ndarray, offset: int, scales: np.ndarray, codes: np.ndarray, out: np.ndarray,
    block: int = BLOCK,
) -> None:  # fmt: skip
    """``out`` (float32) = ``codes[q] * scale`` of each element's block."""
    first, stop = blocks_of(offset, q.shape[0], block)
    for b in range(first, stop):
        lo = max(b * block - offset, 0)
        hi = min((b + 1) * block - offset, q.shape[0])
        np.multiply(codes[q[lo:hi]], scales[b - first], out=out[lo:hi])
