"""Adafactor (``optimizer="adafactor"``, :mod:`zerompi.rules.adafactor`): against
:class:`zerompi.reference.ReferenceAdafactor` on the whole model at every stage and
layout on every communicator of the ``comm`` fixture, with matrices (and a stack of
matrices) cut across shards and one-element buckets (most ranks own nothing); both
dtypes; parameter groups and a schedule; checkpoints at another world size and stage;
the estimator; torch's own ``Adafactor`` through ``zerompi.torch.shard``."""

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
from zerompi.checkpoint import read
from zerompi.memory import estimate
from zerompi.reference import ReferenceAdafactor

WORLD = MPI.COMM_WORLD

#: Matrices whose rows shards cut, a stack of three matrices, vectors, a scalar.
SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (37, 19),
    "b": (5,),
    "stack": (3, 7, 11),
    "one": (1,),
    "scalar": (),
    "w": (9, 70),
}
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"lr": 1e-2},
    "decay-clip": {"lr": 3e-2, "weight_decay": 0.1, "d": 1.5, "eps2": 1e-2,
                   "beta2_decay": -0.6},
}  # fmt: skip
BUCKETS = [1, 100, None]

CASES, IDS = paired_cases(
    ((mode, setting, dtype, BUCKETS[i % len(BUCKETS)])
     for i, (mode, setting, dtype) in enumerate(itertools.product(MODES, SETTINGS, [F32, F64]))),
    lambda m, s, d, b: f"{m}-{s}-{d.name}-bucket{b}",
)  # fmt: skip


@pytest.mark.parametrize(("comm", "mode", "setting", "dtype", "bucket_elems"), CASES, ids=IDS,
                         indirect=["comm"])  # fmt: skip
def test_matches_reference(
    comm: MPI.Intracomm, mode: str, setting: str, dtype: np.dtype, bucket_elems: int | None
) -> None:
    """Four steps: the parameters after every step, the rows', columns' and vectors'
    states after the first and the last: bit for bit on one rank; on more, within
    1e-6 (float32) and 1e-12 (float64) of the largest. The exact gradients make the
    rows' and columns' sums exact, but the per-parameter sums of X^2 and U^2 are
    added in another order over ranks (float64 gave 1.7e-16 at W = 2)."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, dtype)
    params = make_params(spec)
    extra = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, optimizer="adafactor",
                        **SETTINGS[setting], **extra)  # fmt: skip
    ref = ReferenceAdafactor(params, **SETTINGS[setting])
    verdict(train(opt, ref, spec, 4, check_state=lambda step: step == 0, api=api,
                  bitwise=comm.size == 1))  # fmt: skip
    opt.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_dtypes_and_empty_shards(comm: MPI.Intracomm, stage: int) -> None:
    """float32 and float64 parameters interleaved, one-element buckets."""
    spec = MIXED_MATRICES
    params = make_params(spec)
    api = "grads" if stage < 2 else "streamed"
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, optimizer="adafactor",
                        lr=1e-2)  # fmt: skip
    verdict(train(opt, ReferenceAdafactor(params, lr=1e-2), spec, 3, api=api,
                  bitwise=comm.size == 1))  # fmt: skip
    opt.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_the_numpy_loops_give_the_compiled_bits(
    comm: MPI.Intracomm, stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The optimizer with its numpy loops (``zerompi.adam.KERNEL = "numpy"``, what a
    build without a C compiler runs) ends with the compiled loops' bits, parameters
    and every state, at every world size (the sums are added in one order by both);
    the matrices are wider than 16 lanes, with tails, and cut by buckets of 100."""
    from zerompi import adam

    spec = spec_of({**SHAPES, "wide": (13, 150)}, F32)
    params = make_params(spec)
    results = []
    for kernel in ("numpy", adam.KERNEL):
        monkeypatch.setattr(adam, "KERNEL", kernel)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=100,
                            optimizer="adafactor", lr=1e-2, weight_decay=0.1)  # fmt: skip
        for step in range(3):
            backward(opt, rank_grads(spec, step, comm.rank), "grads" if stage < 2 else "streamed")
            opt.step()
        results.append((opt.full_params(), opt.gather_state()))
        opt.close()
    (p0, s0), (p1, s1) = results
    problems = [n for n in p0 if p0[n].tobytes() != p1[n].tobytes()]
    problems += [f"{k}[{n}]" for k in s0 for n in s0[k]
                 if s0[k][n].tobytes() != s1[k][n].tobytes()]  # fmt: skip
    assert_all(not problems, f"numpy and compiled differ: {problems[:6]}")


