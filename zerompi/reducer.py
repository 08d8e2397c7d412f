"""Gradient reduction: one interface, chosen once per optimizer from its plan.

* :class:`FullReducer` (stages 0-1): the model adds into full gradient buffers;
  ``step()`` reduces them bucket by bucket (stage 0: a blocking ``Allreduce``, which
  measured 1.6x faster than MPICH's ``Iallreduce`` here; stage 1: ``Ireduce_scatter``
  with :data:`REDUCE_WINDOW` buckets in flight, or with node shared memory the
  buffers' sums read in place, as stages 2-3 read their staging).
* :class:`StreamReducer` (stages 2-3): gradients are handed over bucket by bucket
  into a staging slot and reduced as soon as a bucket is complete, while the model
  computes the next one; two backends: ``Ireduce_scatter`` straight into the gradient
  shard (MPI), or sums read (and zeroed) from the peers' slots in node shared memory.

Both expose ``reduce(visit)``: ``visit(index)`` is called in bucket order as soon as
bucket ``index``'s reduced gradient (``parts[index].grad``) is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .buffers import REDUCE_WINDOW
from .mpi.collectives import Comm, Pending, Planned
from .mpi.nodes import Nodes
from .mpi.shm import SharedSegment
from .nodesum import NodeSum, Stats, sum_received
from .partition import Bucket, Layout
from .plan import Part

Visit = Callable[[int], None]


class FullReducer:
    """Stages 0-1: reduce the full gradient buffers at ``step()``.

    With 16-bit gradients (``recv``: the receive buffers of
    :func:`zerompi.buffers.buffer_plan`) the model's buffers must not accumulate
    micro-batches in 16 bits either: every ``end_micro_batch`` moves each rank's
    parts to their owners (``Alltoallv``), sums them into the master-dtype shard of
    the reduced gradient, and zeroes the 16-bit buffers; stage 0 then gathers the
    reduced shards at ``step()``.

    Stage 1 with node shared memory (``node_sum``; the full buffers are node-shared,
    one part per rank) sums this rank's region from every node rank's buffer into its
    own part's shard position (:class:`zerompi.nodesum.NodeSum`), then over several
    nodes reduce-scatters those node sums across nodes, as stages 2-3 do."""

    def __init__(
        self, comm: Comm, layout: Layout, parts: Sequence[Part], allreduce: bool,
        recv: Mapping[np.dtype, np.ndarray] | None = None, node_sum: NodeSum | None = None,
        nodes: Nodes | None = None, node_sums: Mapping[np.dtype, np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.layout, self.parts, self.allreduce = comm, layout, parts, allreduce
        self.split = bool(recv)
        self.node_sum = node_sum
        #: Per bucket, its statistics when its reduction computed them (one node).
        self.fused: list[Stats] = [None] * len(parts)
        if node_sum is not None:  # stage 1 in node shared memory (never 16-bit)
            self._plan_node(nodes, node_sums)  # type: ignore[arg-type]
            return
        if self.split:
            assert recv is not None
            width = {d: comm.size * layout.max_part(d) for d in recv}

            def region(i: int, b: Bucket) -> np.ndarray:  # window slot i % REDUCE_WINDOW
                lo = (i % REDUCE_WINDOW) * width[b.dtype]
                return recv[b.dtype][lo : lo + comm.size * b.counts[comm.rank]]

            self.planned = [
                comm.plan_alltoallv(p.full_grad, b.counts, b.displs, region(i, b), p.index)  # type: ignore[arg-type]
                for i, (p, b) in enumerate(zip(parts, layout.buckets, strict=True))
            ]  # fmt: skip
        else:
            self.planned = [] if allreduce else [
                comm.plan_reduce_scatter(p.full_grad, b.counts, tag=p.index)  # type: ignore[arg-type]
                for p, b in zip(parts, layout.buckets, strict=True)
            ]  # fmt: skip
        self.micro = 0  # micro-batches folded into the reduced shards (16-bit only)

    def _plan_node(self, nodes: Nodes, node_sums: Mapping[np.dtype, np.ndarray]) -> None:
        """Over several nodes: per bucket, where the node's sum of this rank's region
        goes (slot ``index % REDUCE_WINDOW`` of ``node_sums``) and the cross-node
        reduce-scatter of it into the shard."""
        self.node_views: list[np.ndarray] = []
        self.planned = []
        if nodes.count == 1:
            return
        cross, peers = nodes.cross, nodes.peers
        assert cross is not None
        wide = {d: a.shape[0] // REDUCE_WINDOW for d, a in node_sums.items()}
        for i, (p, b) in enumerate(zip(self.parts, self.layout.buckets, strict=True)):
            counts = [b.counts[r] for r in peers]
            lo = (i % REDUCE_WINDOW) * wide[b.dtype]
            self.node_views.append(node_sums[b.dtype][lo : lo + sum(counts)])
            self.planned.append(cross.plan_reduce_scatter(self.node_views[-1], counts, p.grad, i))

    def end_micro_batch(self) -> None:
        """Gradients keep summing in the full buffers; 16-bit ones are reduced now."""
        if not self.split:
            return
        n, comm = len(self.parts), self.comm
        started = [self.planned[i].start() for i in range(min(REDUCE_WINDOW, n))]
        for index, part in enumerate(self.parts):
            sum_received(part.stats, started[index].wait(), comm.size, self.micro > 0)
            part.full_grad.fill(0)  # type: ignore[union-attr]
            if index + REDUCE_WINDOW < n:  # its receive region is free again
                started.append(self.planned[index + REDUCE_WINDOW].start())
        self.micro += 1

    def flush(self) -> None:
        """Nothing is staged: the full buffers are reduced at ``step()``."""

    def _start(self, index: int) -> Pending:
        part = self.parts[index]
        buf = part.full_grad
        assert buf is not None
        if self.node_sum is not None:  # within the node from shared memory (then across)
            base, first = self.layout.buckets[index].start, index == 0
            if not self.planned:  # one node: the sum is the reduced gradient
                self.fused[index] = self.node_sum(index, base, part.grad, False, first, True)
                return Pending.done(part.grad)
            self.node_sum(index, base, self.node_views[index], False, first, True)
            return self.planned[index].start()
        if self.split:  # reduced already; stage 0 gathers the reduced shards
            if self.allreduce:
                bucket = self.layout.buckets[index]
                self.comm.allgatherv_inplace(part.grad, bucket.counts, bucket.displs, tag=index)
            return Pending.done(part.grad)
        if self.allreduce:
            self.comm.allreduce_inplace(buf, tag=index)
            return Pending.done(buf)
        return self.planned[index].start()

    def reduce(self, visit: Visit) -> None:
        n = len(self.parts)
        started = [self._start(i) for i in range(min(REDUCE_WINDOW, n))]
        for index in range(n):
            started[index].wait()
            if index + REDUCE_WINDOW < n:
                started.append(self._start(index + REDUCE_WINDOW))
            visit(index)

    def consumed(self) -> None:
        """After Adam: the full gradients were reduced in place; start from zero. In
        node shared memory the sums zeroed what they read, but this rank's own shard
        (the step's agreement came after every rank's sums: none still writes)."""
        self.micro = 0
        self.fused = [None] * len(self.parts)
        if self.split:
            return  # zeroed at every micro-batch; the reduced shards are overwritten
        for part in self.parts:
            assert part.full_grad is not None
            (part.full_grad if self.node_sum is None else part.grad).fill(0)

    def discard(self) -> None:
        self.micro = 0
        self.fused = [None] * len(self.parts)
        for part in self.parts:
            assert part.full_grad is not None
            part.full_grad.fill(0)

    def close(self) -> None:
        pass


class _Reduction(NamedTuple):
    """A started reduce-scatter of bucket ``index``: into the shard directly
    (``add=False``, its first of the step) or in place, to be added to the shard."""

    index: int
    pending: Pending
    add: bool
    slot: int | None  # staging slot it reads, or None
    #: A 16-bit reduction: ``pending`` delivers every rank's part of the bucket, to be
    #: summed here in the master dtype.
    split: bool = False


class StreamReducer:
    """Stages 2-3: gradients handed over bucket by bucket into ``slots`` staging
    slots (``staging[dtype]``, ``slots`` buckets of the largest size of that dtype).

    ``segments`` (node shared memory, one part per rank of ``nodes.node``) makes the
    reduction hierarchical: after a node fence each rank sums its region (its own
    shard with one node; over several, the shards of its local index on every node,
    :class:`zerompi.mpi.nodes.Nodes`) straight from its node's staging slots, into
    the shard (one node) or into ``node_sums`` (a slot-sized buffer per dtype) that
    the cross-node communicator then reduce-scatters into the shard."""

    def __init__(
        self, comm: Comm, layout: Layout, parts: Sequence[Part],
        staging: Mapping[np.dtype, np.ndarray], slots: int,
        segments: Mapping[np.dtype, SharedSegment] | None,
        make_full: Callable[[], Mapping[np.dtype, np.ndarray]] | None = None,
        recv: Mapping[np.dtype, np.ndarray] | None = None,
        nodes: Nodes | None = None, node_sums: Mapping[np.dtype, np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.layout, self.parts = comm, layout, parts
        self.slots, self.nodes = slots, nodes
        #: Over several nodes, per slot and bucket, where the node's sum of this
        #: rank's region goes (what the cross-node reduce-scatter sends), and per
        #: bucket the cross-node counts.
        self.node_views: list[list[np.ndarray]] = []
        self.cross_counts: list[list[int]] = []
        self.node_sum = None if segments is None or nodes is None else (
            NodeSum(comm, layout, nodes, segments))  # fmt: skip
        #: Per bucket, its statistics when its reduction computed them (one node).
        self.fused: list[Stats] = [None] * len(parts)
        if segments is not None and nodes is not None and nodes.count > 1:
            assert node_sums is not None
            peers = nodes.peers
            self.cross_counts = [[b.counts[r] for r in peers] for b in layout.buckets]
            wide = {d: a.shape[0] // slots for d, a in node_sums.items()}
            self.node_views = [
                [node_sums[b.dtype][s * wide[b.dtype] : s * wide[b.dtype] + sum(c)]
                 for b, c in zip(layout.buckets, self.cross_counts, strict=True)]
                for s in range(slots)
            ]  # fmt: skip
        #: 16-bit gradients over MPI: per dtype, ``slots`` regions of every rank's part
        #: of a bucket (see :func:`zerompi.buffers.buffer_plan`).
        self.recv: Mapping[np.dtype, np.ndarray] = {}
        self.use_recv(recv or {})
        width = {d: max((b.size for b in layout.buckets if b.dtype == d), default=0)
                 for d in staging}  # fmt: skip
        #: views[slot][index]: bucket index's staging buffer in slot
        self.offsets = [[s * width[b.dtype] for b in layout.buckets] for s in range(slots)]
        buckets = layout.buckets
        self.views = [
            [staging[b.dtype][off : off + b.size] for b, off in zip(buckets, row, strict=True)]
            for row in self.offsets
        ]
        self.names = [frozenset(b.names) for b in layout.buckets]
        self.reductions = [0] * len(parts)  # per bucket, this step
        self.open: int | None = None  # bucket whose gradients fill the open slot
        self.slot = 0
        #: Per dtype and slot (each dtype has its own staging), its leading elements
        #: zero in every node rank's part (zeroed by the sum within a node as it read
        #: them, so not again at ``begin``).
        self.clean = {d: [0] * slots for d in staging}
        #: its parameters not handed over yet (``None``: all of them)
        self.pending: set[str] | None = None
        self.inflight: list[_Reduction] = []
        #: Stage 2's full gradient buffers (``opt.grads``), reduced at every
        #: ``end_micro_batch`` once every rank agreed to use them.
        self.full: Mapping[np.dtype, np.ndarray] | None = None
        self.full_mode: bool | None = None  # decided once, collectively
        self.make_full = make_full  # allocates ``full`` (stage 2)
        #: planned[slot or -1 for ``full``][2 * bucket + add]: its prepared
        #: reduce-scatter and the in-flight entry that goes with it, made on first use
        self.planned: list[list[tuple[Planned, _Reduction] | None]] = [
            [None] * (2 * len(parts)) for _ in range(slots + 1)
        ]

    def use_recv(self, recv: Mapping[np.dtype, np.ndarray]) -> None:
        """Receive regions for 16-bit reductions over MPI (region ``slot`` of width
        ``world size x largest part``)."""
        self.recv = recv
        self.recv_width = {d: self.comm.size * self.layout.max_part(d) for d in recv}

    # -- hand-over ----------------------------------------------------------------

    def begin(self, index: int) -> np.ndarray:
        """The staging buffer to add bucket ``index``'s gradients into: the open one,
        or a fresh (zeroed) slot, which closes and starts reducing the open bucket."""
        if self.open == index:
            if self.inflight:
                self.comm.progress([r.pending for r in self.inflight])
            return self.views[self.slot][index]
        if self.open is not None:
            self.flush()
        slot = self.slot + 1
        if slot == self.slots:
            slot = 0
        if self.inflight:
            self._release(slot)
        self.slot = slot
        buf = self.views[slot][index]
        clean = self.clean[self.layout.buckets[index].dtype]
        if clean[slot] < buf.shape[0]:
            buf[clean[slot] :].fill(0)
        clean[slot] = 0  # written from now on
        self.open = index
        self.pending = None
        return buf

    def handed_over(self, index: int, names: Sequence[str] | None) -> None:
        """``names`` of bucket ``index`` are handed over (``None``: all of them);
        start its reduction once every parameter of the bucket is."""
        if self.open != index:
            return  # already started: a later bucket was begun
        if names is not None:
            if self.pending is None:
                self.pending = set(self.names[self.open])  # type: ignore[index]
            self.pending.difference_update(names)
            if self.pending:
                return
        self.flush()

    def flush(self) -> None:
        """Start reducing the open staging bucket into the gradient shard."""
        if self.open is not None:
            index, self.open = self.open, None
            self._start(index, self.views[self.slot][index], self.slot)

    def end_micro_batch(self) -> None:
        self.flush()
        if self.full_mode is None:  # once: did any rank use opt.grads before?
            self.full_mode = bool(self.comm.max(int(self.full is not None)))
        if self.full_mode:
            if self.full is None:  # another rank uses opt.grads: reduce ours too
                assert self.make_full is not None
                self.full = self.make_full()
            if self.recv:  # 16-bit: the full buffers' reductions use receive region 0
                self._complete(len(self.inflight))
            for index, bucket in enumerate(self.layout.buckets):
                self._start(index, self.full[bucket.dtype][bucket.start : bucket.stop], None)
            self._complete(len(self.inflight))
            for grad in self.full.values():
                grad.fill(0)

    # -- reduction --------------------------------------------------------------

    def _start(self, index: int, buf: np.ndarray, slot: int | None) -> None:
        """Collective: start reduce-scattering ``buf`` (bucket ``index``) into its
        gradient shard. The first reduction of a step lands in the shard directly,
        later ones (micro-batches) are added."""
        shard = self.parts[index].grad
        add = self.reductions[index] > 0
        self.reductions[index] += 1
        self.fused[index] = None
        if self.node_sum is not None and slot is not None:
            if not self.node_views:  # one node: summed into the shard, done
                self.fused[index] = self._shared_reduce(index, slot, shard, add)
                return
            buf = self.node_views[slot][index]
            self._shared_reduce(index, slot, buf, False)  # then across nodes, by MPI
        row = self.planned[-1 if slot is None else slot]
        made = row[2 * index + add]
        if made is None:
            made = row[2 * index + add] = self._plan(index, buf, slot, add, shard)
        made[0].start()  # (starts made[1].pending, which a planned collective reuses)
        self.inflight.append(made[1])
        if slot is None and made[1].split:
            self._complete(len(self.inflight))  # full buffers share one receive region

    def _plan(
        self, index: int, buf: np.ndarray, slot: int | None, add: bool, shard: np.ndarray
    ) -> tuple[Planned, _Reduction]:
        """The prepared collective of bucket ``index`` from ``buf``: a reduce-scatter
        into the shard, or (16-bit gradients) an alltoallv of every rank's part."""
        bucket, comm = self.layout.buckets[index], self.comm
        if self.node_views and slot is not None:  # the node sums, across nodes
            cross = self.nodes.cross  # type: ignore[union-attr]
            assert cross is not None
            counts = self.cross_counts[index]
            planned = cross.plan_reduce_scatter(buf, counts, None if add else shard, index)
            return planned, _Reduction(index, planned.pending, add, slot)
        if bucket.dtype in self.recv:
            width = self.recv_width[bucket.dtype]
            lo = (slot or 0) * width
            mine = bucket.counts[comm.rank]
            recv = self.recv[bucket.dtype][lo : lo + comm.size * mine]
            planned = comm.plan_alltoallv(buf, bucket.counts, bucket.displs, recv, index)
            return planned, _Reduction(index, planned.pending, add, slot, split=True)
        planned = comm.plan_reduce_scatter(buf, bucket.counts, None if add else shard, index)
        return planned, _Reduction(index, planned.pending, add, slot)

    def _shared_reduce(self, index: int, slot: int, out: np.ndarray, add: bool) -> Stats:
        """Blocking: this rank's region of bucket ``index`` summed over the node's
        staging slots into ``out`` and zeroed (:class:`zerompi.nodesum.NodeSum`), and
        one more node fence with a single slot, before a rank of the node reuses it."""
        stats = self.node_sum(index, self.offsets[slot][index], out, add, True, True)  # type: ignore[misc]
        bucket = self.layout.buckets[index]
        self.clean[bucket.dtype][slot] = bucket.size  # every rank zeroed its region
        if self.slots == 1:
            self.nodes.node.fence()  # type: ignore[union-attr]  # every rank has read it
        return stats

    def _complete(self, upto: int) -> None:
        """Finish the ``upto`` oldest started reductions, in the order started."""
        if upto >= len(self.inflight):  # the common case: all of them, no slicing
            done, self.inflight = self.inflight, []
        else:
            done, self.inflight = self.inflight[:upto], self.inflight[upto:]
        for reduction in done:
            reduced = reduction.pending.wait()
            if reduction.split:  # every rank's part: summed here, in the master dtype
                target = self.parts[reduction.index].grad
                sum_received(target, reduced, self.comm.size, reduction.add)
            elif reduction.add:
                target = self.parts[reduction.index].grad
                np.add(target, reduced, out=target)

    def _release(self, slot: int) -> None:
        """Wait until no started reduction still reads staging slot ``slot``."""
        inflight = self.inflight
        for i in range(len(inflight) - 1, -1, -1):  # the newest that reads it, and older
            if inflight[i].slot == slot:
                self._complete(i + 1)
                return

    def reduce(self, visit: Visit) -> None:
        self._complete(len(self.inflight))
        for index, part in enumerate(self.parts):
            if self.reductions[index] == 0:
                part.grad.fill(0)  # nothing was handed over: a zero gradient
                self.fused[index] = (0, 0.0)
            visit(index)

    def consumed(self) -> None:
        self.reductions = [0] * len(self.parts)
        self.fused = [None] * len(self.parts)

    def discard(self) -> None:
        """Drop every gradient added or reduced since the last step."""
        self._complete(len(self.inflight))  # MPI must be done with the buffers first
        for part in self.parts:
            part.grad.fill(0)
        if self.full is not None:
            for grad in self.full.values():
                grad.fill(0)
        self.open, self.pending = None, None
        self.consumed()

    def close(self) -> None:
        self._complete(len(self.inflight))
        self.open = None
