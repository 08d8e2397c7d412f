"""States that are not one entry per element, over a layout: one per block of the flat
parameters (an 8-bit state's scales), one per row or column of each matrix
(Adafactor's factored second moments), one per element of the vectors only.

Each such state is laid out by *units* of the flat parameters of a dtype
(:class:`Span`): a unit is a stretch of elements with ``width`` entries of the state,
and the units' entries follow one another in the order of the elements, so that a
stretch of elements touches one contiguous range of entries. A block of 256 elements
has one entry; a matrix (the last two dimensions of a parameter, ``n`` rows by ``m``
columns) has ``n`` entries of its rows' state and ``m`` of its columns'; an element of
a parameter with fewer than two dimensions has one entry of the vectors' state.

Units are cut from the flat parameters, not from a shard: the same at every world size
and stage. A rank holds the entries of every unit its part of a bucket touches; where
a part begins or ends inside a unit, the ranks (or buckets) holding the unit's other
elements hold its entries too. Their values must then be the same everywhere: 8-bit
Adam makes the scale of a block that parts share agree at the end of each update
(:class:`Agreement`); Adafactor computes a matrix's rows and columns from statistics
summed over every rank first. A checkpoint's section holds each entry once, written
by the rank whose part holds its unit's first element.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .partition import Layout

if TYPE_CHECKING:
    from .buffers import StateKind
    from .mpi.collectives import Comm


class Span(NamedTuple):
    """Flat elements ``start ... stop`` cut into units of ``unit`` elements (the last
    may be shorter), each with ``width`` entries, the first at entry ``base``."""

    start: int
    stop: int
    unit: int
    width: int
    base: int


class Spans:
    """A state's :class:`Span` list for one dtype, and what a stretch of elements
    touches and owns in it."""

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.starts = [s.start for s in spans]
        self.total = spans[-1].base + _units(spans[-1]) * spans[-1].width if spans else 0

    def touched(self, first: int, count: int) -> tuple[int, int]:
        """``(lo, hi)``: the entries of every unit elements ``first ... first +
        count`` touch (``(0, 0)`` for none)."""
        lo = hi = None
        stop = first + count
        for s in self._overlapping(first, stop):
            u0 = (max(first, s.start) - s.start) // s.unit
            u1 = (min(stop, s.stop) - 1 - s.start) // s.unit + 1
            lo = s.base + u0 * s.width if lo is None else lo
            hi = s.base + u1 * s.width
        return (lo, hi) if lo is not None and hi is not None else (0, 0)

    def owned(self, first: int, count: int) -> tuple[int, int]:
        """``(lo, hi)``: the entries of the units whose first element is among
        ``first ... first + count`` (their writer in a checkpoint); ``lo`` is where
        they would start when there are none."""
        lo = hi = None
        stop = first + count
        for s in self._overlapping(first, stop):
            u0 = -(-(max(first, s.start) - s.start) // s.unit)
            u1 = -(-(min(stop, s.stop) - s.start) // s.unit)
            if u1 > u0:
                lo = s.base + u0 * s.width if lo is None else lo
                hi = s.base + u1 * s.width
        if lo is None or hi is None:
            at = self.touched(first, count)[1] if count else 0
            return at, at
        return lo, hi

    def cut_units(self, cuts: Iterable[int]) -> list[tuple[int, int]]:
        """``(lo, hi)`` entries of every unit a boundary in ``cuts`` (flat elements)
        falls strictly inside, in order, each once."""
        found = set()
        for cut in cuts:
            for s in self._overlapping(cut - 1, cut + 1):
                if s.start < cut < s.stop and (cut - s.start) % s.unit:
                    u = (cut - s.start) // s.unit
                    found.add((s.base + u * s.width, s.base + (u + 1) * s.width))
        return sorted(found)

    def _overlapping(self, first: int, stop: int) -> list[Span]:
        if stop <= first:
            return []
        i = max(bisect.bisect_right(self.starts, first) - 1, 0)
        out = []
        while i < len(self.spans) and self.spans[i].start < stop:
            if self.spans[i].stop > first and self.spans[i].stop > self.spans[i].start:
                out.append(self.spans[i])
            i += 1
        return out


def _units(s: Span) -> int:
    return -(-(s.stop - s.start) // s.unit)


def spans_of(kind: StateKind, layout: Layout, dtype: np.dtype) -> Spans:
    """The units of ``kind`` (``per``: ``"block"``, ``"row"``, ``"column"``,
    ``"vector"``) over the flat parameters of ``dtype``."""
    if kind.per == "block":
        size = layout.sizes[dtype]
        return Spans([Span(0, size, kind.block, 1, 0)] if size else [])
    out, base = [], 0
    for p in layout.params:
        if p.dtype != dtype or p.size == 0:
            continue
        matrix = len(p.shape) >= 2
        if kind.per == "vector" and not matrix:
            out.append(Span(p.offset, p.offset + p.size, 1, 1, base))
            base += p.size
        elif kind.per in ("row", "column") and matrix:
            n, m = p.shape[-2], p.shape[-1]
            width = n if kind.per == "row" else m
            out.append(Span(p.offset, p.offset + p.size, n * m, width, base))
            base += p.size // (n * m) * width
    return Spans(out)


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
    """A bucket's entries in a rank's state: entries ``first ... first + count`` of
    its dtype's, at ``at`` in the buffer."""

    index: int
    first: int
    count: int
    at: int


