"""The optimizer's side of surviving a lost rank (a mixin of
:class:`zerompi.optimizer.ZeroOptimizer`; the snapshots and the re-shard plan are in
:mod:`zerompi.elastic`, the MPI calls in :mod:`zerompi.mpi.ulfm`).

With ``elastic=True`` every public method that communicates is wrapped, on the
instance (a non-elastic optimizer runs its methods unwrapped, at no cost), so that a
failed peer seen anywhere inside zerompi becomes a recovery on every survivor:

1. revoke the communicator (wakes every survivor from whatever it waits in), shrink
   it to the survivors, and agree (ULFM's fault-tolerant AND) that all got there;
2. exchange every survivor's snapshot status and choose the newest batch whose state
   is held in full (:func:`zerompi.elastic.choose`);
3. rebuild this optimizer in place on the new communicator (the constructor, so
   every buffer, the layout and the plan are those of the new world), move the
   chosen state to its new owners (:func:`zerompi.elastic.reshard`), restore the
   counters and the loss scale, and snapshot the result;
4. raise :class:`zerompi.elastic.RankLost` with the batch to resume from.

Code outside the optimizer that communicates on ``opt.comm`` (a loss average, a
checkpoint) runs inside ``with opt.survive():`` to get the same treatment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .elastic import RankLost, buddy_ranks, choose, reshard, restored
from .mpi.launch import end_process
from .runtime import clock

#: The methods an elastic optimizer guards (every one that can communicate).
GUARDED = (
    "step", "accumulate", "gathered", "gradients", "fold", "gather_into", "save", "load",
    "full_params", "gather_state", "close", "_handed_over",
)  # fmt: skip


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


def elastic_setup(comm: Any, args: dict[str, Any]) -> dict[str, Any]:
    """An elastic optimizer's communicator returns errors instead of aborting; the
    constructor arguments a recovery rebuilds it with."""
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
            stacklevel=3,
        )
    return args


class Elastic:
    """``survive()``, the guards and the recovery (a mixin of ``ZeroOptimizer``)."""

    comm: Any
    layout: Any
    nodes: Any
    configs: list[Any]
    scaler: Any
    _snapshots: Any
    _elastic_args: dict[str, Any] | None = None
    #: Every lost rank survived so far: :meth:`zerompi.elastic.RankLost.record` each.
    recoveries: list[dict[str, Any]]

    def _install_guards(self) -> None:
        for name in GUARDED:
            method = getattr(self, name)
            setattr(self, name, self._guard(method))

    def _guard(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self.survive():
                return method(*args, **kwargs)

        guarded.__doc__, guarded.__name__ = method.__doc__, method.__name__
        return guarded

    @contextmanager
    def survive(self) -> Iterator[None]:
        """``with opt.survive():`` around code that communicates on ``opt.comm``: a
        failed peer seen inside becomes a recovery, and :class:`RankLost` is raised
        on every survivor. Without ``elastic=True`` it does nothing."""
        if self._elastic_args is None:
            yield
            return
        from .mpi.ulfm import is_failure

        try:
            yield
        except RankLost:
            raise
        except Exception as exc:
            if not is_failure(exc):
                raise
            raise self._recover() from exc

    def _recover(self) -> RankLost:
        """Collective over the survivors (see the module docstring); the exception to
        raise. A failure during it is not survivable: this process says so and ends
        (:func:`zerompi.mpi.launch.end_process`), and the other survivors, whose
        recovery fails alike, do the same."""
        try:
            return self._recover_now()
        except Exception as exc:
            end_process(
                f"zerompi: the recovery from a lost rank failed ({type(exc).__name__}: "
                f"{exc}); a rank lost during a recovery is not survivable"
            )

    def _recover_now(self) -> RankLost:
        from .mpi import ulfm
        from .mpi.collectives import Comm

        start = clock()
        old, snaps, old_layout = self.comm, self._snapshots, self.layout
        nodes = self.nodes
        ulfm.revoke([old, nodes.node, nodes.cross])
        survivors = Comm(ulfm.shrink(old), timeout=0)
        if not ulfm.agree(survivors, 1):  # every survivor got here (fault tolerant)
            raise RuntimeError("zerompi: the survivors did not agree on the recovery")
        statuses = survivors.allgather(snaps.status())
        marks = [clock()]  # the end of each phase: agree, rebuild, re-shard, snapshot
        members = [tuple(m) for m in nodes.members] if nodes.count > 1 else None

        def holder(rank: int) -> int:
            return buddy_ranks(old.size, rank, members)[0]

        chosen = choose(statuses, old.size, holder)
        lost = sorted(set(range(old.size)) - {s[0] for s in statuses})
        meta = None
        if chosen is not None:
            where = chosen[1]
            snaps.keep_live(where[old.rank][1])  # the old live state need not outlive this
            meta = snaps.source_views(old.rank, where[old.rank][1])[0].copy()
        snaps.live = []
        args, configs, recoveries = self._elastic_args, list(self.configs), self.recoveries
        specs = [(spec.name, spec.shape, spec.dtype) for spec in old_layout.params]
        old_size = old.size
        self._drop_state()
        described = {name: restored(shape, dtype) for name, shape, dtype in specs}
        type(self).__init__(self, described, comm=survivors.mpi, **args)  # type: ignore[misc]
        self.configs[:] = configs  # the settings the survivors trained with last
        self.recoveries = recoveries
        marks.append(clock())
        if chosen is not None:
            targets = [shard for _, _, shard in self.state_shards()]
            reshard(self.comm, old_layout, old_size, self.layout, where,
                    snaps.source_views, targets, ulfm.alltoallv_bytes)  # fmt: skip
            self.publish_state()
            marks.append(clock())
            assert meta is not None
            if self.scaler is not None and self.scaler.dynamic:
                self.scaler.restore(float(meta[3]), int(meta[4]))
            self.set_counters(int(meta[1]), int(meta[2]))  # and snapshots the state
        del snaps
        marks.append(clock())
        comm = self.comm
        seconds = comm.max(marks[-1] - start)
        names = ("agree", "rebuild", "reshard", "snapshot")[: len(marks) - (chosen is None)]
        if chosen is None:
            names += ("end",)
        phases = dict(zip(names, np.diff([start, *marks]).tolist(), strict=True))
        lost_error = RankLost(None if chosen is None else int(meta[0]), comm.size,  # type: ignore[index]
                              old_size, lost, seconds)  # fmt: skip
        self.recoveries.append(
            {**lost_error.record(), "phases": {k: comm.max(v) for k, v in phases.items()}}
        )
        return lost_error

    def _drop_state(self) -> None:
        """Forget everything of the old world but what recovery still reads (the
        snapshot buffers, held by the caller): the model-size buffers go before the
        new world's are allocated."""
        keep = {"_elastic_args", "recoveries"}
        for name in list(vars(self)):
            if name not in keep:
                delattr(self, name)


__all__ = ["GUARDED", "Elastic", "RankLost", "check_elastic", "elastic_setup"]
