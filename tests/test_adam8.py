"""8-bit Adam (``optimizer="adam8bit"``, :mod:`zerompi.rules.adam8`) in the engine:
against :class:`zerompi.reference.ReferenceAdam8bit` on the whole model, bit for bit
(parameters, codes and scales), at every stage and layout on every communicator of
the ``comm`` fixture (so at every world size the suite runs at), with buckets and
shards that begin and end inside a block of 256 (the blocks those cut are agreed
between ranks) and one-element buckets (most ranks own nothing); its checkpoints at
any world size and stage, its memory, and the errors for what it does not run on."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    F32,
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
from zerompi.checkpoint import CheckpointError, read
from zerompi.memory import estimate
from zerompi.reference import ReferenceAdam8bit

WORLD = MPI.COMM_WORLD

#: Sizes that put block edges (every 256 elements) inside tensors, buckets and shards.
SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (37, 19),  # 703
    "b": (5,),
    "w": (300,),
    "one": (1,),
    "big": (9, 70),  # 630
    "tail": (3,),
}
SETTINGS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
    "adam-l2": {"lr": 1e-2, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6},
}
BUCKETS = [1, 100, 257, None]

CASES, IDS = paired_cases(
    ((mode, setting, BUCKETS[i % len(BUCKETS)])
     for i, (mode, setting) in enumerate(itertools.product(MODES, SETTINGS))),
    lambda m, s, b: f"{m}-{s}-bucket{b}",
)  # fmt: skip


def reference(params: dict[str, np.ndarray], setting: dict[str, Any]) -> ReferenceAdam8bit:
    return ReferenceAdam8bit(params, **setting)


@pytest.mark.parametrize(("comm", "mode", "setting", "bucket_elems"), CASES, ids=IDS,
                         indirect=["comm"])  # fmt: skip
def test_matches_reference(
    comm: MPI.Intracomm, mode: str, setting: str, bucket_elems: int | None
) -> None:
    """Four steps: the parameters after every step, the codes and scales after the
    first and the last, bit for bit."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    extra = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, optimizer="adam8bit",
                        **SETTINGS[setting], **extra)  # fmt: skip
    ref = reference(params, SETTINGS[setting])
    verdict(train(opt, ref, spec, 4, check_state=lambda step: step == 0, api=api))
    opt.close()


