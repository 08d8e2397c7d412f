"""Stage 3's per-layer gathers, with the next layer's gather started ahead.

A model reads its layers in the same order every step (forward, then backward in
reverse). The first step records the order of its ``opt.gathered`` calls; from the
second step on, as soon as a layer's gather completes, the next layer's (by that
order) is started into the other of two gather buffers, so that it moves while the
model computes the current layer: FSDP's forward/backward prefetch, at most two
gathers in flight, for buckets of at least :data:`PREFETCH_MIN_ELEMS` elements. A
call that departs from the order waits for the gather in flight (every rank started
it), then gathers what was asked, and prefetching stops for the rest of that step:
results are right whatever the order, only the overlap is lost.

Every rank makes the same calls in the same order (``gathered`` is collective), so
every rank makes the same prefetch decisions: the collectives still pair up, and the
step's fingerprint still sees them.

Over several nodes with node shared memory (``nodes``) the two gather buffers are one
copy per node: each rank gathers its region of a layer (the shards of its local
index on every node) across nodes straight into the node's buffer, then one node
fence publishes the whole layer to the node's ranks. A buffer is written only once
every rank of the node is done reading it: after that fence (a gather started
ahead), or after one more fence before a gather that was not.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping

import numpy as np

from .mpi.collectives import Comm, Pending, Planned
from .mpi.nodes import Nodes
from .partition import Layout

#: Gathers started ahead and not yet completed, by request: with the prepared
#: collective, which keeps its buffers alive even if the optimizer is dropped. An
#: evaluation pass after the last step leaves one in flight; the exit completes it
#: (every rank started it), so MPI finalizes with no request outstanding.
_AHEAD: dict[int, tuple[Planned, Pending]] = {}


@atexit.register
def _complete_at_exit() -> None:
    for _, pending in list(_AHEAD.values()):
        pending.wait()
    _AHEAD.clear()


#: Buckets smaller than this many elements are not gathered ahead: their gather takes
#: a few microseconds, less than the nonblocking start, wait and bookkeeping cost
#: (measured with scripts/layer_cost: 2000 layers of 500 elements, W = 2, went from
#: 16 to 28 us per layer above the collectives when every gather was prefetched).
PREFETCH_MIN_ELEMS = 1 << 15


class LayerGather:
    """Gather buffers and prepared ``Allgatherv`` per bucket and slot; ``slots`` is 2
    (prefetch, with ``overlap``) or 1 (each gather blocking, one buffer). With
    ``nodes`` (several nodes, ``store`` node-shared) each gather is the cross-node one
    of this rank's region, then a node fence."""

    def __init__(
        self, comm: Comm, layout: Layout, store: Mapping[np.dtype, np.ndarray], slots: int,
        source: Callable[[int], np.ndarray], nodes: Nodes | None = None,
    ) -> None:  # fmt: skip
        self.slots, self.comm, self.layout = slots, comm, layout
        self.node = nodes.node if nodes is not None else None
        width = {d: layout.max_bucket(d) for d in layout.sizes}
        #: bufs[slot][index]: bucket index's gather buffer in slot
        self.bufs: list[list[np.ndarray]] = [
            [store[b.dtype][s * width[b.dtype] : s * width[b.dtype] + b.size]
             for b in layout.buckets]
            for s in range(slots)
        ]  # fmt: skip
        over, peers = comm, range(comm.size)
        if nodes is not None:
            assert nodes.cross is not None
            over, peers = nodes.cross, nodes.peers
        self.plans: list[list[Planned]] = [
            [over.plan_allgatherv(buf, [b.counts[r] for r in peers],
                                  [b.displs[r] for r in peers], i, send=source(i))
             for i, (b, buf) in enumerate(zip(layout.buckets, row, strict=True))]
            for row in self.bufs
        ]  # fmt: skip
        self.itemsizes = [row.itemsize for row in self.bufs[0]]
        #: whether bucket i is worth gathering ahead
        self.worth = [b.size >= PREFETCH_MIN_ELEMS for b in layout.buckets]
        self.order: list[int] = []  # the first step's gathers, in order
        self.recording = True
        self.pos = 0  # this step's gathers so far
        self.following = True  # ... and they followed the order
        self.inflight: tuple[int, int, Pending] | None = None  # (bucket, slot, request)

    def gather(self, index: int) -> int:
        """Collective: bucket ``index`` gathered; the slot that holds it. Starts the
        next bucket's gather when the calls follow the recorded order."""
        slot = 0
        ahead = self.inflight
        if ahead is not None:
            self.inflight = None
            ahead[2].wait()
            _AHEAD.pop(id(ahead[2]), None)
            slot = ahead[1]
            if ahead[0] != index:  # the order changed: gather what was asked instead
                self.following = False  # (into a buffer no rank reads since the fence)
                self.plans[slot][index].run()
        else:
            if self.node is not None:
                self.node.fence()  # every rank of the node is done with the buffer
            self.plans[slot][index].run()
        if self.node is not None:
            self._publish(index)
        if self.recording:
            self.order.append(index)
        elif self.slots > 1 and self.following:
            order, pos = self.order, self.pos
            if pos < len(order) and order[pos] == index:
                if pos + 1 < len(order) and self.worth[order[pos + 1]]:
                    other, nxt = 1 - slot, order[pos + 1]
                    planned = self.plans[other][nxt]
                    pending = planned.start()
                    _AHEAD[id(pending)] = (planned, pending)
                    self.inflight = (nxt, other, pending)
            else:
                self.following = False
        self.pos += 1
        return slot

    def _publish(self, index: int) -> None:
        """Node mode: every rank of the node has its region of bucket ``index`` in
        the node's buffer after one fence. Recorded (and booked) as the world
        ``Allgatherv`` it replaces."""
        bucket, comm = self.layout.buckets[index], self.comm
        comm.record_shared("allgatherv", index, bucket.size)
        comm.count_allgather(bucket.size, bucket.counts[comm.rank], self.itemsizes[index])
        self.node.fence()  # type: ignore[union-attr]

    def finish(self) -> None:
        """Complete the gather in flight, if any (before the shards change: Adam, a
        load; or before the buffers go)."""
        ahead, self.inflight = self.inflight, None
        if ahead is not None:
            ahead[2].wait()
            _AHEAD.pop(id(ahead[2]), None)

    def end_step(self) -> None:
        """A step begins its reduction: the order is recorded (after the first), and
        the next step follows it from the start."""
        self.finish()
        self.recording = False
        self.pos = 0
        self.following = True
