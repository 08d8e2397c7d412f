"""Surviving a lost rank without restarting the job (``ZeroOptimizer(elastic=True)``).

Every ``snapshot_every`` steps each rank keeps its shard state (master parameters,
``exp_avg``, ``exp_avg_sq``, counters, loss scale) in memory and sends it to one
*buddy* rank (on the next node where there is one), with nonblocking messages that
travel while the next step's forward and backward run. When a zerompi call sees a
failed peer (ULFM, :mod:`zerompi.mpi.ulfm`), the survivors revoke the communicator,
shrink it, choose the newest step whose state they hold in full, rebuild the
optimizer for the smaller world (:func:`zerompi.partition.shard_range` on the new
world size), move every shard to its new owner with one exact-count ``Alltoallv``
and raise :class:`RankLost`, which carries the step to resume from.

A snapshot in flight must never destroy the last complete one, so a rank holds
three snapshot buffers (:func:`snapshot_plan`): its own last complete state, its
source's (the rank whose buddy it is) and the source's next one being received.
A snapshot becomes complete (*committed*) at the next step's agreement, which every
rank reaches only after all its snapshot messages completed; this rank's own copy
is taken then, from the live state (unchanged until that step's Adam), so nothing
is copied at the step where the snapshot is sent.

Pure numpy here; the MPI calls are in :mod:`zerompi.mpi.ulfm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .blockwise import held, spans_of
from .buffers import Kind, PlannedBuffer, StateKind
from .plan import state_kinds

if TYPE_CHECKING:
    from .partition import Layout

#: Counters a snapshot carries: batches seen, steps, skipped steps, loss scale, the
#: loss scale's good steps (float64; 8 slots, 64 bytes, so pieces stay aligned).
META = 8
#: The three snapshot buffers (bytes): own, held (the source's), next (in flight).
SLOTS = (Kind.SNAPSHOT_OWN, Kind.SNAPSHOT_HELD, Kind.SNAPSHOT_NEXT)


class RankLost(RuntimeError):
    """Raised on every surviving rank after a lost rank was survived: the optimizer
    now runs on ``world_size`` ranks with the state of the snapshot taken after
    ``step`` batches (``step_count + skipped_steps``); the training loop goes back
    to that batch, with the data re-split over the new world size. ``lost``: the
    ranks (of the old world) that died; ``seconds``: the recovery's duration.

    ``step`` is ``None`` when a lost rank's snapshot was lost with it (its buddy died
    too): the optimizer was rebuilt at the new world size with zero state, and the
    caller loads the newest checkpoint on disk (``opt.load``)."""

    def __init__(
        self, step: int | None, world_size: int, world_size_before: int,
        lost: Sequence[int], seconds: float,
    ) -> None:  # fmt: skip
        self.step, self.world_size, self.world_size_before = step, world_size, world_size_before
        self.lost, self.seconds = list(lost), seconds
        where = (
            f"resumed from the in-memory snapshot after batch {step}" if step is not None
            else "no in-memory snapshot holds their state (a rank and its buddy died "
            "together): load the newest checkpoint"
        )  # fmt: skip
        super().__init__(
            f"lost rank(s) {', '.join(map(str, self.lost))} of {world_size_before}: "
            f"continuing on {world_size} rank(s), {where} ({seconds:.3f} s)"
        )

    def record(self) -> dict[str, Any]:
        """The driver's JSON entry of this recovery."""
        return {"step": self.step, "world_size_before": self.world_size_before,
                "world_size_after": self.world_size, "lost": self.lost,
                "seconds": self.seconds}  # fmt: skip


# -- whether this job can be elastic ------------------------------------------------------


