"""Muon (``optimizer="muon"``, :mod:`zerompi.rules.muon`): against
:class:`zerompi.reference.ReferenceMuon` on the whole model at every stage and layout
on every communicator of the ``comm`` fixture (matrices cut across shards, assembled
on their owners and returned with exact counts; one-element buckets), both dtypes; a
group left to AdamW and a schedule; checkpoints at another world size; the owners'
balance; the estimator; and through ``zerompi.torch.shard`` against Muon written here
in torch from Keller Jordan's reference."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED_MATRICES,
    MODES,
    assert_all,
    assert_raises_all,
    backward,
    estimate_problems,
    make_params,
    mean_grads,
    mismatches,
    paired_cases,
    rank_grads,
    shared_path,
    spec_of,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.partition import ParamSpec
from zerompi.reference import ReferenceMuon
from zerompi.rules.muon import owners

WORLD = MPI.COMM_WORLD

#: Matrices (one tall, one a 3-D tensor seen as 3 x 77), vectors and a scalar.
SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (37, 19),
    "b": (5,),
    "conv": (3, 7, 11),
    "one": (1,),
    "scalar": (),
    "w": (9, 70),
    "tall": (40, 3),
}
SETTINGS: dict[str, dict[str, Any]] = {
    "keller": {"lr": 2e-2, "weight_decay": 0.1},
    "moonlight-plain": {"lr": 1e-2, "match_rms": 0.2, "muon_nesterov": False,
                        "muon_momentum": 0.9, "ns_steps": 3},
}  # fmt: skip
BUCKETS = [1, 100, None]

CASES, IDS = paired_cases(
    ((mode, setting, dtype, BUCKETS[i % len(BUCKETS)])
     for i, (mode, setting, dtype) in enumerate(itertools.product(MODES, SETTINGS, [F32, F64]))),
    lambda m, s, d, b: f"{m}-{s}-{d.name}-bucket{b}",
)  # fmt: skip


def reference(params: dict[str, np.ndarray], setting: dict[str, Any]) -> ReferenceMuon:
    kw = {{"muon_momentum": "momentum", "muon_nesterov": "nesterov"}.get(k, k): v
          for k, v in setting.items()}  # fmt: skip
    return ReferenceMuon(params, **kw)


@pytest.mark.parametrize(("comm", "mode", "setting", "dtype", "bucket_elems"), CASES, ids=IDS,
                         indirect=["comm"])  # fmt: skip
def test_matches_reference(
    comm: MPI.Intracomm, mode: str, setting: str, dtype: np.dtype, bucket_elems: int | None
) -> None:
    """Three steps: the parameters after every step, the momentum and AdamW's
    states after the first and the last, bit for bit."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, dtype)
    params = make_params(spec)
    extra = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, optimizer="muon", **SETTINGS[setting],
                        **extra)  # fmt: skip
    verdict(train(opt, reference(params, SETTINGS[setting]), spec, 3,
                  check_state=lambda step: step == 0, api=api))  # fmt: skip
    opt.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_dtypes_and_empty_shards(comm: MPI.Intracomm, stage: int) -> None:
    spec = MIXED_MATRICES
    params = make_params(spec)
    api = "grads" if stage < 2 else "streamed"
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, optimizer="muon",
                        lr=1e-2)  # fmt: skip
    verdict(train(opt, ReferenceMuon(params, lr=1e-2), spec, 3, api=api))
    opt.close()