def test_checkpoint_at_another_world_size_and_stage(mpi_tmp_path: Path) -> None:
    """Saved by the world at stage 2 (shards and buckets cutting blocks), read with
    numpy (codes as uint8 per parameter, scales per block), loaded by the world at
    stages 0 and 3 and by a single rank at every stage, then trained on: the same
    parameters, codes and scales as the reference trained without the checkpoint.
    A corrupted scale is refused on every rank, nothing loaded."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    setting = SETTINGS["adamw"]
    path = shared_path(mpi_tmp_path, WORLD, "adam8")
    opt = ZeroOptimizer(params, comm=WORLD, stage=2, bucket_elems=100, optimizer="adam8bit",
                        **setting)  # fmt: skip
    for step in range(2):
        backward(opt, rank_grads(spec, step, WORLD.rank), "streamed")
        opt.step()
    opt.save(path)
    saved, state = read(path), opt.gather_state()
    opt.close()
    problems = []
    for label, values in state.items():
        for key, value in values.items():
            there = saved[label][key]
            if not np.array_equal(there, value) or there.dtype != value.dtype:
                problems.append(f"{label}[{key!r}] in the file differs")
    ref = reference(params, setting)
    for step in range(2):
        ref.step(mean_grads(spec, step, WORLD.size))
    for stage in (0, 3):
        again = ZeroOptimizer(make_params(spec, seed=3), comm=WORLD, stage=stage, bucket_elems=57,
                              optimizer="adam8bit", **setting)  # fmt: skip
        again.load(path)
        problems += mismatches(again, ref, True, f"world, stage {stage}")
        again.close()
    for stage in range(4):
        single = ZeroOptimizer(make_params(spec, seed=3), comm=MPI.COMM_SELF, stage=stage,
                               bucket_elems=7, optimizer="adam8bit", **setting)  # fmt: skip
        single.load(path)
        ahead = reference(params, setting)
        for step in range(2):
            ahead.step(mean_grads(spec, step, WORLD.size))
        for step in range(2, 4):
            backward(single, rank_grads(spec, step, 0), "streamed" if stage == 3 else "grads")
            single.step()
            ahead.step(mean_grads(spec, step, 1))
        problems += mismatches(single, ahead, True, f"single rank, stage {stage}")
        single.close()
    assert_all(not problems, "\n".join(problems[:8]))
    if WORLD.rank == 0:  # one flipped byte in a section of scales
        section = next(s for s in read(path)["header"]["sections"]
                       if s["name"] == "exp_avg_sq_scales.float32")  # fmt: skip
        with open(path, "r+b") as f:
            f.seek(section["offset"] + 4 * (section["count"] - 1))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    WORLD.barrier()
    fresh = ZeroOptimizer(params, comm=WORLD, stage=1, optimizer="adam8bit", **setting)
    assert_raises_all(CheckpointError, "exp_avg_sq_scales.float32", lambda: fresh.load(path))
    assert_all(fresh.step_count == 0 and all(
        np.array_equal(v, params[n]) for n, v in fresh.full_params().items()), "state changed")
    fresh.close()


LAYOUT = [("a", (37, 19), F32), ("b", (5,), F32), ("c", (300,), F32), ("d", (), F32)]


def test_estimate_equals_the_optimizer(comm: MPI.Intracomm) -> None:
    """Every buffer, every stage, to the byte: the codes, and the scales of every
    block each part touches (a block cut by a part boundary counted by each)."""
    problems = estimate_problems(comm, LAYOUT, "adam8bit", (1, 100, 300))
    assert_all(not problems, "\n".join(problems[:6]))


def test_state_bytes_are_a_quarter_of_adams() -> None:
    """16M float32 parameters over 4 ranks at stage 1: the optimizer states of rank 0
    (codes 2 bytes per element, two float32 scales per 256) are 0.254 of Adam's (the
    target: at most 0.27)."""
    specs = [("w", (4096, 4096), F32)]
    states = {r: estimate(specs, 4, 0, 1, optimizer=r)["usage"]["optimizer_states"]
              for r in ("adam", "adam8bit")}  # fmt: skip
    n = 4096 * 4096 // 4
    assert states == {"adam": 8 * n, "adam8bit": 2 * n + 8 * (n // 256)}, states
    assert states["adam8bit"] / states["adam"] < 0.255


def test_what_it_does_not_run_on_is_refused_everywhere(comm: MPI.Intracomm) -> None:
    """float64 parameters: an error naming them, on every rank."""
    params = {"w": np.zeros(300, np.float32), "d": np.zeros(3, np.float64)}
    assert_raises_all(ValueError, "runs on float32 parameters only; this model has float64",
                      lambda: ZeroOptimizer(params, comm=comm, optimizer="adam8bit"))  # fmt: skip


def test_parameter_groups_and_a_schedule(comm: MPI.Intracomm) -> None:
    """A second group with its own lr, betas and weight decay, then
    ``set_hyperparameters`` halving both learning rates after two steps, at stages 1
    and 3: the reference with the same settings per parameter, bit for bit (blocks
    span the two groups)."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    second = ["emb", "one", "tail"]
    group = {"lr": 3e-2, "betas": (0.8, 0.95), "weight_decay": 0.0}
    setting = SETTINGS["adamw"]
    for stage, api in ((1, "grads"), (3, "streamed")):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=100,
                            optimizer="adam8bit", param_groups=[{"params": second, **group}],
                            **setting)  # fmt: skip
        ref = reference(params, setting)
        ref.overrides = {n: dict(group) for n in second}
        problems = train(opt, ref, spec, 2, api=api)
        opt.set_hyperparameters(group=0, lr=setting["lr"] / 2)
        opt.set_hyperparameters(group=1, lr=group["lr"] / 2)
        ref.lr /= 2
        for n in second:
            ref.overrides[n]["lr"] = group["lr"] / 2
        for step in range(2, 4):
            backward(opt, rank_grads(spec, step, comm.rank), api)
            opt.step()
            ref.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, ref, True, f"stage {stage} after the schedule")
        opt.close()
        verdict(problems)
