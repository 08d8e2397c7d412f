"""The optimizer's state seen from outside: inspection, memory, and the public state
interface that checkpoints go through (:mod:`zerompi.checkpoint` reads no private
attribute). A mixin of :class:`zerompi.optimizer.ZeroOptimizer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .adam import round_low
from .elastic import NoSnapshots
from .plan import STATE_KINDS, shard_of
from .settings import SETTINGS

if TYPE_CHECKING:
    from .adam import AdamConfig
    from .buffers import BufferPool
    from .mpi.collectives import Comm
    from .partition import Layout
    from .plan import Part, StagePlan

PHASES = ("reduce_scatter", "adam", "allgather")



class OptimizerState:
    """Inspection and checkpoint interface of :class:`ZeroOptimizer`."""

    comm: Comm
    layout: Layout
    plan: StagePlan
    pool: BufferPool
    configs: list[AdamConfig]  # per parameter group (zerompi.settings)
    _member: dict[str, int]
    stage: int
    step_count: int
    skipped_steps: int
    timings: dict[str, float]
    _order: list[str]
    _stores: dict[str, dict[np.dtype, np.ndarray]]
    _specs: dict[str, Any]
    parts: list[Part]
    precisions: dict[np.dtype, Any]
    scaler: Any
    gatherer: Any
    _snapshots: Any = NoSnapshots()

    def _view(self, flat: Mapping[np.dtype, np.ndarray], name: str) -> np.ndarray:
        raise NotImplementedError

    def _discard(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _gathers_done(self, step: bool = True) -> None:
        raise NotImplementedError

    # -- inspection ------------------------------------------------------------

    def pop_timings(self) -> dict[str, float]:
        """Seconds spent per phase since the last call, and reset."""
        out, self.timings = self.timings, dict.fromkeys(PHASES, 0.0)
        return out

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank's optimizer holds, per category: the reference's four
        (``optimizer_states``, ``gradient_partitions``, ``parameter_partitions``,
        ``communication_buffers``) plus the Adam kernel's ``scratch``."""
        return self.pool.usage()

    def memory_buffers(self) -> dict[str, int]:
        """Bytes per named buffer (``grad_bucket.float32``, ``exp_avg.float32``, ...)."""
        return self.pool.buffers()

    def _masters(self) -> dict[np.dtype, np.ndarray]:
        """Per master dtype, the buffer of the master parameters: full on every rank
        where :meth:`_master_is_full`, else this rank's shards."""
        low = self._stores.get("master", {})
        return {d: low.get(d, flat) for d, flat in self._stores["params"].items()}

    def _master_is_full(self, dtype: np.dtype) -> bool:
        separate = dtype in self._stores.get("master", {})  # a narrower param_dtype
        return self.stage == 0 or (self.plan.full_params and not separate)

    def full_params(self) -> dict[str, np.ndarray]:
        """Collective: a copy of every full parameter in its master dtype (the arrays'
        own, whatever ``param_dtype``), on every rank (any stage)."""
        masters = self._masters()
        if all(self._master_is_full(d) for d in masters):
            self.comm.barrier()  # collective at every stage: `if rank == 0:` fails alike
            return {n: self._view(masters, n).copy() for n in self._order}
        return self._gather_full(masters, {d for d in masters if self._master_is_full(d)})

    def gather_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Collective: the full (unsharded) ``exp_avg`` and ``exp_avg_sq`` of every
        parameter on every rank. Allocates full-size arrays: for checks and export,
        not for the training loop."""
        if self.stage == 0:
            self.comm.barrier()
            return {
                kind: {n: self._view(self._stores[kind], n).copy() for n in self._order}
                for kind in ("exp_avg", "exp_avg_sq")
            }
        return {kind: self._gather_full(self._stores[kind]) for kind in ("exp_avg", "exp_avg_sq")}

    def _gather_full(
        self, shards: Mapping[np.dtype, np.ndarray], whole: set[np.dtype] | frozenset = frozenset()
    ) -> dict[str, np.ndarray]:
        """Full copies from ``shards`` (those of dtypes in ``whole`` are full already)."""
        full = {dtype: np.zeros(size, dtype) for dtype, size in self.layout.sizes.items()}
        with self.comm.untracked():  # not training traffic
            for index, bucket in enumerate(self.layout.buckets):
                part = full[bucket.dtype][bucket.start : bucket.stop]
                if bucket.dtype in whole:
                    part[...] = shards[bucket.dtype][bucket.start : bucket.stop]
                    continue
                part[slice(*bucket.local(self.comm.rank))] = shard_of(shards, self.layout, index)
                self.comm.allgatherv_inplace(part, bucket.counts, bucket.displs, tag=index)
        return {n: self._view(full, n) for n in self._order}

    # -- the state interface of checkpoints --------------------------------------

    def param_entries(self) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
        """``(name, shape, dtype, offset in its dtype's flat buffer)`` of every
        parameter, in the model's order."""
        specs = self._specs
        return [(n, specs[n].shape, specs[n].dtype, specs[n].offset) for n in self._order]

    def state_sections(self) -> list[str]:
        """Section names (``"params.float32"``, ...) in file order."""
        return [f"{kind}.{d.name}" for d in self.layout.sizes for kind in STATE_KINDS]

    def state_shards(self) -> list[tuple[str, int, np.ndarray]]:
        """``(section, first global element, this rank's shard)`` of every bucket of
        every kind of state, in one fixed order that every rank's collective I/O
        follows. The shards are writable views of the optimizer's own storage."""
        self._snapshots.settle()  # a snapshot's messages read these shards
        return self._state_views()

    def _state_views(self) -> list[tuple[str, int, np.ndarray]]:
        layout, rank = self.layout, self.comm.rank
        out = []
        for kind in STATE_KINDS:
            store = self._masters() if kind == "params" else self._stores[kind]
            for index, bucket in enumerate(layout.buckets):
                lo, hi = bucket.local(rank)
                full = self.stage == 0 or (kind == "params" and self._master_is_full(bucket.dtype))
                if full:
                    shard = store[bucket.dtype][bucket.start + lo : bucket.start + hi]
                else:
                    shard = shard_of(store, layout, index)
                out.append((f"{kind}.{bucket.dtype.name}", bucket.start + lo, shard))
        return out

    def publish_state(self) -> None:
        """Collective: after :meth:`state_shards` were overwritten (a load), make every
        rank's full copies whole again (gathered, not counted as training traffic)
        and discard accumulated gradients."""
        comm, masters = self.comm, self._masters()
        self._gathers_done(step=False)  # a stage-3 gather in flight still reads the shards
        with comm.untracked():
            buckets = self.layout.buckets
            for index, (bucket, part) in enumerate(zip(buckets, self.parts, strict=True)):
                whole = slice(bucket.start, bucket.stop)
                if self.stage == 0:  # everything everywhere, the master included
                    for store in (masters, self._stores["exp_avg"], self._stores["exp_avg_sq"]):
                        comm.allgatherv_inplace(
                            store[bucket.dtype][whole], bucket.counts, bucket.displs, tag=index
                        )
                if part.low is not None:  # the model's rounded copy of what was loaded
                    round_low(part.param, part.low)
                if self.stage > 0 and self.plan.full_params:  # the full copies, as a step
                    self.gatherer.started(index)
            if self.stage > 0 and self.plan.full_params:
                self.gatherer.finish()
        self._discard()

    def set_counters(self, step: int, skipped_steps: int) -> None:
        """Restore the step and skipped-step counts (a load)."""
        self.step_count = int(step)
        self.skipped_steps = int(skipped_steps)
        self.comm.step = self.step_count + 1
        self._snapshots.restart(self)  # elastic: the new state is the one to keep

    @property
    def config(self) -> AdamConfig:
        """Group 0's settings: the constructor's."""
        return self.configs[0]

    def hyperparameters(self) -> dict[str, Any]:
        """Adam's settings, as a checkpoint records them."""
        def of(c: AdamConfig) -> dict[str, Any]:
            return {"lr": c.lr, "beta1": c.beta1, "beta2": c.beta2, "eps": c.eps,
                    "weight_decay": c.weight_decay}  # fmt: skip

        out = {**of(self.config), "decoupled": self.config.decoupled}
        if len(self.configs) > 1:  # the groups after group 0, and their parameters
            names = [[n for n, g in self._member.items() if g == i]
                     for i in range(1, len(self.configs))]  # fmt: skip
            pairs = zip(self.configs[1:], names, strict=True)
            out["param_groups"] = [{**of(c), "params": ns} for c, ns in pairs]
        return out

    def param_group(self, name: str) -> int:
        """The parameter group of parameter ``name`` (0: the constructor's settings;
        ``i``: the ``i``-th of ``param_groups``)."""
        return self._member[name]

    def set_hyperparameters(self, group: int = 0, **settings: float) -> None:
        """Change a parameter group's Adam settings from the next step on (a learning
        rate schedule): any of ``lr``, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``, checked as at construction; ``group`` 0 is the
        constructor's (:mod:`zerompi.settings`). Call it alike on every rank: the
        step's agreement compares every rank's settings, so ranks that set different
        ones fail every ``step()`` on every rank with :class:`CollectiveError` before
        Adam runs, until they agree. Checkpoints record the settings."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"set_hyperparameters: unknown setting(s) {unknown}; "
                            f"it takes {', '.join(SETTINGS)}")  # fmt: skip
        if not 0 <= group < len(self.configs):
            raise ValueError(f"set_hyperparameters: no parameter group {group!r} "
                             f"({len(self.configs)} group(s))")  # fmt: skip
        self.configs[group] = dataclasses.replace(self.configs[group], **settings)

    def precision_settings(self) -> dict[str, Any]:
        """The precision a checkpoint was saved with (it holds the master precision
        whatever these say) and the loss scale's state."""
        first = next(iter(self.precisions.values()))
        out: dict[str, Any] = {"param_dtype": first.param.name, "reduce_dtype": first.reduce.name}
        if self.scaler is not None:
            out.update(loss_scale=self.scaler.scale, loss_scale_dynamic=self.scaler.dynamic,
                       loss_scale_good_steps=self.scaler.good_steps)  # fmt: skip
        return out

    def set_loss_scale(self, settings: Mapping[str, Any]) -> None:
        """Restore a dynamic loss scale saved by :meth:`precision_settings` (a load); a
        static or absent one leaves this optimizer's own."""
        scaler = self.scaler
        if scaler is not None and scaler.dynamic and settings.get("loss_scale_dynamic"):
            scaler.restore(settings["loss_scale"], settings.get("loss_scale_good_steps", 0))

    # -- checkpoints -----------------------------------------------------------

    def save(self, path: str) -> None:
        """Collective: write parameters, Adam moments and step count to the single
        file ``path`` (format: :mod:`zerompi.checkpoint`), each rank writing only its
        shards with MPI-IO. The file is written under a temporary name and renamed
        into place by rank 0, so ``path`` holds either the previous checkpoint or the
        complete new one; an error on any rank is raised on every rank."""
        from . import checkpoint  # not at import: keeps `python -m zerompi.checkpoint` clean

        checkpoint.save(self, path)

    def load(self, path: str) -> dict:
        """Collective: restore parameters, Adam moments and step count from a
        checkpoint saved at any world size and stage. The model (names, shapes,
        dtypes, order) must match; this optimizer keeps its own hyperparameters.
        Every checksum is verified before anything is changed: on any error every
        rank raises :class:`zerompi.checkpoint.CheckpointError` and the state is
        untouched. Accumulated gradients are discarded. Returns the header."""
        from . import checkpoint

        return checkpoint.load(self, path)

    # -- lifetime and display ----------------------------------------------------

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Not while an exception propagates: it may be on this rank only, and close()
        # is collective; the abort hook ends the world instead.
        if exc_type is None:
            self.close()

    def __repr__(self) -> str:
        total = sum(self.layout.sizes.values())
        return (
            f"ZeroOptimizer(stage={self.stage}, params={total}, buckets="
            f"{len(self.layout.buckets)}, rank={self.comm.rank}/{self.comm.size})"
        )
