"""The driver end to end under a subprocess mpiexec, and the model's gradient.

The mpiexec runs happen only in the serial pytest run (``mpi_skip``): launching
mpiexec from inside an mpiexec'd test is not portable. Each run has its own timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_harness import mpiexec

from zerompi import mlp

ROOT = Path(__file__).parent.parent


def run_driver(ranks: int, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"driver-{ranks}.json"
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.driver"]
    cmd += ["--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return json.loads(out.read_text()), text


@pytest.mark.mpi_skip
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_default_run_trains_and_matches_the_reference(ranks: int, tmp_path: Path) -> None:
    result, text = run_driver(ranks, tmp_path, "--verify", "--steps", "60")
    assert result["world_size"] == ranks and result["stage"] == 2
    assert result["params"] == mlp.count_params(result["layer_sizes"])
    assert result["loss_last"] < 0.6 * result["loss_first"], result["losses"]
    assert len(result["losses"]) == result["steps"] == 60
    assert result["max_rel_diff"] <= 1e-4, text
    if ranks == 1:
        assert result["max_abs_diff"] == 0.0  # one rank reproduces the reference exactly
    for key in ("step_ms", "train_step_ms"):
        assert result[key] > 0
    assert set(result["phase_ms"]) == {"reduce_scatter", "adam", "allgather"}
    memory = result["memory_bytes"]
    assert set(memory) >= {
        "optimizer_states", "gradient_partitions", "parameter_partitions",
        "communication_buffers",
    }
    itemsize = 4
    shard = -(-result["params"] // ranks)  # bucket shards sum to at most ceil(P/W) + buckets
    assert memory["parameter_partitions"] == result["params"] * itemsize
    assert memory["optimizer_states"] <= 2 * itemsize * (shard + result["buckets"])
    assert "step " in text and "loss" in text  # rank 0 prints progress


@pytest.mark.mpi_skip
@pytest.mark.parametrize(
    "args",
    [
        ("--stage", "1"),
        ("--stage", "1", "--micro-batches", "3", "--batch", "30"),
        ("--stage", "2", "--micro-batches", "3", "--batch", "30", "--adamw",
         "--weight-decay", "0.1"),
        ("--batch", "3"),  # fewer rows than ranks: some ranks compute on nothing
        ("--dtype", "float64", "--bucket-elems", "1000", "--weight-decay", "0.01"),
    ],
    ids=["stage1", "stage1-accum", "stage2-accum-adamw", "tiny-batch", "float64-buckets"],
)
def test_variants_match_the_reference_at_4_ranks(args: tuple[str, ...], tmp_path: Path) -> None:
    result, text = run_driver(4, tmp_path, "--verify", "--steps", "20", *args)
    tolerance = 1e-10 if "float64" in args else 1e-4
    assert result["max_rel_diff"] <= tolerance, text
    if result["batch"] >= 30:  # a 3-row batch's loss is mostly noise
        assert result["loss_last"] < result["loss_first"], result["losses"]


@pytest.mark.mpi_skip
def test_stage_1_and_2_train_identically(tmp_path: Path) -> None:
    one, _ = run_driver(3, tmp_path, "--stage", "1", "--steps", "15")
    two, _ = run_driver(3, tmp_path, "--stage", "2", "--steps", "15")
    assert one["losses"] == two["losses"]
    assert one["memory_bytes"]["gradient_partitions"] > two["memory_bytes"]["gradient_partitions"]


@pytest.mark.mpi_skip
def test_help_and_bad_options_fail_cleanly(tmp_path: Path) -> None:
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.driver", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count("usage:") == 1, proc.stdout
    for bad in (["--stage", "7"], ["--steps", "0"], ["--lr", "-1"]):
        proc = subprocess.run(
            [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.driver", *bad],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert proc.stderr.count("error:") == 1, proc.stderr


def test_model_gradient_matches_finite_differences() -> None:
    sizes = mlp.layer_sizes(5, 7, 2, 3)
    params = mlp.init_params(sizes, seed=3, dtype=np.float64)
    x, y = mlp.make_batch(3, 0, 0, 9, 5, 3, np.float64)
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    grads["layer0.bias"] += 1.0  # gradients are added, not written
    mlp.loss_and_grad(params, x, y, grads, scale=0.5)
    grads["layer0.bias"] -= 1.0
    h = 1e-6
    for name, p in params.items():
        for index in [(0,) * p.ndim, tuple(s - 1 for s in p.shape)]:
            old = p[index]
            p[index] = old + h
            up = mlp.loss_and_grad(params, x, y, None)
            p[index] = old - h
            down = mlp.loss_and_grad(params, x, y, None)
            p[index] = old
            numeric = 0.5 * (up - down) / (2 * h)
            assert abs(grads[name][index] - numeric) < 1e-7, (name, index)


def test_batches_are_deterministic_and_rank_slices_partition_them() -> None:
    x1, y1 = mlp.make_batch(7, 4, 1, 10, 6, 4)
    x2, y2 = mlp.make_batch(7, 4, 1, 10, 6, 4)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    x3, _ = mlp.make_batch(7, 5, 1, 10, 6, 4)
    assert not np.array_equal(x1, x3)
    assert set(np.unique(y1)) <= set(range(4))