def check_elastic(elastic: object, every: object, shared_memory: bool | None) -> bool | None:
    """Check the constructor's ``elastic`` and ``snapshot_every``; the
    ``shared_memory`` to use (an elastic optimizer never uses node shared memory: a
    lost rank's mappings and fences cannot be recovered)."""
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be a bool, got {elastic!r:.60}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_every must be an integer >= 1, got {every!r:.60}")
    if not elastic:
        return shared_memory
    from .mpi.ulfm import unavailable

    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    if shared_memory:
        raise ValueError(
            "elastic=True cannot use node shared memory (a lost rank's mappings and fences "
            "cannot be recovered): pass shared_memory=False or leave it unset"
        )
    return False


def elastic_setup(comm: Any) -> None:
    """An elastic optimizer's communicator returns errors instead of aborting."""
    import os
    import warnings

    from .mpi import ULFM_SETTINGS
    from .mpi.ulfm import prepare

    prepare(comm)
    missing = {k: v for k, v in ULFM_SETTINGS.items() if os.environ.get(k) != v}
    if comm.rank == 0 and missing:
        options = " ".join(f"--mca {k[len('OMPI_MCA_'):]} {v}" for k, v in missing.items())
        warnings.warn(
            f"zerompi: elastic=True without {missing}: MPI was initialised before zerompi "
            "was imported, or they were set otherwise. Open MPI 5.0.x then may return "
            "garbage from a collective whose peer died (coll/han) or hang in MPI_Finalize "
            f"after a lost rank: import zerompi first, or launch with `mpiexec --with-ft "
            f"ulfm {options}`",
            stacklevel=4,
        )


# -- layout of a snapshot -------------------------------------------------------------


def pieces(
    layout: Layout, rank: int, states: Sequence[StateKind], stage: int = 1
) -> list[tuple[str, int, int, np.dtype]]:
    """``(section, first global element or entry, count, dtype)`` of every piece of
    ``rank``'s shard state (the parameters and the update rule's ``states``), in the
    order of :func:`zerompi.plan.snapshot_views` (any rank, any world size of
    ``layout``'s buckets): first the states held per element, by bucket; then those
    held per unit (:mod:`zerompi.blockwise`), each bucket's entries of every unit its
    part touches at ``stage`` (the whole bucket's at stage 0). Two ranks' pieces of
    such a state may overlap (a unit their parts share: the same values on both)."""
    out = []
    for kind in state_kinds(states):
        if isinstance(kind, StateKind) and kind.units:
            continue
        # (section, dtype) per master dtype, once: a dtype's name is slow to get, and a
        # large model has thousands of buckets
        each = {d: (f"{kind.label}.{d.name}", d if kind is Kind.PARAMS else kind.storage(d))
                for d in layout.sizes}  # fmt: skip
        for bucket in layout.buckets:
            lo, hi = bucket.local(rank)
            section, dtype = each[bucket.dtype]
            out.append((section, bucket.start + lo, hi - lo, dtype))
    for kind in states:
        if not kind.units:
            continue
        spans = {d: spans_of(kind, layout, d) for d in layout.sizes}
        each = {d: (f"{kind.label}.{d.name}", kind.storage(d)) for d in layout.sizes}
        for index, bucket in enumerate(layout.buckets):
            lo, hi = spans[bucket.dtype].touched(*held(layout, stage, index, rank))
            section, dtype = each[bucket.dtype]
            out.append((section, lo, hi - lo, dtype))
    return out


