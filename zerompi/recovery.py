"""The optimizer's side of surviving a lost rank (the snapshots and the re-shard plan
are in :mod:`zerompi.elastic`, the MPI calls in :mod:`zerompi.mpi.ulfm`).

With ``elastic=True`` every public method of the optimizer that communicates is
guarded (:func:`zerompi.guard.communicates`), so that a failed peer seen anywhere
inside zerompi becomes a recovery on every survivor (:meth:`Recovery.recover`):

1. revoke the communicator (wakes every survivor from whatever it waits in), shrink
   it to the survivors, and agree (ULFM's fault-tolerant AND) that all got there;
2. exchange every survivor's snapshot status and choose the newest batch whose state
   is held in full (:func:`zerompi.elastic.choose`);
3. drop the old world's engine and build a new one for the survivors from the same
   settings (:func:`zerompi.engine.build_engine`: every buffer, the layout and the
   plan are the new world's), move the chosen state to its new owners
   (:func:`zerompi.elastic.reshard`), restore the counters and the loss scale, and
   snapshot the result; the optimizer then runs on the new engine;
4. run the optimizer's ``on_recovery`` callbacks (whoever holds views of the old
   engine's buffers, e.g. a torch module's parameters, re-points them), then raise
   :class:`zerompi.elastic.RankLost` with the batch to resume from.

Code outside the optimizer that communicates on ``opt.comm`` (a loss average, a
checkpoint) runs inside ``with opt.survive():`` to get the same treatment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import state
from .elastic import RankLost, buddy_ranks, choose, reshard
from .mpi.launch import end_process
from .runtime import clock


class Recovery:
    """An elastic optimizer's recovery (its ``_recovery``; see the module docstring)."""

    @staticmethod
    def is_failure(exc: BaseException, owner: Any) -> bool:
        """Whether ``exc`` is MPI reporting a failed peer (ULFM) of ``owner``'s
        communicator."""
        from .mpi.ulfm import is_failure

        return is_failure(exc, [owner.comm])

    def recover(self, opt: Any) -> RankLost:
        """Collective over the survivors: the optimizer ``opt`` runs on a new engine
        for them; the exception to raise. A failure during it is not survivable: this
        process says so and ends (:func:`zerompi.mpi.launch.end_process`), and the
        other survivors, whose recovery fails alike, do the same."""
        try:
            return self._recover(opt)
        except Exception as exc:
            end_process(
                f"zerompi: the recovery from a lost rank failed ({type(exc).__name__}: "
                f"{exc}); a rank lost during a recovery is not survivable"
            )

    def _recover(self, opt: Any) -> RankLost:
        from .engine import build_engine
        from .mpi import ulfm
        from .mpi.collectives import Comm

        start = clock()
        old = opt.engine
        comm, snaps, old_layout, nodes = old.comm, old.snapshots, old.layout, old.nodes
        ulfm.revoke([comm, nodes.node, nodes.cross])
        survivors = Comm(ulfm.shrink(comm), timeout=0)
        if not ulfm.agree(survivors, 1):  # every survivor got here (fault tolerant)
            raise RuntimeError("zerompi: the survivors did not agree on the recovery")
        statuses = survivors.allgather(snaps.status())
        marks = [clock()]  # the end of each phase: agree, rebuild, re-shard, snapshot
        members = [tuple(m) for m in nodes.members] if nodes.count > 1 else None
        old_size, old_rank = comm.size, comm.rank

        def holder(rank: int) -> int:
            return buddy_ranks(old_size, rank, members)[0]

        chosen = choose(statuses, old_size, holder)
        lost = sorted(set(range(old_size)) - {s[0] for s in statuses})
        meta = None
        if chosen is not None:
            where = chosen[1]
            snaps.keep_live(where[old_rank][1])  # the old live state need not outlive this
            meta = snaps.source_views(old_rank, where[old_rank][1])[0].copy()
        snaps.live = []
        settings, configs = old.settings, list(old.configs)
        # The old world's model-size buffers go before the new world's are allocated:
        # only the snapshot buffers (held by ``snaps``) survive the swap.
        opt.engine = old = None
        layout = settings.layout(survivors.size, survivors.rank)
        engine = opt.engine = build_engine(settings, survivors, layout, None, opt._handed_over,
                                           configs)  # fmt: skip
        marks.append(clock())
        if chosen is not None:
            assert meta is not None
            targets = state.snapshot_shards(engine)
            reshard(survivors, old_layout, old_size, layout, where, snaps.source_views,
                    targets, ulfm.alltoallv_bytes, engine.rule.states, engine.stage)  # fmt: skip
            state.publish_state(engine)
            marks.append(clock())
            if engine.scaler is not None and engine.scaler.dynamic:
                engine.scaler.restore(float(meta[3]), int(meta[4]))
            state.set_counters(engine, int(meta[1]), int(meta[2]))  # and snapshots the state
        del snaps
        marks.append(clock())
        seconds = survivors.max(marks[-1] - start)
        names = ("agree", "rebuild", "reshard", "snapshot")[: len(marks) - (chosen is None)]
        if chosen is None:
            names += ("end",)
        phases = dict(zip(names, np.diff([start, *marks]).tolist(), strict=True))
        step = None if meta is None else int(meta[0])
        lost_error = RankLost(step, survivors.size, old_size, lost, seconds)
        opt.recoveries.append(
            {**lost_error.record(), "phases": {k: survivors.max(v) for k, v in phases.items()}}
        )
        for callback in opt.on_recovery:  # views of the old buffers point at the new ones
            callback()
        return lost_error


__all__ = ["Recovery"]
