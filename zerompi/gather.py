"""Publishing the updated parameters after Adam: one small object per plan.

* :class:`NoGather`: stage 0 (Adam ran on everything everywhere) and stage 3 (the
  parameters stay sharded; ``opt.gathered`` gathers a layer when it is used);
* :class:`MPIGather`: ``Iallgatherv`` of each bucket as soon as Adam has updated this
  rank's part of it, advanced between the Adam chunks of the next buckets;
* :class:`NodeGather`: stages 1-2 (3 on one node) with one copy of the parameters
  per node: Adam writes it in place; only the other nodes' parts are gathered, then
  one fence.
"""

from __future__ import annotations

from collections.abc import Sequence

from .mpi.collectives import Comm, Pending
from .mpi.nodes import Nodes
from .partition import Layout
from .plan import Part

#: Elements per Adam call in ``step()`` while gathers are in flight: between calls,
#: MPI advances the gathers of the buckets already updated (without a progress
#: thread, it moves data only inside MPI calls). ~1 MiB of float32: far above the
#: per-call cost, well below a bucket.
ADAM_CHUNK = 1 << 18
#: With nothing to advance, Adam takes a run in one call (alternated in one process
#: at 16M parameters, stage 0: within the noise of 256K-element calls, 128K slower).
WHOLE = 1 << 62


class NoGather:
    #: Elements per Adam call between two ``progress()`` calls.
    chunk = WHOLE

    def started(self, index: int) -> None:
        """Adam is done with bucket ``index`` on this rank."""

    def progress(self) -> None:
        """Let started gathers advance (between chunks of other work)."""

    def finish(self) -> None:
        """Every rank holds the updated parameters."""


class MPIGather(NoGather):
    chunk = ADAM_CHUNK

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


class NodeGather(NoGather):
    """Stages 1-2 (and 3 on one node) with one node-shared copy of the parameters:
    Adam wrote this rank's part of it in place. Over several nodes the ranks of each
    local index gather their shards across nodes (``Iallgatherv`` on the cross-node
    communicator, started per bucket as Adam finishes it) straight into their node's
    copy; then one node fence publishes the copy to every rank of the node."""

    def __init__(self, comm: Comm, nodes: Nodes, layout: Layout, parts: Sequence[Part]) -> None:
        self.comm, self.layout, self.node, self.cross = comm, layout, nodes.node, nodes.cross
        self.itemsizes = [p.full_param.itemsize for p in parts]  # type: ignore[union-attr]
        self.planned = []
        if nodes.count > 1:
            assert self.cross is not None
            peers = nodes.peers
            self.planned = [
                self.cross.plan_allgatherv(  # type: ignore[arg-type]
                    p.full_param, [b.counts[r] for r in peers], [b.displs[r] for r in peers],
                    p.index,
                )
                for p, b in zip(parts, layout.buckets, strict=True)
            ]
            self.chunk = ADAM_CHUNK  # the cross-node gathers advance between the chunks
        self.pending: list[Pending] = []

    def started(self, index: int) -> None:
        if self.planned:
            self.pending.append(self.planned[index].start())

    def progress(self) -> None:
        if self.pending:
            self.comm.progress(self.pending)

    def finish(self) -> None:
        """Collective: every bucket's cross-node gather done, then the node fence.
        Recorded (and booked) as the ``Allgatherv`` of every bucket it replaces."""
        pending, self.pending = self.pending, []
        if pending:
            self.cross.wait_all(pending)  # type: ignore[union-attr]
        comm, rank = self.comm, self.comm.rank
        for index, bucket in enumerate(self.layout.buckets):
            comm.record_shared("allgatherv", index, bucket.size)
            comm.count_allgather(bucket.size, bucket.counts[rank], self.itemsizes[index])
        self.node.fence()  # every rank of the node has written its part
