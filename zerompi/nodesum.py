"""Sums of gradient parts: the reduction within a node through shared memory.

A node's ranks write their gradients into node shared memory (stage 1's full
gradient buffers, stages 2-3's staging buckets; :mod:`zerompi.mpi.shm`); after one
node fence each rank sums its *region* of a bucket (its own shard on one node; over
several nodes the shards of its local index on every node,
:class:`zerompi.mpi.nodes.Nodes`) straight from every node rank's buffer, in rank
order. On one node that sum is the reduced gradient, and the compiled kernel also
returns its statistics (non-finite count, sum of squares) from the same pass, so the
step reads the reduced gradient once less (:func:`zerompi.adam.sum_parts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from . import adam
from .adam import accumulate, grad_stats, sum_parts_compiled
from .adam import sum_parts as _sum_same
from .mpi.collectives import Comm
from .mpi.nodes import Nodes
from .mpi.shm import SharedSegment
from .partition import Layout
from .plan import Run

#: ``(non-finite elements, sum of squares)`` of a reduced bucket, or ``None`` where
#: the reduction did not compute them (the step's statistics pass does).
Stats = tuple[int, float] | None


def sum_parts(
    out: np.ndarray, parts: Sequence[np.ndarray], add: bool, stats: bool = False,
    variant: str | None = None, clear: bool = False,
) -> Stats:  # fmt: skip
    """``out`` (+)= the sum of ``parts`` in rank order, in ``out``'s dtype: never in
    16 bits when the parts are narrower than ``out`` (no statistics then). ``out``
    may be one of the parts. ``clear`` leaves the parts zero (see
    :func:`zerompi.adam.sum_parts`). An overflow (inf, or inf - inf) is no warning:
    the step's agreement counts it, and loss scaling expects it."""
    if parts and parts[0].dtype != out.dtype:  # 16-bit parts: the compiled upcast-add
        for i, part in enumerate(parts):
            accumulate(out, part, add or i > 0)
            if clear:
                part.fill(0)
        return None
    return _sum_same(out, parts, add, stats, variant=variant, clear=clear)


def sum_received(out: np.ndarray, received: np.ndarray, ranks: int, add: bool) -> None:
    """:func:`sum_parts` of what an ``Alltoallv`` of a bucket delivered: every rank's
    part of ``len(out)`` elements, one after the other in rank order."""
    mine = out.shape[0]
    sum_parts(out, [received[q * mine : (q + 1) * mine] for q in range(ranks)], add)


class NodeSum:
    """The reduction of a bucket within this rank's node: ``segments`` (per dtype,
    one part per node rank) hold the node ranks' gradients, a bucket at a ``base``
    offset of each part that the caller gives."""

    def __init__(
        self, comm: Comm, layout: Layout, nodes: Nodes, segments: Mapping[np.dtype, SharedSegment]
    ) -> None:
        self.comm, self.layout, self.node, self.segments = comm, layout, nodes.node, segments
        #: Per bucket, the (start, stop) pieces of this rank's region.
        self.regions = [nodes.region(b.counts, b.displs) for b in layout.buckets]
        #: Whether the sum is the reduced gradient (one node) or goes on across nodes.
        self.final = nodes.count == 1
        #: Per master dtype, whether the compiled kernel sums its parts as they are
        #: (same dtype, contiguous slices): one call per bucket, no checks.
        self.compiled = {d: adam.KERNEL == "c" and s.local.dtype == d
                         for d, s in segments.items()}  # fmt: skip
        #: Whether the compiled sum writes a private ``out`` past the cache (no read
        #: for ownership: 4 of a float32 element's 16 bytes at two ranks): where the
        #: node's reduced shards together outgrow the largest cache, so that they
        #: would not be cached anyway when the update reads them after the last bucket.
        pieces = zip(layout.buckets, self.regions, strict=True)
        held = sum((hi - lo) * b.dtype.itemsize for b, region in pieces for lo, hi in region)
        self.stream = held * nodes.node.size > adam.CACHE_BYTES

    def __call__(
        self, index: int, base: int, out: np.ndarray, add: bool, fence: bool, clear: bool = False
    ) -> Stats:
        """Collective over the node: this rank's region of bucket ``index`` summed
        over every node rank's part (the bucket at ``base`` in each) into ``out``,
        after a node fence (``fence``: the caller's first sum since the node's ranks
        wrote). On one node also the statistics of the result (unless 16-bit).
        ``clear`` zeroes the region in every part in the same pass: once every node
        rank did, the bucket is zero in every part (the regions cover it), ready for
        the next gradients without a zeroing pass."""
        bucket = self.layout.buckets[index]
        segment = self.segments[bucket.dtype]
        comm = self.comm
        comm.record_shared("reduce_scatter", index, bucket.size)
        if fence:
            self.node.fence()  # every rank's bucket is written
        stats: Stats = None  # on one node the region is one piece: the own shard
        at = 0
        for lo, hi in self.regions[index]:
            parts = [peer[base + lo : base + hi] for peer in segment.peers]
            if self.compiled[bucket.dtype]:
                stats = sum_parts_compiled(out[at : at + hi - lo], parts, add, self.final,
                                           None, clear, self.stream)  # fmt: skip
            else:
                stats = sum_parts(out[at : at + hi - lo], parts, add, self.final, None, clear)
            at += hi - lo
        comm.count_reduce_scatter(bucket.size, bucket.counts[comm.rank], segment.local.itemsize)
        return stats


