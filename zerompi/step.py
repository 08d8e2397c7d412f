"""The step, one pipeline for every stage, over an :class:`zerompi.engine.Engine`::

    reduce -> agree (statistics + fingerprint) -> skip or clip -> update -> gather

Each arrow is one call on an object the engine chose when it was built (the reducer,
the agreement, the publisher, the update rule): what differs between stages and
optimizers is data, and nothing here asks which stage or which optimizer runs.
"""

from __future__ import annotations

import math

import numpy as np

from .adam import sr_key
from .blockwise import in_run
from .engine import Engine
from .mpi.agreement import CollectiveError, agree_step
from .rules.base import Piece
from .settings import settings_token


def accumulate(engine: Engine) -> None:
    """End of one micro-batch: its gradients are folded into the accumulated
    gradient and the gradient buffers take the next one (see
    ``ZeroOptimizer.accumulate``)."""
    engine.micro_batches += 1
    with engine.timings.reduce:
        engine.reducer.end_micro_batch()


def step(engine: Engine) -> None:
    """Collective: reduce -> agree -> skip or clip -> Adam -> gather (see
    ``ZeroOptimizer.step``). Leaves every gradient buffer zeroed."""
    engine.access.finish(step=True)  # no gather may read the shards Adam will write
    engine.snapshots.settle()  # nor a snapshot's messages still read them
    if engine.micro_batches == 0:
        accumulate(engine)  # what was handed over is the one micro-batch
    else:
        engine.reducer.flush()
    with engine.timings.reduce:
        norm, nonfinite = agree(engine, reduce(engine))
        engine.snapshots.commit()  # every rank's snapshot messages are complete
    divisor = float(engine.comm.size * engine.micro_batches) * engine.loss_scale
    scaler = engine.scaler
    if nonfinite or not math.isfinite(norm):
        if scaler is not None:  # an overflow: the scale comes down, on every rank alike
            scaler.update(True, engine.step_count + 1)
        return skip(engine, nonfinite)
    if scaler is not None:
        scaler.update(False, engine.step_count + 1)
    max_norm = engine.settings.max_norm
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:  # torch's clip_grad_norm_: scale by min(1, coef)
            divisor /= coef
    engine.step_count += 1
    update(engine, divisor)
    with engine.timings.gather:
        engine.gatherer.finish()
    end_step(engine)


def reduce(engine: Engine) -> np.ndarray:
    """Every bucket's reduction, and this rank's row of the agreement."""
    row, stats_runs, reducer = engine.row, engine.stats_runs, engine.reducer
    row[:2] = 0.0

    def visit(index: int) -> None:  # bucket `index` is reduced
        stats_runs.add(index, reducer.fused, row)

    reducer.reduce(visit)
    row[2], row[3] = engine.step_count, engine.micro_batches
    row[4:7], row[7] = engine.comm.fingerprint.words(), settings_token(engine.rule,
                                                                        engine.configs)
    return row


def agree(engine: Engine, row: np.ndarray) -> tuple[float, int]:
    """The step's one small collective (:func:`zerompi.mpi.agreement.agree_step`); on
    disagreement the gradients are discarded and every rank raises
    :class:`zerompi.mpi.agreement.CollectiveError`. Returns the averaged gradient's
    norm and the count of its non-finite elements."""
    try:
        nonfinite, sumsq = agree_step(engine.comm, row, engine.describe, engine.step_count + 1)
    except CollectiveError:
        engine.discard()
        raise
    divisor = float(engine.comm.size * engine.micro_batches) * engine.loss_scale
    norm = math.sqrt(sumsq) / divisor
    engine.last_grad_norm = norm
    return norm, nonfinite


def skip(engine: Engine, nonfinite: int) -> None:
    """A non-finite gradient or norm: the same on every rank, state untouched."""
    engine.skipped_steps += 1
    engine.discard()
    engine.comm.step = engine.step_count + 1
    engine.snapshots.after_step(engine)
    if engine.config.nonfinite == "raise":
        what = (
            f"has {nonfinite} non-finite element(s)" if nonfinite
            else f"has a norm that overflows ({engine.last_grad_norm})"
        )  # fmt: skip
        raise FloatingPointError(
            f"step {engine.step_count + 1}: the averaged gradient {what} over "
            f"{engine.comm.size} rank(s); the step was skipped (parameters and Adam "
            "state unchanged)"
        )


def update(engine: Engine, divisor: float) -> None:
    """The update rule on this rank's part, run by run of buckets, in chunks; each
    bucket's gather starts as soon as its part is updated and advances between the
    chunks."""
    adam_phase, gather_phase = engine.timings.adam, engine.timings.gather
    step_count, configs, gatherer = engine.step_count, engine.configs, engine.gatherer
    rule = engine.rule
    rule_update = rule.update
    chunk = gatherer.chunk
    key = sr_key(step_count) if engine.config.precision.rounding == "stochastic" else None
    pending = []  # what the update calls leave for the rule's finish (block states)
    context = None
    if rule.prepares:  # (collective) statistics over whole parameters first
        with adam_phase:
            context = rule.before(pieces(engine, divisor), step_count, engine.world)
    for run, base, first, segs, units in zip(engine.update_runs, engine.low_bases,
                                             engine.update_offsets, engine.segments,
                                             engine.update_units, strict=True):  # fmt: skip
        (param, grad, *states, low), scratch = run.arrays, run.scratch
        for lo, hi, config in ((lo, min(lo + chunk, stop), configs[group])
                               for start, stop, group in segs
                               for lo in range(start, stop, chunk)):  # fmt: skip
            sr = None if key is None or low is None else (key, base + lo)
            views = [s[lo:hi] if u is None else s[in_run(u[0], first, u[1], lo, hi)]
                     for s, u in zip(states, units, strict=True)]  # fmt: skip
            with adam_phase:
                left = rule_update(param[lo:hi], grad[lo:hi], views, step_count, config, scratch,
                                   divisor, None if low is None else low[lo:hi], sr,
                                   first + lo, context)  # fmt: skip
            if left is not None:
                pending.append(left)
            with gather_phase:
                gatherer.progress()
        with gather_phase:
            gatherer.started(run.last)  # a run is one bucket where gathers start per bucket
    if engine.agreement is not None:  # (collective) the blocks that parts share
        with adam_phase:
            rule.finish(pending, engine.agreement)


def pieces(engine: Engine, divisor: float) -> list[Piece]:
    """What this rank updates, run by run (one bucket each for a rule that prepares:
    its states are held per unit), for :meth:`zerompi.rules.Rule.before`."""
    out = []
    for run, first, counted, segs in zip(engine.update_runs, engine.update_offsets,
                                         engine.update_counted, engine.segments,
                                         strict=True):  # fmt: skip
        param, grad, *states, _ = run.arrays
        configs = [(start, stop, engine.configs[group]) for start, stop, group in segs]
        out.append(Piece(param, grad, states, first, counted, configs, divisor))
    return out


def end_step(engine: Engine) -> None:
    with engine.timings.reduce:  # the gradient buffers left zero: part of the reduction
        engine.reducer.consumed()
    engine.micro_batches = 0
    engine.comm.step = engine.step_count + 1
    engine.snapshots.after_step(engine)
