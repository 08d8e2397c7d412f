"""How one bucket's gradients become its reduced shard: one small object per bucket,
chosen when the engine is built (:class:`zerompi.plan.Reduce`, by the bucket's
precision and the plan).

Every backend has the same interface, so the schedulers of :mod:`zerompi.reducer`
never ask which one they drive:

* ``start(src, slot, add)``, collective: start reducing ``src`` (the bucket's
  gradients as the model handed them over: a staging slot, or the full buffer of
  stages 0-1) into the bucket's shard of the reduced gradient (``part.grad``),
  replacing it or, with ``add`` (a later micro-batch of the step), adding to it.
  Returns the :class:`InFlight` reduction, or ``None`` when it completed at once.
  ``slot`` names the source (a staging slot, a window slot of stages 0-1, ``None``
  for stage 2's full buffers): what is prepared for it is made once and reused.
* :meth:`InFlight.wait`: complete it; the result is in the shard.
* ``stats``: the statistics (non-finite count, sum of squares) of the last
  reduction where its own pass computed them (a node sum on one node), else ``None``.
* ``clears``: whether a reduction leaves ``src`` zero (a node sum zeroes what it
  reads, so the staging needs no zeroing pass).

The backends: :class:`ReduceScatter` (MPI's, exact counts), :class:`Allreduce`
(stage 0), :class:`Split` (gradients narrower than the master: every rank's part
moved by ``Alltoallv`` and summed here in the master dtype, never in 16 bits by
MPI), :class:`NodeReduce` (node shared memory: each rank sums its region from its
node's buffers, then, over several nodes, a cross-node reduce-scatter of the node
sums) and, for 16-bit stage 0, :class:`GatherReduced` (the reduced parts gathered back
at the step) and :class:`Reduced` (nothing left to do at the step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .mpi.collectives import Comm, Planned
from .nodesum import NodeSum, Stats, sum_received
from .partition import Bucket


class InFlight:
    """A prepared reduction of one bucket from one source: :meth:`start` hands it to
    MPI, :meth:`wait` completes it and lands the result in the shard (``land``: an
    add, or the sum of every rank's part; ``None``: MPI wrote it in place)."""

    __slots__ = ("_land", "_planned", "pending", "slot")

    def __init__(
        self, planned: Planned, slot: int | None,
        land: Callable[[np.ndarray], object] | None = None,
    ) -> None:  # fmt: skip
        self._planned, self._land, self.slot = planned, land, slot
        self.pending = planned.pending  # the one Pending a planned collective reuses

    def start(self) -> InFlight:
        self._planned.start()
        return self

    def wait(self) -> None:
        reduced = self.pending.wait()
        if self._land is not None:
            self._land(reduced)


def _reduce_scatter(
    comm: Comm, src: np.ndarray, counts: Sequence[int], shard: np.ndarray, add: bool,
    slot: int | None, tag: int,
) -> InFlight:  # fmt: skip
    """A prepared reduce-scatter of ``src`` (cut by ``counts`` over ``comm``) into
    ``shard``: in place where the shard is the top of ``src`` (stage 1), straight into
    it for a step's first reduction, else in place and then added to it."""
    if shard.ctypes.data == src.ctypes.data:  # (an empty shard too: its top is src's)
        return InFlight(comm.plan_reduce_scatter(src, counts, tag=tag), slot)
    if not add:
        return InFlight(comm.plan_reduce_scatter(src, counts, shard, tag), slot)

    def added(reduced: np.ndarray) -> None:
        np.add(shard, reduced, out=shard)

    return InFlight(comm.plan_reduce_scatter(src, counts, tag=tag), slot, added)


class _Prepared:
    """What every backend shares: its bucket and shard, and the reductions it has
    prepared, one per ``(slot, add)``, made on first use."""

    clears = False
    stats: Stats = None
    #: Its reductions without a slot (stage 2's full buffers) all use receive region
    #: 0, the first staging slot's: one at a time.
    one_region = False

    def __init__(self, comm: Comm, bucket: Bucket, index: int, shard: np.ndarray) -> None:
        self.comm, self.bucket, self.index, self.shard = comm, bucket, index, shard
        self.prepared: dict[tuple[int | None, bool], InFlight] = {}

    def _prepare(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight:
        raise NotImplementedError

    def start(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight | None:
        flight = self.prepared.get((slot, add))
        if flight is None:
            flight = self.prepared[slot, add] = self._prepare(src, slot, add)
        return flight.start()


class ReduceScatter(_Prepared):
    """``Ireduce_scatter`` over the communicator with the bucket's exact counts."""

    def _prepare(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight:
        return _reduce_scatter(self.comm, src, self.bucket.counts, self.shard, add, slot,
                               self.index)  # fmt: skip


class Split(_Prepared):
    """Gradients narrower than the master: ``Alltoallv`` of the bucket, so that each
    rank receives every rank's part of its shard (in the narrow dtype, into a
    receive region per slot of ``recv``), summed here in rank order in the master
    dtype (``shard`` is this rank's part of the reduced gradient)."""

    one_region = True

    def __init__(
        self, comm: Comm, bucket: Bucket, index: int, shard: np.ndarray, recv: np.ndarray,
        width: int,
    ) -> None:  # fmt: skip
        super().__init__(comm, bucket, index, shard)
        self.recv, self.width = recv, width  # the receive buffer, and one region's width

    def _prepare(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight:
        comm, bucket, shard = self.comm, self.bucket, self.shard
        lo = (slot or 0) * self.width
        region = self.recv[lo : lo + comm.size * bucket.counts[comm.rank]]
        planned = comm.plan_alltoallv(src, bucket.counts, bucket.displs, region, self.index)

        def summed(received: np.ndarray) -> None:
            sum_received(shard, received, comm.size, add)

        return InFlight(planned, slot, summed)


class NodeReduce(_Prepared):
    """Node shared memory: after a node fence (``fence``: before each sum; else only
    the caller's first), this rank sums its region of the bucket from every node
    rank's buffer (the bucket at ``bases[slot]`` in each part of ``node_sum``'s
    segments) and zeroes what it read. On one node the region is the shard and the
    sum its reduced gradient, with its statistics from the same pass; over several,
    the sum goes to ``views[slot]`` and a cross-node reduce-scatter (``cross``,
    ``cross_counts``) takes it into the shard. ``fence_after``: one more node fence
    after each sum (a single staging slot, which a node rank reuses next).
    ``clears=False`` leaves the buffers as read (the staging then gets a zeroing
    pass before its next hand-over: ``scripts/clear_ab`` measures the difference)."""

    def __init__(
        self, comm: Comm, bucket: Bucket, index: int, shard: np.ndarray, node_sum: NodeSum,
        bases: Sequence[int], fence: bool, fence_after: bool,
        cross: Comm | None = None, cross_counts: Sequence[int] = (),
        views: Sequence[np.ndarray] = (), clears: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(comm, bucket, index, shard)
        self.node_sum, self.bases = node_sum, bases
        self.fence, self.fence_after = fence, fence_after
        self.cross, self.cross_counts, self.views = cross, cross_counts, views
        self.clears = clears

    def start(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight | None:
        index, base = self.index, self.bases[slot or 0]
        if self.cross is None:  # one node: the sum is the reduced gradient
            self.stats = self.node_sum(index, base, self.shard, add, self.fence, self.clears)
            self._fenced()
            return None
        self.stats = None
        view = self.views[slot or 0]
        self.node_sum(index, base, view, False, self.fence, self.clears)
        self._fenced()
        return super().start(view, slot, add)

    def _fenced(self) -> None:
        if self.fence_after:
            self.node_sum.node.fence()  # every rank of the node has read the slot

    def _prepare(self, src: np.ndarray, slot: int | None, add: bool) -> InFlight:
        assert self.cross is not None
        return _reduce_scatter(self.cross, src, self.cross_counts, self.shard, add, slot,
                               self.index)  # fmt: skip


class Allreduce(_Prepared):
    """Stage 0: a blocking ``Allreduce`` of the whole bucket, in place (measured 1.6x
    faster than MPICH's ``Iallreduce`` here); the shard is the bucket."""

    def start(self, src: np.ndarray, slot: int | None, add: bool) -> None:
        self.comm.allreduce_inplace(src, tag=self.index)


class GatherReduced(_Prepared):
    """16-bit stage 0 at ``step()``: every micro-batch was reduced already
    (:class:`Split`, each rank its part); the reduced parts are gathered back into
    every rank's whole bucket (``shard``: the bucket of the reduced gradient)."""

    def start(self, src: np.ndarray, slot: int | None, add: bool) -> None:
        bucket = self.bucket
        self.comm.allgatherv_inplace(self.shard, bucket.counts, bucket.displs, tag=self.index)


class Reduced(_Prepared):
    """16-bit stage 1 at ``step()``: every micro-batch was reduced already."""

    def start(self, src: np.ndarray, slot: int | None, add: bool) -> None:
        return None


#: What a scheduler drives per bucket.
Backend = ReduceScatter | Split | NodeReduce | Allreduce | GatherReduced | Reduced


def recv_regions(
    comm: Comm, recv: Mapping[np.dtype, np.ndarray], max_part: Callable[[np.dtype], int]
) -> dict[np.dtype, tuple[np.ndarray, int]]:
    """Per master dtype, the receive buffer of :class:`Split` and the width of one of
    its regions (every rank's part of the largest shard)."""
    return {d: (buf, comm.size * max_part(d)) for d, buf in recv.items()}
