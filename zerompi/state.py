"""The state of an :class:`zerompi.engine.Engine` seen from outside: full copies for
checks and export, the parameter groups' settings, and the interface that
checkpoints (:mod:`zerompi.checkpoint`) and elastic snapshots go through.

Every function takes the engine; the collective ones say so. Nothing here reads a
buffer by name: the state is the master parameters and the two Adam moments, as
the plan's parts lay them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .adam import round_low
from .blockwise import Entry, spans_of
from .buffers import StateKind
from .plan import (
    master_is_full,
    masters,
    shard_of,
    snapshot_views,
    state_kinds,
    state_views,
    unit_views,
)

if TYPE_CHECKING:
    from .engine import Engine

# -- full copies ----------------------------------------------------------------------


def full_params(engine: Engine) -> dict[str, np.ndarray]:
    """Collective: a copy of every full parameter in its master dtype (the arrays'
    own, whatever ``param_dtype``), on every rank (any stage)."""
    flat = masters(engine.stores)
    whole = {d for d in flat if master_is_full(engine.plan, engine.stores, d)}
    if len(whole) == len(flat):
        engine.comm.barrier()  # collective at every stage: `if rank == 0:` fails alike
        return {n: engine.names.view(flat, n).copy() for n in engine.order}
    return gather_full(engine, flat, whole)


def gather_state(engine: Engine) -> dict[str, dict[str, np.ndarray]]:
    """Collective: the full (unsharded) states of the update rule (Adam's
    ``exp_avg`` and ``exp_avg_sq``) of every parameter on every rank. Allocates
    full-size arrays: for checks and export, not for the training loop."""
    kinds = {kind.label: kind for kind in engine.rule.states if not kind.units}
    units: dict[str, Any] = {kind.label: gather_units(engine, kind)
                             for kind in engine.rule.states if kind.units}  # fmt: skip
    if engine.stage == 0:
        engine.comm.barrier()
        return {
            key: {n: engine.names.view(engine.stores[kind], n).copy() for n in engine.order}
            for key, kind in kinds.items()
        } | units
    return {key: gather_full(engine, engine.stores[kind]) for key, kind in kinds.items()} | units


def gather_units(engine: Engine, kind: StateKind) -> dict[str, np.ndarray]:
    """Collective: a state held per unit (8-bit Adam's scales, Adafactor's rows and
    columns), whole, by master dtype name: its entries in the order of their units
    (:mod:`zerompi.blockwise`). Each entry comes from the rank a checkpoint takes it
    from (the one holding its unit's first element), the others add zeros."""
    layout = engine.layout
    full = {d: np.zeros(spans_of(kind, layout, d).total, engine.stores[kind][d].dtype)
            for d in layout.sizes}  # fmt: skip
    for name, entry in unit_shards(engine):
        if name.partition(".")[0] == kind.label:
            own = entry.held[entry.own]
            start = entry.first + entry.own.start
            full[entry.dtype][start : start + own.shape[0]] = own
    with engine.comm.untracked():
        for values in full.values():
            engine.comm.sum_inplace(values)
    return {d.name: values for d, values in full.items()}


def gather_full(
    engine: Engine, shards: Mapping[np.dtype, np.ndarray],
    whole: set[np.dtype] | frozenset[np.dtype] = frozenset(),
) -> dict[str, np.ndarray]:  # fmt: skip
    """Collective: full copies from ``shards`` (those of dtypes in ``whole`` are full
    already), gathered outside the training traffic's books."""
    layout, comm = engine.layout, engine.comm
    full = {dtype: np.zeros(size, shards[dtype].dtype) for dtype, size in layout.sizes.items()}
    with comm.untracked():  # not training traffic
        for index, bucket in enumerate(layout.buckets):
            part = full[bucket.dtype][bucket.start : bucket.stop]
            if bucket.dtype in whole:
                part[...] = shards[bucket.dtype][bucket.start : bucket.stop]
                continue
            part[slice(*bucket.local(comm.rank))] = shard_of(shards, layout, index)
            comm.allgatherv_inplace(part, bucket.counts, bucket.displs, tag=index)
    return {n: engine.names.view(full, n) for n in engine.order}


# -- the interface of checkpoints and snapshots -------------------------------------------


def param_entries(engine: Engine) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
    """``(name, shape, dtype, offset in its dtype's flat buffer)`` of every parameter,
    in the model's order."""
    specs = engine.names.specs
    return [(n, specs[n].shape, specs[n].dtype, specs[n].offset) for n in engine.order]


def state_sections(engine: Engine) -> list[str]:
    """Section names (``"params.float32"``, ...) in file order."""
    kinds = state_kinds(engine.rule.states)
    return [f"{kind.label}.{d.name}" for d in engine.layout.sizes for kind in kinds]


def section_layouts(engine: Engine) -> dict[str, dict[str, Any]]:
    """Per state not held as one element of the parameters' dtype per element, what
    its sections hold (:func:`zerompi.checkpoint.format.build_header`'s ``layouts``)."""
    out: dict[str, dict[str, Any]] = {}
    layout = engine.layout
    for kind in engine.rule.states:
        spec: dict[str, Any] = {} if kind.dtype is None else {"dtype": kind.dtype}
        if kind.units:
            spec["per"] = kind.per
            if kind.block:
                spec["block"] = kind.block
            spec["counts"] = {d.name: spans_of(kind, layout, d).total for d in layout.sizes}
        if spec:
            out[kind.label] = spec
    return out


def unit_shards(engine: Engine) -> list[tuple[str, Entry]]:
    """``(section, entry)`` of every bucket of every state held per unit
    (:func:`zerompi.plan.unit_views`), after :func:`state_shards`' in file order."""
    return unit_views(engine.plan, engine.layout, engine.stores, engine.rule.states)


def state_shards(engine: Engine) -> list[tuple[str, int, np.ndarray]]:
    """``(section, first global element, this rank's shard)`` of every bucket of
    every kind of state, in one fixed order that every rank's collective I/O
    follows. The shards are writable views of the engine's own storage."""
    engine.snapshots.settle()  # a snapshot's messages read these shards
    return state_views(engine.plan, engine.layout, engine.stores, engine.rule.states)


def snapshot_shards(engine: Engine) -> list[np.ndarray]:
    """Writable views of this rank's whole shard state, as an elastic snapshot holds
    it (:func:`zerompi.plan.snapshot_views`)."""
    engine.snapshots.settle()  # a snapshot's messages read these shards
    return snapshot_views(engine.plan, engine.layout, engine.stores, engine.rule.states)


def publish_state(engine: Engine) -> None:
    """Collective: after :func:`state_shards` were overwritten (a load, a re-shard),
    make every rank's full copies whole again (gathered, not counted as training
    traffic) and discard accumulated gradients."""
    comm, flat, stage = engine.comm, masters(engine.stores), engine.stage
    engine.access.finish(step=False)  # a stage-3 gather in flight still reads the shards
    republish = stage > 0 and engine.plan.full_params  # the full copies, as after a step
    with comm.untracked():
        buckets = engine.layout.buckets
        for index, (bucket, part) in enumerate(zip(buckets, engine.parts, strict=True)):
            whole = slice(bucket.start, bucket.stop)
            if stage == 0:  # everything everywhere, the master included (a state held
                # per unit: a load read every unit of the bucket)
                for store in (flat, *(engine.stores[k] for k in engine.rule.states
                                      if not k.units)):  # fmt: skip
                    comm.allgatherv_inplace(
                        store[bucket.dtype][whole], bucket.counts, bucket.displs, tag=index
                    )
            if part.low is not None:  # the model's rounded copy of what was loaded
                round_low(part.param, part.low)
            if republish:
                engine.gatherer.started(index)
        if republish:
            engine.gatherer.finish()
    engine.discard()


def set_counters(engine: Engine, step: int, skipped_steps: int) -> None:
    """Restore the step and skipped-step counts (a load, a re-shard)."""
    engine.step_count = int(step)
    engine.skipped_steps = int(skipped_steps)
    engine.comm.step = engine.step_count + 1
    engine.snapshots.restart(engine)  # elastic: the new state is the one to keep


# -- settings ---------------------------------------------------------------------------


def hyperparameters(engine: Engine) -> dict[str, Any]:
    """The update rule, its states and the hyperparameters of every group, as a
    checkpoint records them."""
    rule, configs = engine.rule, engine.configs

    def of(c: Any) -> dict[str, Any]:
        return {k: getattr(c, k) for k in rule.settings}

    fixed = {f.name: getattr(configs[0], f.name) for f in dataclasses.fields(configs[0])
             if f.name not in rule.settings}  # fmt: skip
    out = {"rule": rule.name, "states": rule.state_labels(), **of(configs[0]), **fixed}
    if len(configs) > 1:  # the groups after group 0, and their parameters
        names = [[n for n, g in engine.member.items() if g == i] for i in range(1, len(configs))]
        pairs = zip(configs[1:], names, strict=True)
        out["param_groups"] = [{**of(c), "params": ns} for c, ns in pairs]
    return out


def set_hyperparameters(engine: Engine, group: int = 0, **settings: float) -> None:
    """Change a parameter group's settings from the next step on (see
    ``ZeroOptimizer.set_hyperparameters``), checked as at construction."""
    allowed = engine.rule.settings
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"set_hyperparameters: unknown setting(s) {unknown}; "
                        f"{engine.rule.name} takes {', '.join(allowed)}")  # fmt: skip
    if not 0 <= group < len(engine.configs):
        raise ValueError(f"set_hyperparameters: no parameter group {group!r} "
                         f"({len(engine.configs)} group(s))")  # fmt: skip
    for key in engine.rule.fixed:
        if key in settings and settings[key] != getattr(engine.configs[group], key):
            raise ValueError(f"set_hyperparameters: {key}={settings[key]!r} for group {group}: "
                             f"{engine.rule.name}'s {key} is fixed at construction (it is "
                             f"{getattr(engine.configs[group], key)!r})")  # fmt: skip
    engine.configs[group] = dataclasses.replace(engine.configs[group], **settings)


def precision_settings(engine: Engine) -> dict[str, Any]:
    """The precision a checkpoint was saved with (it holds the master precision
    whatever these say) and the loss scale's state."""
    first = next(iter(engine.precisions.values()))
    out: dict[str, Any] = {"param_dtype": first.param.name, "reduce_dtype": first.reduce.name}
    scaler = engine.scaler
    if scaler is not None:
        out.update(loss_scale=scaler.scale, loss_scale_dynamic=scaler.dynamic,
                   loss_scale_good_steps=scaler.good_steps)  # fmt: skip
    return out


def set_loss_scale(engine: Engine, settings: Mapping[str, Any]) -> None:
    """Restore a dynamic loss scale saved by :func:`precision_settings` (a load); a
    static or absent one leaves the engine's own."""
    scaler = engine.scaler
    if scaler is not None and scaler.dynamic and settings.get("loss_scale_dynamic"):
        scaler.restore(settings["loss_scale"], settings.get("loss_scale_good_steps", 0))