def test_parameter_groups_and_a_schedule(comm: MPI.Intracomm) -> None:
    """A second group with its own lr, beta2_decay and weight decay, then
    ``set_hyperparameters`` halving both learning rates after two steps, at stages 1
    and 3."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    second = ["emb", "one", "scalar"]
    group = {"lr": 5e-2, "beta2_decay": -0.5, "weight_decay": 0.2}
    for stage, api in ((1, "grads"), (3, "streamed")):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=100,
                            optimizer="adafactor", lr=1e-2,
                            param_groups=[{"params": second, **group}])  # fmt: skip
        ref = ReferenceAdafactor(params, lr=1e-2)
        ref.overrides = {n: dict(group) for n in second}
        problems = train(opt, ref, spec, 2, api=api, bitwise=comm.size == 1)
        opt.set_hyperparameters(group=0, lr=5e-3)
        opt.set_hyperparameters(group=1, lr=2.5e-2)
        ref.lr = 5e-3
        for n in second:
            ref.overrides[n]["lr"] = 2.5e-2
        for step in range(2, 4):
            backward(opt, rank_grads(spec, step, comm.rank), api)
            opt.step()
            ref.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, ref, comm.size == 1, f"stage {stage} after the schedule")
        groups = opt.hyperparameters().get("param_groups", [])
        if not groups or groups[0]["beta2_decay"] != -0.5:
            problems.append(f"groups {groups}")
        opt.close()
        verdict(problems)


def test_checkpoint_at_another_world_size_and_stage(mpi_tmp_path: Path) -> None:
    """Saved by the world at stage 2, read with numpy (the rows', columns' and
    vectors' sections), loaded by the world at stage 3 and by one rank at every stage
    and trained on: as the reference trained without the checkpoint."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    path = shared_path(mpi_tmp_path, WORLD, "adafactor")
    opt = ZeroOptimizer(params, comm=WORLD, stage=2, bucket_elems=100, optimizer="adafactor",
                        lr=1e-2)  # fmt: skip
    for step in range(2):
        backward(opt, rank_grads(spec, step, WORLD.rank), "streamed")
        opt.step()
    opt.save(path)
    saved, state = read(path), opt.gather_state()
    opt.close()
    problems = [f"{label} in the file differs" for label, values in state.items()
                if not all(np.array_equal(saved[label][k], v) for k, v in values.items())]
    sections = {s["name"]: s for s in saved["header"]["sections"]}
    if sections["exp_avg_sq_row.float32"]["count"] != 37 + 3 * 7 + 9:  # rows of the matrices
        problems.append(f"rows section {sections['exp_avg_sq_row.float32']}")

    def reference(steps: int, world: int) -> ReferenceAdafactor:
        ref = ReferenceAdafactor(params, lr=1e-2)
        for step in range(steps):
            ref.step(mean_grads(spec, step, world))
        return ref

    again = ZeroOptimizer(make_params(spec, seed=3), comm=WORLD, stage=3, bucket_elems=57,
                          optimizer="adafactor", lr=1e-2)  # fmt: skip
    again.load(path)
    problems += mismatches(again, reference(2, WORLD.size), WORLD.size == 1, "world, stage 3")
    again.close()
    for stage in range(4):
        single = ZeroOptimizer(make_params(spec, seed=3), comm=MPI.COMM_SELF, stage=stage,
                               bucket_elems=7, optimizer="adafactor", lr=1e-2)  # fmt: skip
        single.load(path)
        ahead = reference(2, WORLD.size)
        for step in range(2, 4):
            backward(single, rank_grads(spec, step, 0), "streamed" if stage == 3 else "grads")
            single.step()
            ahead.step(mean_grads(spec, step, 1))
        problems += mismatches(single, ahead, WORLD.size == 1, f"single rank, stage {stage}")
        single.close()
    assert_all(not problems, "\n".join(problems[:8]))


LAYOUT = [("a", (37, 19), F32), ("b", (5,), F32), ("c", (3, 7, 11), F32), ("d", (), F64),
          ("e", (4, 4), F64)]  # fmt: skip


def test_estimate_equals_the_optimizer(comm: MPI.Intracomm) -> None:
    """Every buffer, every stage, to the byte: the rows and columns of every matrix a
    part touches, the vectors' elements."""
    problems = estimate_problems(comm, LAYOUT, "adafactor", (1, 100, 300))
    assert_all(not problems, "\n".join(problems[:6]))


def test_state_bytes_are_rows_and_columns() -> None:
    """A 4096 x 4096 matrix and a 4096 vector on one rank: 4 * (4096 + 4096 + 4096)
    bytes of optimizer state, against Adam's 8 per element."""
    specs = [("w", (4096, 4096), F32), ("b", (4096,), F32)]
    states = {r: estimate(specs, 1, 0, 1, optimizer=r)["usage"]["optimizer_states"]
              for r in ("adam", "adafactor")}  # fmt: skip
    assert states == {"adam": 8 * (4096 * 4096 + 4096), "adafactor": 4 * 3 * 4096}, states


def test_settings_of_another_rule_are_refused(comm: MPI.Intracomm) -> None:
    params = {"w": np.zeros((3, 4), np.float32)}
    assert_raises_all(ValueError, "betas=(0.9, 0.99) is not a setting of optimizer='adafactor'",
                      lambda: ZeroOptimizer(params, comm=comm, optimizer="adafactor",
                                            betas=(0.9, 0.99)))  # fmt: skip
    assert_raises_all(ValueError, "beta2_decay=-0.5 is not a setting of optimizer='adam'",
                      lambda: ZeroOptimizer(params, comm=comm, beta2_decay=-0.5))  # fmt: skip
    assert_raises_all(ValueError, "d (the update clipping threshold) must be >= 1",
                      lambda: ZeroOptimizer(params, comm=comm, optimizer="adafactor", d=0.5))


def test_the_most_loaded_rank_is_found_for_states_held_per_matrix() -> None:
    """``estimate_max`` (what ``python -m zerompi.memory`` and the driver's per-category
    maximum compare): with rows and columns a rank with a smaller shard can hold more
    state (it touches more matrices), so each figure is the maximum over every rank."""
    from zerompi.memory import estimate_max

    # One bucket: a big matrix, then many small ones. Rank 0's larger shard touches
    # the big one only (200 rows and columns), the last rank's many small ones.
    specs = [("big", (100, 100), F32)] + [(f"l{i}.w", (10, 10), F32) for i in range(30)]
    for stage in (1, 2):
        for world in (2, 3, 5):
            most = estimate_max(specs, world, stage, 10**6, optimizer="adafactor")
            each = [estimate(specs, world, r, stage, 10**6, optimizer="adafactor")
                    for r in range(world)]  # fmt: skip
            assert each[-1]["usage"]["optimizer_states"] > each[0]["usage"]["optimizer_states"]
            for category, value in most["usage"].items():
                assert value == max(e["usage"][category] for e in each), (stage, world, category)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_parameter_larger_than_a_chunk(comm: MPI.Intracomm, stage: int) -> None:
    """A 300 x 300 matrix (more than ``CHUNK`` elements: its sums are added over
    pieces, and its update works piece by piece) against the reference: bit for bit
    on one rank, within the tolerance on more."""
    spec = spec_of({"big": (300, 300), "b": (300,)}, F32)
    params = make_params(spec)
    api = "grads" if stage < 2 else "streamed"
    opt = ZeroOptimizer(params, comm=comm, stage=stage, optimizer="adafactor", lr=1e-2)
    verdict(train(opt, ReferenceAdafactor(params, lr=1e-2), spec, 2, api=api,
                  bitwise=comm.size == 1))  # fmt: skip
    opt.close()
