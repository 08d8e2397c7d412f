"""Bytes one optimizer step moves per rank, within and between nodes, without MPI.

The same books as :meth:`zerompi.mpi.collectives.Comm.pop_traffic` keeps, computed
from the layout: per collective ``sent``/``received`` is the algorithm-independent
volume (what must leave and reach the rank: ``(W-1)/W`` of a bucket, averaged over
ranks), and ``sent_between``/``received_between`` the part of it that crosses a node
boundary. Flat collectives exchange with every rank of other nodes; over node shared
memory (every stage with ``shared_memory``) nothing moves
between the ranks of a node and only the cross-node step crosses: the node's sums of
this rank's region
(reduction, in the master dtype) and this rank's shard to the other nodes (gather),
``N - 1`` pieces of ``1/W`` of a bucket instead of ``W - L``.

One step of one micro-batch, whose model enters every stage-3 layer twice (forward
and backward: two gathers per bucket, as ``python -m zerompi.bench`` does, each across
nodes once per node with shared memory; none on one node with shared memory, where
stage 3 reads the node's copy in place and the step publishes it as stages 1-2 do).
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter

import numpy as np

from ..partition import Layout
from ..precision import Precision

Books = dict[str, dict[str, int]]


def _book(books: Books, op: str, sent: int, received: int, between: tuple[int, int]) -> None:
    entry = books.setdefault(
        op, {"sent": 0, "received": 0, "sent_between": 0, "received_between": 0}
    )
    entry["sent"] += sent
    entry["received"] += received
    entry["sent_between"] += between[0]
    entry["received_between"] += between[1]


def step_traffic(
    layout: Layout, stage: int, precisions: Mapping[np.dtype, Precision],
    shared: bool, ranks_per_node: int,
) -> Books:  # fmt: skip
    """The traffic books of rank ``layout.rank`` after one step (see the module
    docstring); consecutive groups of ``ranks_per_node`` ranks are one node."""
    rank, world, per = layout.rank, layout.world_size, ranks_per_node
    node, local = rank // per, rank % per
    first, last = node * per, min((node + 1) * per, world)  # this rank's node
    far = world - (last - first)  # ranks on other nodes
    nodes = -(-world // per)
    peers = [n * per + local for n in range(nodes) if n * per + local < world]
    of_peers = itemgetter(*peers)  # (a tuple of counts: one item, or several)
    books: Books = {}
    low_any = any(p.low_grads for p in precisions.values())  # stage 1 reduces by MPI

    def between(op: str, counts: tuple[int, ...], it: int) -> tuple[int, int]:
        mine = counts[rank]
        theirs = bucket.size - sum(counts[first:last])  # what the other nodes hold
        if op == "allgatherv":
            return far * mine * it, theirs * it
        return theirs * it, far * mine * it

    for bucket in layout.buckets:
        prec = precisions[bucket.dtype]
        m, p, r = prec.master.itemsize, prec.param.itemsize, prec.reduce.itemsize
        counts, size = bucket.counts, bucket.size
        mine = counts[rank]
        region = sum(of_peers(counts)) if len(peers) > 1 else mine
        rs_textbook = ((size - mine) * r, (world - 1) * mine * r)
        ag_textbook = ((world - 1) * mine * p, (size - mine) * p)
        # -- the reduction
        node_full = shared and stage <= 1 and not low_any  # stages 0-1 summed in the node
        if stage == 0 and not prec.low_grads and not node_full:  # an Allreduce of the bucket
            volume = 2 * size * r * (world - 1) // world if world > 1 else 0
            cross = 2 * size * r * far // world
            _book(books, "allreduce", volume, volume, (cross, cross))
        elif shared and (stage >= 2 or node_full):  # within the node
            # by memory, then across nodes
            hier = ((region - mine) * m, (nodes - 1) * mine * m) if nodes > 1 else (0, 0)
            _book(books, "reduce_scatter", *rs_textbook, hier)
        else:  # a world reduce-scatter (or its alltoallv of narrower gradients)
            _book(books, "reduce_scatter", *rs_textbook, between("reduce_scatter", counts, r))
        if stage == 0 and prec.low_grads:  # the reduced shards gathered back
            _book(books, "allgather", (world - 1) * mine * m, (size - mine) * m,
                  between("allgatherv", counts, m))  # fmt: skip
        # -- the gather
        if stage == 0 and node_full:  # the reduced shards of this rank's local index
            # gathered across nodes, then the others' regions copied in
            hier = ((nodes - 1) * mine * m, (region - mine) * m) if nodes > 1 else (0, 0)
            _book(books, "allgather", (world - 1) * mine * m, (size - mine) * m, hier)
        elif shared and (stage in (1, 2) or (stage == 3 and nodes == 1)):  # the node's copy:
            # other nodes' shards into it (stage 3 on one node reads it in place)
            hier = ((nodes - 1) * mine * p, (region - mine) * p) if nodes > 1 else (0, 0)
            _book(books, "allgather", *ag_textbook, hier)
        elif stage in (1, 2):
            _book(books, "allgather", *ag_textbook, between("allgatherv", counts, p))
        elif stage == 3:  # forward and backward: across nodes once per node, or flat
            hier = ((nodes - 1) * mine * p, (region - mine) * p)
            for _ in range(2):
                _book(books, "allgather", *ag_textbook,
                      hier if shared else between("allgatherv", counts, p))  # fmt: skip
    return books
