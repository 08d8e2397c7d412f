"""States with one entry per block of elements (an 8-bit state's scales), over a
layout: which blocks each of this rank's parts touches, where their entries sit in
the rank's buffer, which blocks the parts of several ranks share, and who writes
each block to a checkpoint.

Blocks are cut from the start of a master dtype's flat parameters (block ``b`` is
elements ``b * n ... (b + 1) * n``), not from a shard's start, so that the blocks and
their values are the same at every world size and stage. A rank holds an entry for
every block its part of a bucket touches; where a part begins or ends inside a block,
the ranks (or buckets) holding the other elements of that block hold an entry of
their own, and the update rule makes them agree at the end of every update
(:class:`Agreement`: one ``MAX`` allreduce of a few numbers per part boundary). A
checkpoint's section holds one entry per block, written by the rank whose part
holds the block's first element.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .partition import Layout

if TYPE_CHECKING:
    from .mpi.collectives import Comm


def blocks_of(first: int, count: int, block: int) -> tuple[int, int]:
    """``(first block, stop)``: the blocks elements ``first ... first + count`` touch
    (none for ``count == 0``)."""
    if count <= 0:
        return 0, 0
    return first // block, (first + count - 1) // block + 1


def block_slice(base: int, lo: int, hi: int, block: int) -> slice:
    """The entries, in a part's block state, of elements ``lo ... hi`` of the part
    whose first element is global element ``base``."""
    start, stop = blocks_of(base + lo, hi - lo, block)
    origin = base // block
    return slice(start - origin, stop - origin) if stop else slice(0, 0)


def held(layout: Layout, stage: int, index: int, rank: int | None = None) -> tuple[int, int]:
    """``(first global element, count)`` of what the update rule runs on of bucket
    ``index`` on ``rank`` (default: the layout's): all of it in stage 0, the shard
    otherwise."""
    bucket = layout.buckets[index]
    if stage == 0:
        return bucket.start, bucket.size
    lo, hi = bucket.local(layout.rank if rank is None else rank)
    return bucket.start + lo, hi - lo


class Slot(NamedTuple):
    """A bucket's entries in a rank's block state: blocks ``first ... first + count``
    of its dtype, at ``at`` in the buffer."""

    index: int
    first: int
    count: int
    at: int


def slots(layout: Layout, stage: int, dtype: np.dtype, block: int) -> list[Slot]:
    """Every bucket of ``dtype``'s :class:`Slot` on this rank, in bucket order (the
    buffer holds them one after the other)."""
    out, at = [], 0
    for index, bucket in enumerate(layout.buckets):
        if bucket.dtype != dtype:
            continue
        first, stop = blocks_of(*held(layout, stage, index), block)
        out.append(Slot(index, first, stop - first, at))
        at += stop - first
    return out


def count(layout: Layout, stage: int, dtype: np.dtype, block: int) -> int:
    """Entries of a block state of ``dtype`` on this rank."""
    return sum(s.count for s in slots(layout, stage, dtype, block))


def total_blocks(size: int, block: int) -> int:
    """Blocks of a flat array of ``size`` elements (a checkpoint section's count)."""
    return -(-size // block)


def shared_blocks(layout: Layout, block: int) -> list[tuple[str, int]]:
    """``(dtype name, block)`` of every block that the parts of more than one
    (rank, bucket) touch at some stage: those a part boundary cuts. The same list on
    every rank (it depends on the layout only), in a fixed order."""
    found: set[tuple[str, int]] = set()
    for bucket in layout.buckets:
        for rank in range(layout.world_size):
            lo, hi = bucket.local(rank)
            if hi == lo:
                continue
            for edge in (bucket.start + lo, bucket.start + hi):
                if edge % block:
                    found.add((bucket.dtype.name, edge // block))
    return sorted(found)


class Agreement:
    """The end of an update for a rule with block states: the blocks that several
    parts hold get, on every rank, the largest of the values the parts propose
    (``MAX`` is exact, so every rank keeps the same bits)."""

    def __init__(self, comm: Comm, layout: Layout, block: int) -> None:
        self.comm = comm
        self.block = block
        self.index = {key: i for i, key in enumerate(shared_blocks(layout, block))}

    def __call__(self, proposed: Mapping[tuple[str, int], np.ndarray], width: int) -> None:
        """Collective: replace, in place, the ``width`` values proposed for each
        shared block (each a float32 array; a block this rank does not propose for
        counts as zeros) with their maximum over every rank."""
        values = np.zeros((len(self.index), width), np.float32)
        for key, value in proposed.items():
            i = self.index.get(key)
            if i is not None:
                values[i] = value
        if values.size:
            self.comm.max_inplace(values.reshape(-1))
        for key, value in proposed.items():
            i = self.index.get(key)
            if i is not None:
                value[...] = values[i]


class Entry(NamedTuple):
    """A bucket's block state as a checkpoint sees it: ``held`` (the rank's entries,
    blocks ``first ...``) is what a load reads; ``own`` (a slice of it) is what this
    rank writes and checksums: the blocks whose first element it writes."""

    first: int
    held: np.ndarray
    own: slice


def entries(
    layout: Layout, stage: int, store: Mapping[np.dtype, np.ndarray], block: int,
    written: Iterable[tuple[int, int]],
) -> list[Entry]:  # fmt: skip
    """Per bucket, its :class:`Entry` in ``store`` (the block state by master dtype);
    ``written``: per bucket, the ``(first global element, count)`` this rank writes
    of the per-element states."""
    out = []
    by_index = {s.index: s for d in {b.dtype for b in layout.buckets}
                for s in slots(layout, stage, d, block)}  # fmt: skip
    for (index, bucket), (a, n) in zip(enumerate(layout.buckets), written, strict=True):
        slot = by_index[index]
        view = store[bucket.dtype][slot.at : slot.at + slot.count]
        lo = -(-a // block) - slot.first  # the first block starting at or after a
        hi = -(-(a + n) // block) - slot.first
        out.append(Entry(slot.first, view, slice(max(lo, 0), max(hi, lo, 0))))
    return out