class StatsRuns:
    """The step's gradient statistics (non-finite count, sum of squares), added up
    run by run of reduced buckets contiguous in memory (:func:`zerompi.plan.runs`): a
    run's from what its buckets' reductions computed where all of them did, else
    from one pass over the run."""

    def __init__(self, runs: Sequence[Run], buckets: int) -> None:
        #: At each run's last bucket: its first bucket, its statistics view and scratch.
        self.ends: list[tuple[int, np.ndarray, np.ndarray] | None] = [None] * buckets
        first = 0
        for run in runs:
            self.ends[run.last] = (first, run.arrays[0], run.scratch)
            first = run.last + 1

    def add(self, index: int, fused: Sequence[Stats], out: np.ndarray) -> None:
        """Bucket ``index`` is reduced: if it ends a run, add the run's statistics
        to ``out[0]`` (non-finite elements) and ``out[1]`` (sum of squares)."""
        end = self.ends[index]
        if end is None:
            return  # the run goes on
        first, grad, scratch = end
        done = fused[first : index + 1]
        if all(d is not None for d in done):
            out[0] += sum(d[0] for d in done)  # type: ignore[index]
            out[1] += sum(d[1] for d in done)  # type: ignore[index]
        else:
            bad, sumsq = grad_stats(grad, scratch)
            out[0] += bad
            out[1] += sumsq


class NodeCopies:
    """Stage 0 in node memory, once every rank has its shard of every bucket reduced
    in its own full gradient buffer (:class:`NodeSum`, in place, zeroing nothing:
    these copies overwrite the rest, and the buffer is zeroed after Adam). Over
    several nodes, the ranks of each local index first gather their reduced shards
    across nodes (``Allgatherv`` on the cross-node communicator, straight into their
    buffers), so each holds its whole *region*. Then each rank copies the other
    local indices' regions from their node ranks' buffers into its own, so every rank
    holds the whole reduced gradient (an ``Allreduce`` through memory; each byte read
    once here, where MPI's moves it through its shared cells). A node fence before
    (every region is complete) and one after (no rank zeroes or refills its buffer
    while another still copies from it). ``full[index]``: bucket ``index`` of this
    rank's full gradient buffer."""

    def __init__(
        self, comm: Comm, layout: Layout, nodes: Nodes, segments: Mapping[np.dtype, SharedSegment],
        full: Sequence[np.ndarray],
    ) -> None:  # fmt: skip
        self.comm, self.layout, self.node, self.full = comm, layout, nodes.node, full
        self.cross = nodes.cross
        #: Per bucket: (this rank's copy, a node rank's sums) of every other region.
        self.copies = [
            [(full[i][lo:hi], segments[b.dtype].peers[q][b.start + lo : b.start + hi])
             for q in range(nodes.size) if q != nodes.local
             for owner in nodes.with_local(q) for lo, hi in (b.local(owner),) if hi > lo]
            for i, b in enumerate(layout.buckets)
        ]  # fmt: skip
        #: Per bucket, over several nodes: the gather of this rank's region.
        self.planned = []
        if nodes.count > 1:
            assert self.cross is not None
            peers = nodes.peers
            self.planned = [
                self.cross.plan_allgatherv(
                    full[i], [b.counts[r] for r in peers], [b.displs[r] for r in peers], i
                )
                for i, b in enumerate(layout.buckets)
            ]

    def __call__(self) -> None:
        """Collective over the node (over the nodes too, where there are several):
        the others' shards into this rank's buffer."""
        comm = self.comm
        if self.planned:  # this rank's region, from the other nodes
            self.cross.wait_all([p.start() for p in self.planned])  # type: ignore[union-attr]
        self.node.fence()  # every rank's region is in its buffer
        for index, bucket in enumerate(self.layout.buckets):
            comm.record_shared("allgatherv", index, bucket.size)
            for mine, theirs in self.copies[index]:
                np.copyto(mine, theirs)
            comm.count_allgather(bucket.size, bucket.counts[comm.rank], bucket.dtype.itemsize)
        self.node.fence()  # every rank copied: the buffers may be zeroed and refilled
