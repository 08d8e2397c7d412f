"""Publishing the updated parameters after Adam: one small object per plan.

* :class:`NoGather`: stage 0 (Adam ran on everything everywhere) and stage 3 (the
  parameters stay sharded; ``opt.gathered`` gathers a layer when it is used);
* :class:`MPIGather`: ``Iallgatherv`` of each bucket as soon as Adam has updated this
  rank's part of it, advanced between the Adam chunks of the next buckets;
* :class:`SharedGather`: stage 2 in node shared memory: one fence, then each rank
  copies the other ranks' parts of every bucket from their segments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .mpi.collectives import Comm, Pending
from .mpi.shm import SharedSegment
from .partition import Layout
from .plan import Part


class NoGather:
    def started(self, index: int) -> None:
        """Adam is done with bucket ``index`` on this rank."""

    def progress(self) -> None:
        """Let started gathers advance (between chunks of other work)."""

    def finish(self) -> None:
        """Every rank holds the updated parameters."""


class MPIGather(NoGather):
    def __init__(self, comm: Comm, layout: Layout, parts: Sequence[Part]) -> None:
        self.comm = comm
        self.planned = [
            comm.plan_allgatherv(p.full_param, b.counts, b.displs, p.index)  # type: ignore[arg-type]
            for p, b in zip(parts, layout.buckets, strict=True)
        ]
        self.pending: list[Pending] = []

    def started(self, index: int) -> None:
        self.pending.append(self.planned[index].start())

    def progress(self) -> None:
        if self.pending:
            self.comm.progress(self.pending)

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        self.comm.wait_all(pending)


class SharedGather(NoGather):
    def __init__(
        self, comm: Comm, layout: Layout, segments: Mapping[np.dtype, SharedSegment]
    ) -> None:
        self.comm = comm
        self.layout = layout
        self.segments = segments

    def finish(self) -> None:
        """Collective, blocking: the allgathers of every bucket without messages.
        The next collective of the training loop keeps any rank from writing its part
        again before every rank has copied it."""
        comm, rank = self.comm, self.comm.rank
        for index, bucket in enumerate(self.layout.buckets):
            comm.record_shared("allgatherv", index, bucket.size)
        comm.fence()  # every rank's part is written
        for bucket in self.layout.buckets:
            segment = self.segments[bucket.dtype]
            local = segment.local
            for r, peer in enumerate(segment.peers):
                if r != rank and bucket.counts[r]:
                    lo = bucket.start + bucket.displs[r]
                    np.copyto(local[lo : lo + bucket.counts[r]], peer[lo : lo + bucket.counts[r]])
            comm.count_allgather(bucket.size, bucket.counts[rank], local.itemsize)
