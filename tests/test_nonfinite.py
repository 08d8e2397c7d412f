"""Failure behaviour of ``ZeroOptimizer.step()``: non-finite gradients and clipping.

A NaN or inf in one rank's gradient must skip the step on every rank alike
(parameters, Adam moments and ``step_count`` untouched, ``skipped_steps`` counted)
or, with ``nonfinite="raise"``, raise ``FloatingPointError`` on every rank; the next
step then matches a reference that never saw the bad one. With ``max_norm`` the
averaged gradient is clipped by its global norm as torch's ``clip_grad_norm_`` does;
the reference here clips the mean gradient itself, then runs ``ReferenceAdam``.

Collective tests over the ``comm`` fixture's communicators, verdicts agreed on over
the world (see ``conftest.py``); the data and comparisons are ``helpers.py``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MODES,
    RTOL,
    SHAPES,
    VARIANTS,
    Spec,
    assert_all,
    assert_raises_all,
    backward,
    current_params,
    mean_grads,
    mismatches,
    paired_cases,
    rank_grads,
    spec_of,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError
from zerompi.reference import ReferenceAdam

BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def snapshot(opt: ZeroOptimizer) -> dict[str, dict[str, np.ndarray]]:
    """Collective: copies of the full parameters and Adam moments."""
    state = opt.gather_state()
    params = current_params(opt)
    return {"params": {n: np.array(p, copy=True) for n, p in params.items()}, **state}


def unchanged(before: Mapping, after: Mapping, what: str) -> list[str]:
    problems = []
    for key, arrays in before.items():
        for name, want in arrays.items():
            if not np.array_equal(after[key][name], want):
                problems.append(f"{what}: {key}[{name!r}] changed")
    return problems


def poisoned(spec: Spec, step: int, rank: int, culprit: int, value: float) -> dict:
    """``rank_grads``, with ``value`` in one element of ``l2.w`` on rank ``culprit``."""
    grads = dict(rank_grads(spec, step, rank))
    if rank == culprit:
        grads["l2.w"] = grads["l2.w"].copy()
        grads["l2.w"][1, 2, 0] = value
    return grads


def zero_grads_problems(opt: ZeroOptimizer, api: str) -> list[str]:
    """Gradient buffers a caller can see must be zero after a (skipped) step."""
    if api != "grads":
        return []
    return [f"opt.grads[{n!r}] not zeroed" for n, g in opt.grads.items() if g.any()]


def ref_norm(grads: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(
        math.fsum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values())
    )


def clipped(grads: Mapping[str, np.ndarray], max_norm: float) -> tuple[dict, float]:
    """torch's ``clip_grad_norm_`` on the averaged gradient: (gradients, norm before)."""
    norm = ref_norm(grads)
    if norm <= max_norm:
        return dict(grads), norm
    coef = max_norm / (norm + 1e-6)
    return {n: g * coef for n, g in grads.items()}, norm


# -- 1. a non-finite gradient skips the step everywhere -------------------------------------

SKIP_CASES, SKIP_IDS = paired_cases(
    itertools.product(MODES, BAD), lambda mode, bad: f"{mode}-{bad}"
)