def test_a_group_left_to_adamw_and_a_schedule(comm: MPI.Intracomm) -> None:
    """The embedding in a group with ``muon=False`` (AdamW, its own lr and betas), as
    Keller's and Moonlight's recipes do, then both learning rates halved after two
    steps, at stages 1 and 3."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    group = {"muon": False, "lr": 3e-3, "betas": (0.8, 0.9)}
    for stage, api in ((1, "grads"), (3, "streamed")):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=100, optimizer="muon",
                            lr=2e-2, param_groups=[{"params": ["emb", "b"], **group}])  # fmt: skip
        ref = ReferenceMuon(params, lr=2e-2, adamw=["emb"])
        ref.overrides = {n: {"lr": 3e-3, "betas": (0.8, 0.9)} for n in ("emb", "b")}
        problems = train(opt, ref, spec, 2, api=api)
        opt.set_hyperparameters(group=0, lr=1e-2)
        opt.set_hyperparameters(group=1, lr=1.5e-3)
        ref.settings["lr"] = 1e-2
        for n in ("emb", "b"):
            ref.overrides[n]["lr"] = 1.5e-3
        for step in range(2, 4):
            backward(opt, rank_grads(spec, step, comm.rank), api)
            opt.step()
            ref.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, ref, True, f"stage {stage} after the schedule")
        opt.close()
        verdict(problems)


def test_owners_balance_the_newton_schulz_work() -> None:
    """Largest first to the least loaded rank: three ranks, work 8, 4, 4, 2, 1
    (rows * cols * min) -> 8 | 4 1 | 4 2 ... as the greedy rule says, and every
    matrix owned once."""
    mats = [ParamSpec(n, s, np.dtype(np.float32), 0, int(np.prod(s)))
            for n, s in (("a", (2, 2)), ("big", (2, 4)), ("c", (2, 2)), ("d", (1, 2)),
                         ("e", (1, 1)))]  # fmt: skip
    got = owners(mats, 3)
    assert got == {"big": 0, "a": 1, "c": 2, "d": 1, "e": 2}, got
    assert owners(mats, 1) == dict.fromkeys(got, 0)


@pytest.mark.mpi_skip
def test_owners_are_where_the_matrices_are_counted() -> None:
    """With the counted elements, the rank counting most of a matrix owns it while
    the work stays even: eight equal matrices in two ranks' shards are each owned
    where they lie (nothing is exchanged: ``_plan(...).moves`` is false on both), one
    matrix split evenly goes to the least loaded, and a rank holding every matrix
    keeps only its even share of the work."""
    from zerompi.partition import optimizer_layout
    from zerompi.rules.base import World
    from zerompi.rules.muon import _owners, _plan

    specs = [(f"m{i}", (8, 8), np.dtype(np.float32)) for i in range(8)]
    for rank in range(2):
        layout = optimizer_layout(specs, 2, rank, 1, 512)  # one bucket, 256 elements each
        got = _owners(list(layout.params), layout, 1)
        assert got == {f"m{i}": i // 4 for i in range(8)}, got
        world = World(layout, 1, {}, None, None, None, {}, {})
        plan = _plan([(p, got[p.name]) for p in layout.params], world)
        assert not plan.moves and not plan.sends and sum(plan.recv_counts) == 0, plan
    split = [("a", (8, 8), np.dtype(np.float32)), ("b", (8, 8), np.dtype(np.float32))]
    layout = optimizer_layout(split, 2, 0, 1, 64)  # a bucket each, cut in half
    assert _owners(list(layout.params), layout, 1) == {"a": 0, "b": 1}
    many = [(f"m{i}", (4, 4), np.dtype(np.float32)) for i in range(4)]
    layout = optimizer_layout([*many, ("pad", (200,), np.dtype(np.float32))], 2, 0, 1, 1000)
    mats = [p for p in layout.params if len(p.shape) == 2]  # all in rank 0's shard
    assert sorted(_owners(mats, layout, 1).values()) == [0, 0, 1, 1]


def test_checkpoint_at_another_world_size(mpi_tmp_path: Path) -> None:
    """Saved by the world at stage 3, loaded by one rank at stage 1 and trained on:
    as the reference trained without the checkpoint."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    path = shared_path(mpi_tmp_path, WORLD, "muon")
    opt = ZeroOptimizer(params, comm=WORLD, stage=3, bucket_elems=100, optimizer="muon",
                        lr=2e-2)  # fmt: skip
    for step in range(2):
        backward(opt, rank_grads(spec, step, WORLD.rank), "streamed")
        opt.step()
    opt.save(path)
    opt.close()
    single = ZeroOptimizer(make_params(spec, seed=3), comm=MPI.COMM_SELF, stage=1,
                           bucket_elems=7, optimizer="muon", lr=2e-2)  # fmt: skip
    single.load(path)
    ref = ReferenceMuon(params, lr=2e-2)
    for step in range(2):
        ref.step(mean_grads(spec, step, WORLD.size))
    for step in range(2, 4):
        backward(single, rank_grads(spec, step, 0), "grads")
        single.step()
        ref.step(mean_grads(spec, step, 1))
    problems = mismatches(single, ref, True, "single rank after the load")
    single.close()
    assert_all(not problems, "\n".join(problems[:6]))


def test_estimate_equals_the_optimizer(comm: MPI.Intracomm) -> None:
    """The workspace (the parts exchanged, one owned matrix assembled, the
    Newton-Schulz products of the largest owned) included, with every matrix Muon's
    and with a group that leaves some to AdamW (which moves the owners)."""
    layout = [("a", (37, 19), F32), ("b", (5,), F32), ("c", (3, 7, 11), F64),
              ("d", (40, 3), F32), ("e", (6, 50), F32)]  # fmt: skip
    problems = estimate_problems(comm, layout, "muon", (100,))
    problems += estimate_problems(comm, layout, "muon", (64,),
                                  [{"params": ["a", "b"], "muon": False}])  # fmt: skip
    assert_all(not problems, "\n".join(problems[:6]))
    from zerompi.memory import estimate

    usage = estimate(layout, comm.size, comm.rank, 1, 100, optimizer="muon")["buffers"]
    assert_all(any(name.startswith("workspace") for name in usage) or comm.size > 5, str(usage))


def test_which_matrices_are_muons_is_fixed(comm: MPI.Intracomm) -> None:
    """``set_hyperparameters(muon=...)`` changing it is an error naming it, on every
    rank (it decides the owners and the workspace); setting it as it is, is not."""
    params = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32)}
    opt = ZeroOptimizer(params, comm=comm, optimizer="muon")
    assert_raises_all(ValueError, "muon's muon is fixed at construction",
                      lambda: opt.set_hyperparameters(group=0, muon=False))  # fmt: skip
    opt.set_hyperparameters(group=0, muon=True, lr=1e-3)
    assert_all(opt.hyperparameters()["lr"] == 1e-3, str(opt.hyperparameters()))
    opt.close()


def test_settings_are_checked_everywhere(comm: MPI.Intracomm) -> None:
    params = {"w": np.zeros((3, 4), np.float32)}
    assert_raises_all(ValueError, "ns_steps must be an integer 0 to 100",
                      lambda: ZeroOptimizer(params, comm=comm, optimizer="muon", ns_steps=2.5))
    assert_raises_all(ValueError, "muon_momentum=0.5 is not a setting of optimizer='adam'",
                      lambda: ZeroOptimizer(params, comm=comm, muon_momentum=0.5))  # fmt: skip