def offsets(parts: Sequence[tuple[str, int, int, np.dtype]]) -> tuple[list[int], int]:
    """Byte offset of every piece in a snapshot buffer (after the counters, each
    aligned to 8 bytes) and the buffer's size."""
    out, at = [], META * 8
    for _, _, count, dtype in parts:
        out.append(at)
        at += -(-count * dtype.itemsize // 8) * 8
    return out, at


def snapshot_bytes(
    layout: Layout, rank: int, states: Sequence[StateKind], stage: int = 1
) -> int:
    """Bytes of ``rank``'s snapshot."""
    return offsets(pieces(layout, rank, states, stage))[1]


def buddy_ranks(
    size: int, rank: int, members: Sequence[Sequence[int]] | None = None
) -> tuple[int, int]:
    """``(buddy, source)``: the rank that holds this rank's snapshot and the rank
    whose snapshot this rank holds. With ``members`` (the ranks of each node, every
    node the same size, more than one node) the buddy is the rank with the same
    local index on the next node, so one node's loss leaves its snapshots alive;
    else the next rank."""
    if members and len(members) > 1 and len({len(m) for m in members}) == 1:
        node = next(i for i, m in enumerate(members) if rank in m)
        local = list(members[node]).index(rank)
        count = len(members)
        return members[(node + 1) % count][local], members[(node - 1) % count][local]
    return (rank + 1) % size, (rank - 1) % size


def snapshot_plan(
    layout: Layout, rank: int, source: int, states: Sequence[StateKind], stage: int = 1
) -> list[PlannedBuffer]:
    """The snapshot buffers of ``rank`` holding ``source``'s (category ``snapshots``):
    3 x the shard state, plus 64 bytes of counters per buffer."""
    u8 = np.dtype(np.uint8)
    own = snapshot_bytes(layout, rank, states, stage)
    theirs = snapshot_bytes(layout, source, states, stage)
    sizes = (own, theirs, theirs)
    return [PlannedBuffer(kind, u8, n) for kind, n in zip(SLOTS, sizes, strict=True)]


def typed_views(
    buf: np.ndarray, parts: Sequence[tuple[str, int, int, np.dtype]]
) -> list[np.ndarray]:
    """The counters and every piece of a snapshot buffer, as arrays of their dtypes."""
    at, _ = offsets(parts)
    views = [buf[: META * 8].view(np.float64)]
    for (_, _, count, dtype), start in zip(parts, at, strict=True):
        views.append(buf[start : start + count * dtype.itemsize].view(dtype))
    return views


# -- the snapshots of one optimizer ------------------------------------------------------


class NoSnapshots:
    """What a non-elastic optimizer has in place of :class:`Snapshots`: nothing."""

    every = 0

    def settle(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def after_step(self, engine: Any) -> None:
        pass

    def restart(self, engine: Any) -> None:
        pass


class Snapshots:
    """This rank's snapshot buffers and the exchange in flight (see the module
    docstring). ``live``: views of the engine's shard state, in :func:`pieces`
    order; ``stores``: the three buffers (:data:`SLOTS`, by label) from its pool."""

    def __init__(
        self, every: int, comm: Any, layout: Layout, live: Sequence[np.ndarray],
        buddy: int, source: int, stores: dict[str, np.ndarray], exchange: Any,
        states: Sequence[StateKind], stage: int = 1,
    ) -> None:  # fmt: skip
        self.every, self.comm, self.layout = every, comm, layout
        self.buddy, self.source = buddy, source
        self.mine = pieces(layout, comm.rank, states, stage)
        self.theirs = pieces(layout, source, states, stage)
        self.live = list(live)
        own, held, next_ = (stores[kind.label] for kind in SLOTS)
        self.own = typed_views(own, self.mine)
        self.held = typed_views(held, self.theirs)
        self.next = typed_views(next_, self.theirs)
        self.meta_out = np.zeros(META)  # the counters of the snapshot in flight
        self.exchange = exchange
        #: Batches seen at the last committed snapshot (-1: none) and at the one in
        #: flight (-1: none).
        self.committed, self.pending = -1, -1

    def post(self, engine: Any) -> None:
        """Send this rank's live state to its buddy and receive its source's: the
        snapshot after the engine's current batch, committed at the next agreement."""
        self.settle()
        scaler = engine.scaler
        self.meta_out[:5] = (
            engine.step_count + engine.skipped_steps, engine.step_count, engine.skipped_steps,
            1.0 if scaler is None else scaler.scale, 0 if scaler is None else scaler.good_steps,
        )  # fmt: skip
        self.exchange.start([self.meta_out, *self.live], self.buddy, self.next, self.source)
        self.pending = int(self.meta_out[0])

    def settle(self) -> None:
        """Complete the messages in flight (before Adam changes the live state)."""
        self.exchange.wait()

    def commit(self) -> None:
        """The step's agreement passed: every rank's messages completed, so the
        snapshot in flight is complete everywhere. Take this rank's own copy from the
        live state (Adam has not run since) and keep the received one."""
        if self.pending < 0:
            return
        self.own[0][...] = self.meta_out
        for out, live in zip(self.own[1:], self.live, strict=True):
            np.copyto(out, live)
        self.held, self.next = self.next, self.held
        self.committed, self.pending = self.pending, -1

    def after_step(self, engine: Any) -> None:
        """After a step (taken or skipped): post a snapshot every ``every`` batches."""
        if (engine.step_count + engine.skipped_steps) % self.every == 0:
            self.post(engine)

    def restart(self, engine: Any) -> None:
        """The state was replaced (a load, a recovery): snapshot it now."""
        self.settle()
        self.pending = -1
        self.post(engine)

    def status(self) -> tuple[int, int, int, bool]:
        """What recovery needs from this rank: ``(old rank, committed, pending,
        whether the pending snapshot's messages all arrived)``."""
        return self.comm.rank, self.committed, self.pending, self.exchange.received_all()

    def keep_live(self, slot: str) -> None:
        """Recovery chose this rank's ``live`` state: copy it into the ``own`` buffer
        (whose older snapshot is no longer needed), so the old world's model-size
        buffers can go before the new world's are allocated."""
        if slot == "live":
            self.own[0][...] = self.meta_out
            for out, live in zip(self.own[1:], self.live, strict=True):
                np.copyto(out, live)

    def source_views(self, rank: int, slot: str) -> list[np.ndarray]:
        """The counters and pieces of ``rank``'s state at the chosen step: this rank's
        ``own`` copy (``live``: copied there by :meth:`keep_live`), or its source's
        ``held`` or ``next`` copy."""
        return {"own": self.own, "live": self.own, "held": self.held, "next": self.next}[slot]


# -- recovery -------------------------------------------------------------------------


def choose(
    statuses: Sequence[tuple[int, int, int, bool]], old_size: int, holder: Callable[[int], int]
) -> tuple[int, dict[int, tuple[int, str]]] | None:
    """The newest batch whose state the survivors hold for every rank of the old
    world, and where each rank's state is: ``old rank -> (new rank, slot)``. A
    survivor has its own state at its committed step (``own``) and, while a snapshot
    is pending, at that step (``live``: no Adam runs before the commit); the holder of
    a lost rank's snapshot has it at its committed step (``held``) and, if every
    message arrived, at its pending step (``next``). ``None``: none (a rank and its
    holder were lost together)."""
    new_of = {old: new for new, (old, *_) in enumerate(statuses)}
    by_old = {s[0]: s for s in statuses}
    candidates = sorted({c for _, c, p, _ in statuses for c in (c, p) if c >= 0}, reverse=True)
    for step in candidates:
        where: dict[int, tuple[int, str]] = {}
        for rank in range(old_size):
            if rank in by_old:
                _, committed, pending, _ = by_old[rank]
                slot = "own" if committed == step else "live" if pending == step else None
                if slot is None:
                    break
                where[rank] = (new_of[rank], slot)
                continue
            h = holder(rank)
            if h not in by_old:
                break
            _, committed, pending, arrived = by_old[h]
            slot = "held" if committed == step else "next" if pending == step and arrived else None
            if slot is None:
                break
            where[rank] = (new_of[h], slot)
        else:
            return step, where
    return None


@dataclasses.dataclass
class Move:
    """One contiguous run of elements moving from an old rank's snapshot piece to a
    new rank's shard piece."""

    old: int  # old rank whose state it is
    old_piece: int
    old_at: int  # element offset in that piece
    new: int  # new rank
    new_piece: int
    new_at: int
    count: int


def moves(
    old: Layout, old_size: int, new: Layout, new_size: int, states: Sequence[StateKind],
    stage: int = 1,
) -> list[Move]:  # fmt: skip
    """Every run of elements (or entries) between the shard pieces of the old and the
    new world, in one order every rank computes alike (by new rank, its pieces, then
    old rank and piece): what the re-shard's ``Alltoallv`` packs and unpacks. An
    entry that several old pieces hold (a shared unit) is taken from the first."""
    olds: dict[str, list[tuple[int, int, int, int, int]]] = {}
    for r in range(old_size):
        for i, (section, first, count, _) in enumerate(pieces(old, r, states, stage)):
            if count:
                olds.setdefault(section, []).append((first, count, r, i, first))
    for section, runs in olds.items():
        runs.sort()
        kept, end = [], None
        for first, count, r, i, origin in runs:  # each entry from one piece only
            start = first if end is None else max(first, end)
            if start < first + count:
                kept.append((start, first + count - start, r, i, origin))
            end = first + count if end is None else max(end, first + count)
        olds[section] = kept
    out = []
    for n in range(new_size):
        for j, (section, first, count, _) in enumerate(pieces(new, n, states, stage)):
            stop = first + count
            for o_first, o_count, r, i, origin in olds.get(section, ()):
                lo, hi = max(first, o_first), min(stop, o_first + o_count)
                if lo < hi:
                    out.append(Move(r, i, lo - origin, n, j, lo - first, hi - lo))
    return out


def reshard(
    comm: Any, old: Layout, old_size: int, new: Layout, where: dict[int, tuple[int, str]],
    sources: Callable[[int, str], list[np.ndarray]], targets: Sequence[np.ndarray],
    alltoallv: Callable[..., None], states: Sequence[StateKind], stage: int = 1,
) -> None:  # fmt: skip
    """Collective over the new world ``comm``: fill this rank's shard pieces
    (``targets``, in :func:`pieces` order of ``new``) from the old world's states,
    each read on the rank ``where`` names (``sources(old rank, slot)``: counters, then
    pieces), with one exact-count byte ``alltoallv`` (:func:`zerompi.mpi.ulfm.alltoallv_bytes`);
    what this rank holds and keeps is copied in place, not packed."""
    me, size = comm.rank, comm.size
    plan = moves(old, old_size, new, size, states, stage)
    dtypes = {r: [d for *_, d in pieces(old, r, states, stage)] for r in range(old_size)}
    send_counts, recv_counts = [0] * size, [0] * size
    views: dict[int, list[np.ndarray]] = {}
    for m in plan:
        holder, slot = where[m.old]
        if holder == me and m.old not in views:
            views[m.old] = sources(m.old, slot)[1:]
        if holder == me and m.new == me:  # stays here: copied, never packed
            target = targets[m.new_piece][m.new_at : m.new_at + m.count]
            target[...] = views[m.old][m.old_piece][m.old_at : m.old_at + m.count]
            continue
        nbytes = m.count * dtypes[m.old][m.old_piece].itemsize
        if holder == me:
            send_counts[m.new] += nbytes
        if m.new == me:
            recv_counts[holder] += nbytes
    send = np.empty(sum(send_counts), np.uint8)
    recv = np.empty(sum(recv_counts), np.uint8)
    at = 0
    for m in plan:  # by destination, in plan order
        if where[m.old][0] == me and m.new != me:
            chunk = views[m.old][m.old_piece][m.old_at : m.old_at + m.count].view(np.uint8)
            send[at : at + chunk.shape[0]] = chunk
            at += chunk.shape[0]
    alltoallv(comm, send, send_counts, recv, recv_counts)
    cursor = np.concatenate([[0], np.cumsum(recv_counts[:-1])]).astype(np.int64)
    for m in plan:
        holder = where[m.old][0]
        if m.new != me or holder == me:
            continue
        target = targets[m.new_piece][m.new_at : m.new_at + m.count]
        nbytes = target.nbytes
        start = int(cursor[holder])
        target[...] = recv[start : start + nbytes].view(target.dtype)
        cursor[holder] += nbytes
