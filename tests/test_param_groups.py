"""Adam's settings per parameter group and between steps: every group against a
reference of its own, the groups checked at construction, and settings that differ
between ranks failing every step on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    F32,
    MODES,
    SHAPES,
    VARIANTS,
    backward,
    compare,
    make_params,
    mean_grads,
    mismatches,
    rank_grads,
    spec_of,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError
from zerompi.reference import ReferenceAdam


@pytest.mark.parametrize("mode", MODES)
def test_hyperparameters_changed_between_steps(comm: MPI.Intracomm, mode: str) -> None:
    """A schedule: ``set_hyperparameters`` between steps (the learning rate, then
    weight decay, betas and eps too) takes effect from the next step, exactly as the
    reference changed alike; a warm-up from ``lr=0`` moves the moments, not the
    parameters (as torch's Adam does)."""
    stage, api = MODES[mode]
    hyper = VARIANTS["adamw"]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=3)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7, **hyper)
    ref = ReferenceAdam(params, **hyper)
    schedule = [{"lr": 0.0}, {"lr": 5e-3}, {"lr": 2e-3, "weight_decay": 0.2},
                {"lr": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}]  # fmt: skip
    names = {"lr": "lr", "weight_decay": "wd", "beta1": "b1", "beta2": "b2", "eps": "eps"}
    problems = []
    for step, change in enumerate(schedule):
        opt.set_hyperparameters(**change)
        for key, value in change.items():
            setattr(ref, names[key], value)
        backward(opt, rank_grads(spec, step, comm.rank), api, None)
        opt.step()
        ref.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, ref, True, f"step {step} after {change}", step == 3)
    if opt.hyperparameters()["lr"] != 1e-3:
        problems.append(f"hyperparameters() says lr {opt.hyperparameters()['lr']}")
    verdict(problems)


#: Two groups beside group 0 (the constructor's settings): a no-decay group of
#: vectors, and one layer with its own lr, betas and eps. With ``bucket_elems=7`` the
#: groups cut through buckets and through the ranks' shards.
GROUPS = [
    {"params": ["l1.b", "l2.one", "scalar"], "weight_decay": 0.0},
    {"params": ["l2.w"], "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6},
]


@pytest.mark.parametrize("mode", MODES)
def test_param_groups_have_their_own_settings(comm: MPI.Intracomm, mode: str) -> None:
    """Every parameter steps with its group's settings, bit for bit as a reference
    per group; ``set_hyperparameters(group=...)`` changes that group only; the
    checkpoint's header lists the groups."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=5)
    base = VARIANTS["adamw"]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7,
                        param_groups=GROUPS, **base)  # fmt: skip
    listed = [set(g["params"]) for g in GROUPS]
    members = [[n for n in params if not any(n in s for s in listed)], *map(sorted, listed)]
    refs = []
    for names, group in zip(members, [{}, *GROUPS], strict=True):
        settings = {**base, **{k: v for k, v in group.items() if k != "params"}}
        refs.append(ReferenceAdam({n: params[n] for n in names}, **settings))
    problems = []
    for step in range(3):
        if step == 2:
            opt.set_hyperparameters(group=2, lr=1e-3)
            refs[2].lr = 1e-3
        backward(opt, rank_grads(spec, step, comm.rank), api, None)
        opt.step()
        mean = mean_grads(spec, step, comm.size)
        for ref in refs:
            ref.step({n: mean[n] for n in ref.params})
    full = opt.full_params()
    for ref in refs:
        for name, want in ref.params.items():
            problems += compare(full[name], want, True, f"{mode}: {name!r}")
    saved = opt.hyperparameters()["param_groups"]
    if [sorted(g["params"]) for g in saved] != members[1:] or saved[1]["lr"] != 1e-3:
        problems.append(f"hyperparameters() lists {saved}")
    verdict(problems)


def test_param_groups_are_checked(comm: MPI.Intracomm) -> None:
    """A parameter in two groups, a name that is no parameter, an unknown setting, a
    group number that does not exist: a clear error on every rank."""
    params = make_params(spec_of(SHAPES, F32))
    problems = []
    for groups, match in (
        ([{"params": ["l1.w"]}, {"params": ["l1.w"], "lr": 1.0}], "already in param_groups[0]"),
        ([{"params": ["nope"]}], "'nope', which is not a parameter"),
        ([{"params": ["l1.w"], "momentum": 0.9}], "unknown setting 'momentum'"),
    ):
        try:
            ZeroOptimizer(params, comm=comm, param_groups=groups)
            problems.append(f"{groups} accepted")
        except (ValueError, TypeError) as exc:
            if match not in str(exc):
                problems.append(f"{groups}: {exc}")
    opt = ZeroOptimizer(params, comm=comm, param_groups=GROUPS)
    try:
        opt.set_hyperparameters(group=3, lr=1.0)
        problems.append("group 3 accepted")
    except ValueError as exc:
        if "no parameter group 3" not in str(exc):
            problems.append(str(exc))
    verdict(problems)


def test_hyperparameters_that_differ_between_ranks_fail_the_step(comm: MPI.Intracomm) -> None:
    """Ranks that set different settings fail every step on every rank, naming the
    rank, before Adam runs (the state is untouched), until they agree again; bad
    settings are refused at once."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=4)
    opt = ZeroOptimizer(params, comm=comm, stage=2, lr=1e-2)
    problems = []
    for bad, kind in (({"lr": -1.0}, ValueError), ({"momentum": 0.9}, TypeError)):
        try:
            opt.set_hyperparameters(**bad)
            problems.append(f"{bad} accepted")
        except kind:
            pass
    opt.set_hyperparameters(lr=1e-2 * (1 + comm.rank))
    before = opt.full_params()
    for step in range(3):
        if step == 2:
            opt.set_hyperparameters(lr=1e-2)  # the ranks agree again
        backward(opt, rank_grads(spec, step, comm.rank), "streamed", None)
        error = None
        try:
            opt.step()
        except CollectiveError as exc:
            error = str(exc)
        fails = comm.size > 1 and step < 2
        if fails and (error is None or "Adam's settings differ between ranks" not in error):
            problems.append(f"step {step}: no CollectiveError about the settings: {error}")
        if not fails and error is not None:
            problems.append(f"step {step} failed: {error}")
        if step == 1:
            after = opt.full_params()
            if comm.size > 1 and any(not np.array_equal(before[n], after[n]) for n in before):
                problems.append("the parameters changed")
    if opt.step_count != (1 if comm.size > 1 else 3):
        problems.append(f"{opt.step_count} steps taken")
    verdict(problems)