@pytest.mark.parametrize(("comm", "mode", "bad"), SKIP_CASES, ids=SKIP_IDS, indirect=["comm"])
def test_nonfinite_gradient_skips_the_step(comm: MPI.Intracomm, mode: str, bad: str) -> None:
    """One rank's bad element (the last rank's, so a split's lone rank is one too):
    every rank skips alike, state untouched, and the next step matches a reference
    that never saw the bad gradient."""
    stage, api = MODES[mode]
    dtype = [F32, F64][list(BAD).index(bad) % 2]
    spec = spec_of(SHAPES, dtype)
    hyper = VARIANTS["adamw"]
    params = {n: np.linspace(-1, 1, math.prod(s), dtype=d).reshape(s) for n, (s, d) in spec.items()}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=9, **hyper)
    ref = ReferenceAdam(params, **hyper)
    w, rank = comm.size, comm.rank
    problems = []
    backward(opt, rank_grads(spec, 0, rank), api)
    opt.step()
    ref.step(mean_grads(spec, 0, w))
    before = snapshot(opt)
    backward(opt, poisoned(spec, 1, rank, w - 1, BAD[bad]), api)
    opt.step()
    problems += unchanged(before, snapshot(opt), "after the bad step")
    problems += zero_grads_problems(opt, api)
    if (opt.step_count, opt.skipped_steps) != (1, 1):
        problems.append(f"step_count {opt.step_count}, skipped_steps {opt.skipped_steps}")
    if math.isfinite(opt.last_grad_norm):
        problems.append(f"last_grad_norm {opt.last_grad_norm} is finite after a bad step")
    backward(opt, rank_grads(spec, 2, rank), api)
    opt.step()
    ref.step(mean_grads(spec, 2, w))
    problems += mismatches(opt, ref, w == 1, "the step after")
    if (opt.step_count, opt.skipped_steps) != (2, 1):
        problems.append(f"then step_count {opt.step_count}, skipped_steps {opt.skipped_steps}")
    verdict(problems, f"{mode} {bad} on {w} ranks")


@pytest.mark.parametrize("mode", ["stage1", "stage3"])
def test_nonfinite_in_one_micro_batch_discards_all_of_them(comm: MPI.Intracomm, mode: str) -> None:
    """A NaN in the first of two accumulated micro-batches skips the whole step."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F64)
    params = {n: np.full(s, 0.5, d) for n, (s, d) in spec.items()}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=6)
    before = snapshot(opt)
    backward(opt, poisoned(spec, 0, comm.rank, 0, np.nan), api)
    opt.accumulate()
    backward(opt, rank_grads(spec, 1, comm.rank), api)
    opt.accumulate()
    opt.step()
    problems = unchanged(before, snapshot(opt), "after the bad step")
    ref = ReferenceAdam(params)
    backward(opt, rank_grads(spec, 2, comm.rank), api)
    opt.step()
    ref.step(mean_grads(spec, 2, comm.size))
    problems += mismatches(opt, ref, comm.size == 1, "the step after")
    verdict(problems + ([] if opt.skipped_steps == 1 else [f"skipped {opt.skipped_steps}"]))


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_raise_raises_on_every_rank(comm: MPI.Intracomm, mode: str) -> None:
    """``nonfinite="raise"``: FloatingPointError on every rank naming the step, the
    step skipped as with "skip", and the optimizer usable afterwards."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F32)
    params = {n: np.full(s, 0.25, d) for n, (s, d) in spec.items()}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7, nonfinite="raise")
    ref = ReferenceAdam(params)
    backward(opt, rank_grads(spec, 0, comm.rank), api)
    opt.step()
    ref.step(mean_grads(spec, 0, comm.size))
    before = snapshot(opt)
    backward(opt, poisoned(spec, 1, comm.rank, 0, np.inf), api)
    assert_raises_all(FloatingPointError, "step 2", opt.step)
    problems = unchanged(before, snapshot(opt), "after the raise")
    problems += zero_grads_problems(opt, api)
    if (opt.step_count, opt.skipped_steps) != (1, 1):
        problems.append(f"step_count {opt.step_count}, skipped_steps {opt.skipped_steps}")
    backward(opt, rank_grads(spec, 2, comm.rank), api)
    opt.step()
    ref.step(mean_grads(spec, 2, comm.size))
    verdict(problems + mismatches(opt, ref, comm.size == 1, "the step after"))


# -- 2. clipping by the global norm ----------------------------------------------------------

CLIP_CASES, CLIP_IDS = paired_cases(
    itertools.product(MODES, [F32, F64]), lambda mode, dtype: f"{mode}-{dtype.name}"
)


