"""How the ranks of a communicator sit on nodes: the node communicator (the ranks
that share this node's memory) and the cross communicator (the ranks with this
rank's local index on every node), the two halves of a hierarchical collective.

Shards stay where :func:`zerompi.partition.shard_range` puts them (rank ``r`` of the
communicator owns shard ``r``, whatever the placement): a rank with local index
``j`` serves, within its node, the *region* of a bucket made of the shards of the
ranks with local index ``j`` on every node (one piece per node). Its node's ranks
sum that region from their shared staging buffers (no message), and the cross
communicator reduce-scatters the node sums, one piece per node, with exact counts;
the gather after Adam goes the other way, straight into the node's one shared copy
of the parameters. With one node the region is the rank's own shard and nothing
crosses a node.

``ZEROMPI_NODE_SIZE=L`` makes consecutive groups of ``L`` ranks (of ``COMM_WORLD``)
one "node", so that a single machine runs the multi-node paths.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .collectives import Comm
from .shm import Heartbeat, SharedSegment
from .watchdog import OPS

#: Consecutive groups of this many COMM_WORLD ranks are one node (tests, one machine).
NODE_SIZE_ENV = "ZEROMPI_NODE_SIZE"


def forced_node_size() -> int | None:
    """``$ZEROMPI_NODE_SIZE`` as a positive int, or ``None`` (then MPI decides)."""
    text = os.environ.get(NODE_SIZE_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{NODE_SIZE_ENV} must be a positive integer, got {text!r}")
    return int(text)


def split_node(comm: Comm) -> MPI.Intracomm:
    """Collective (under the watchdog): the ranks of ``comm`` on this node, in
    ``comm``'s rank order, as a new MPI communicator the caller frees."""
    size = forced_node_size()
    if size is not None:
        color = MPI.COMM_WORLD.Get_rank() // size
        return comm._blocking("split", -1, lambda: comm.mpi.Split(color, comm.rank))
    return comm._blocking(
        "split", -1, lambda: comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    )


class Nodes:
    """The node layout of a communicator (collective to build, identical on every
    rank): ``members[n]`` are the communicator ranks of node ``n`` in rank order
    (nodes ordered by their first rank); this rank is ``members[index][local]``.
    ``node`` is this node's :class:`Comm`; ``cross``, when every node has the same
    number of ranks (``uniform``), the ranks with this local index on every node,
    ordered by node (else ``None``). Both share the parent's watchdog timeout; the
    caller :meth:`free` s them."""

    def __init__(self, comm: Comm) -> None:
        node_mpi = split_node(comm)
        self.node = Comm(node_mpi, timeout=comm.timeout)
        mine = tuple(self.node.allgather(comm.rank))
        everyone: list[tuple[int, ...]] = comm.allgather(mine)
        self.members: list[tuple[int, ...]] = sorted(set(everyone))
        self.index = self.members.index(mine)
        self.local = mine.index(comm.rank)
        self.size = len(mine)  # ranks on this node
        self.count = len(self.members)  # nodes
        self.uniform = len({len(m) for m in self.members}) == 1
        self.cross: Comm | None = None
        if self.uniform:
            color, key = self.local, self.index
            cross_mpi = comm._blocking("split", -1, lambda: comm.mpi.Split(color, key))
            self.cross = Comm(cross_mpi, timeout=comm.timeout)

    @property
    def peers(self) -> list[int]:
        """The communicator ranks with this rank's local index, one per node, in node
        order: whose shards make up this rank's region (uniform layouts only)."""
        return self.with_local(self.local)

    def with_local(self, local: int) -> list[int]:
        """The communicator ranks with local index ``local``, one per node, in node
        order: whose shards make up that index's region (uniform layouts only)."""
        return [m[local] for m in self.members]

    def region(self, counts: Sequence[int], displs: Sequence[int]) -> list[tuple[int, int]]:
        """This rank's region of a bucket cut by ``counts``/``displs`` (per
        communicator rank): ``(start, stop)`` of each peer's shard, in node order."""
        return [(displs[r], displs[r] + counts[r]) for r in self.peers]

    def free(self) -> None:
        for c in (self.node, self.cross):
            if c is not None and c.mpi != MPI.COMM_NULL:
                c.mpi.Free()
        self.cross = None

    def __repr__(self) -> str:
        return (
            f"Nodes({self.count} node(s) of {[len(m) for m in self.members]} rank(s); "
            f"this rank: node {self.index}, local {self.local})"
        )


def _delete(comm: MPI.Comm, keyval: int, cached: dict[int | None, Nodes]) -> None:
    for nodes in cached.values():
        nodes.free()


_KEYVAL: int | None = None


def nodes_of(comm: Comm) -> Nodes:
    """Collective the first time per communicator (and ``$ZEROMPI_NODE_SIZE``): the
    :class:`Nodes` of ``comm``, cached on the MPI communicator as an attribute, so
    that the node and cross communicators are made once and freed with it (an
    optimizer per test must not use up MPI's communicator ids)."""
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete)
    cached = comm.mpi.Get_attr(_KEYVAL)
    if cached is None:
        cached = {}
        comm.mpi.Set_attr(_KEYVAL, cached)
    key: int | None = None
    error: BaseException | None = None
    try:
        key = forced_node_size()
    except ValueError as exc:
        error = exc
    # A bad $ZEROMPI_NODE_SIZE on any rank is an error on every rank, and so is one
    # that differs between ranks (they would split differently).
    comm.settle(error, [(f"${NODE_SIZE_ENV}", key)])
    nodes = cached.get(key)
    if nodes is None:
        nodes = cached[key] = Nodes(comm)
    for c in (nodes.node, nodes.cross):
        if c is not None:
            c.timeout = comm.timeout
    if nodes.cross is not None:  # its bytes all cross nodes: booked in comm's books
        nodes.cross.books = comm.books
        nodes.cross.offnode = [r != nodes.cross.rank for r in range(nodes.cross.size)]
    mine = set(nodes.members[nodes.index])
    offnode = [r not in mine for r in range(comm.size)]
    comm.offnode = offnode if any(offnode) else None
    return nodes


def enable_heartbeat(comm: Comm) -> None:
    """Collective: keep this node's heartbeat in shared memory, so that a rank of
    ``comm`` whose wait times out can name the ranks of its node that have not
    arrived (:mod:`.watchdog`). Nothing to do with one rank or without a timeout;
    where shared memory is not available the watchdog reports only itself."""
    if comm.heartbeat is not None or comm.size == 1 or comm.timeout is None:
        return
    node = comm._blocking("split", -1, lambda: comm.mpi.Split_type(MPI.COMM_TYPE_SHARED))
    try:
        local = Comm(node, timeout=comm.timeout)
        ranks = local.allgather(comm.rank)
        try:
            segment = SharedSegment(local, 8, np.dtype(np.int64), "the heartbeat")
        except Exception:
            return
        comm.heartbeat = Heartbeat(segment, ranks, OPS)
    finally:
        node.Free()