def slots(layout: Layout, stage: int, dtype: np.dtype, spans: Spans) -> list[Slot]:
    """Every bucket of ``dtype``'s :class:`Slot` on this rank, in bucket order (the
    buffer holds them one after the other)."""
    out, at = [], 0
    for index, bucket in enumerate(layout.buckets):
        if bucket.dtype != dtype:
            continue
        lo, hi = spans.touched(*held(layout, stage, index))
        out.append(Slot(index, lo, hi - lo, at))
        at += hi - lo
    return out


def count(layout: Layout, stage: int, dtype: np.dtype, spans: Spans) -> int:
    """Entries of a state of ``dtype`` on this rank: the sum of its :func:`slots`'
    counts (for a state of one span, a per-block one, computed for every bucket at
    once: an estimate over thousands of ranks asks this of each)."""
    if len(spans.spans) != 1:
        return sum(s.count for s in slots(layout, stage, dtype, spans))
    span, rank = spans.spans[0], layout.rank
    mine = [b for b in layout.buckets if b.dtype == dtype]
    if stage == 0:
        held_ = np.array([(b.start, b.size) for b in mine], np.int64).reshape(-1, 2)
    else:
        held_ = np.array([(b.start + b.displs[rank], b.counts[rank]) for b in mine],
                         np.int64).reshape(-1, 2)  # fmt: skip
    first, stop = held_[:, 0], held_[:, 0] + held_[:, 1]
    lo, hi = np.maximum(first, span.start), np.minimum(stop, span.stop)
    some = (stop > first) & (hi > lo)  # (what Spans.touched counts as touching)
    units = (hi - 1 - span.start) // span.unit + 1 - (lo - span.start) // span.unit
    return int(np.sum(units[some])) * span.width


def in_run(spans: Spans, base: int, origin: int, lo: int, hi: int) -> slice:
    """The entries, in a run's state (its first element global element ``base``, its
    first entry ``origin``: ``spans.touched(base, run length)[0]``), of the units
    elements ``lo ... hi`` of the run touch."""
    start, stop = spans.touched(base + lo, hi - lo)
    return slice(start - origin, stop - origin) if stop > start else slice(0, 0)


def shared_blocks(layout: Layout, block: int) -> list[tuple[str, int]]:
    """``(dtype name, block)`` of every block of ``block`` elements that the parts of
    more than one (rank, bucket) touch at some stage: those a part boundary cuts. The
    same list on every rank (it depends on the layout only), in a fixed order."""
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
    """The end of an update for a rule with per-block states: the blocks that several
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
    """A bucket's state as a checkpoint sees it: ``held`` (the rank's entries, from
    entry ``first``) is what a load reads; ``own`` (a slice of it) is what this rank
    writes and checksums: the entries of the units whose first element it writes."""

    first: int
    held: np.ndarray
    own: slice
    dtype: np.dtype


def entries(
    layout: Layout, stage: int, store: Mapping[np.dtype, np.ndarray],
    spans: Mapping[np.dtype, Spans], written: Iterable[tuple[int, int]],
) -> list[Entry]:  # fmt: skip
    """Per bucket, its :class:`Entry` in ``store`` (the state by master dtype);
    ``written``: per bucket, the ``(first global element, count)`` this rank writes
    of the per-element states."""
    by_index = {s.index: s for d in spans for s in slots(layout, stage, d, spans[d])}
    out = []
    for (index, bucket), (a, n) in zip(enumerate(layout.buckets), written, strict=True):
        slot = by_index[index]
        view = store[bucket.dtype][slot.at : slot.at + slot.count]
        lo, hi = spans[bucket.dtype].owned(a, n)
        own = slice(lo - slot.first, hi - slot.first) if hi > lo else slice(0, 0)
        out.append(Entry(slot.first, view, own, bucket.dtype))
    return out