@pytest.mark.parametrize(("comm", "mode", "dtype"), CLIP_CASES, ids=CLIP_IDS, indirect=["comm"])
def test_clipping_matches_the_clipped_reference(
    comm: MPI.Intracomm, mode: str, dtype: np.dtype
) -> None:
    """``max_norm`` well below the gradient norm (about 12): three clipped steps match
    the reference on the clipped mean gradient, moments included (which see the
    scale even where Adam's first update does not), and ``last_grad_norm`` is the
    norm before clipping."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, dtype)
    hyper = VARIANTS["adam_l2"]
    params = {n: np.full(s, 0.1, d) for n, (s, d) in spec.items()}
    max_norm = 0.5
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=8, max_norm=max_norm, **hyper)
    ref = ReferenceAdam(params, **hyper)
    problems = []
    for step in range(3):
        backward(opt, rank_grads(spec, step, comm.rank), api)
        opt.step()
        grads, norm = clipped(mean_grads(spec, step, comm.size), max_norm)
        if norm <= max_norm:
            problems.append(f"step {step}: norm {norm} would not clip")
        ref.step(grads)
        err = abs(opt.last_grad_norm - norm) / norm
        if not err <= RTOL[dtype]:
            problems.append(f"step {step}: last_grad_norm {opt.last_grad_norm}, want {norm}")
        problems += mismatches(opt, ref, False, f"step {step}")
    verdict(problems, f"{mode} {dtype.name}")


@pytest.mark.parametrize("mode", MODES)
def test_large_max_norm_changes_nothing(comm: MPI.Intracomm, mode: str) -> None:
    """A ``max_norm`` above the norm: exactly the unclipped optimizer (bit for bit on
    one rank), and ``last_grad_norm`` still reported."""
    stage, api = MODES[mode]
    dtype = [F32, F64][list(MODES).index(mode) % 2]
    spec = spec_of(SHAPES, dtype)
    hyper = VARIANTS["adamw"]
    params = {n: np.full(s, -0.3, d) for n, (s, d) in spec.items()}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=5, max_norm=1e6, **hyper)
    ref = ReferenceAdam(params, **hyper)
    problems = train(opt, ref, spec, 2, api=api)
    norm = ref_norm(mean_grads(spec, 1, comm.size))
    if not abs(opt.last_grad_norm - norm) <= RTOL[dtype] * norm:
        problems.append(f"last_grad_norm {opt.last_grad_norm}, want {norm}")
    verdict(problems)


# -- 3. settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc_type", "match"),
    [
        ({"max_norm": 0}, ValueError, "max_norm must be finite and > 0, got 0"),
        ({"max_norm": -1.0}, ValueError, "max_norm must be finite and > 0, got -1.0"),
        ({"max_norm": float("nan")}, ValueError, "max_norm must be finite and > 0, got nan"),
        ({"max_norm": float("inf")}, ValueError, "max_norm must be finite and > 0, got inf"),
        ({"max_norm": 10**400}, ValueError, "max_norm must be finite"),
        ({"max_norm": "x"}, TypeError, "max_norm must be a real number or None, got 'x'"),
        ({"max_norm": True}, TypeError, "max_norm must be a real number or None"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of ('skip', 'raise')"),
    ],
    ids=["zero", "negative", "nan", "inf", "huge", "str", "bool", "nonfinite"],
)
def test_bad_failure_settings_raise_everywhere(
    comm: MPI.Intracomm, kwargs: dict, exc_type: type, match: str
) -> None:
    params = {"w": np.ones(3, np.float32)}
    assert_raises_all(exc_type, match, lambda: ZeroOptimizer(params, comm=comm, **kwargs))


def test_failure_settings_must_agree(comm: MPI.Intracomm) -> None:
    params = {"w": np.ones(3, np.float32)}
    if comm.size == 1:
        opt = ZeroOptimizer(params, comm=comm, max_norm=2, nonfinite="raise")
        kept = (opt.engine.settings.max_norm, opt.config.nonfinite)
        assert_all(kept == (2.0, "raise"), "settings not kept")
        return
    assert_raises_all(
        CollectiveError,
        "the failure settings (max_norm, nonfinite) differs between ranks",
        lambda: ZeroOptimizer(params, comm=comm, max_norm=1.0 + comm.rank),
    )
