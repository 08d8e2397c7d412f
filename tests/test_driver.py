"""The driver end to end under a subprocess mpiexec, and the model's gradient.

The mpiexec runs happen only in the serial pytest run (``mpi_skip``): launching
mpiexec from inside an mpiexec'd test is not portable. Each run has its own timeout.
The ``--verify`` tests with an injected averaging error run ``main()`` in-process,
serially and on every rank of ``--with-mpi`` alike.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from helpers import DIES_WITH_TEST, WORLD, assert_all
from test_harness import mpiexec

import zerompi
import zerompi.driver.training
from zerompi import mlp
from zerompi.driver import main

ROOT = Path(__file__).parent.parent


def run_driver(ranks: int, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"driver-{ranks}.json"
    cmd = [*DIES_WITH_TEST, mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.driver"]
    # One BLAS thread: at one rank OpenBLAS would otherwise spin a thread per core,
    # which on a busy (CI, shared) machine makes the tiny matmuls ~50x slower.
    cmd += ["--json", str(out), "--blas-threads", "1", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return json.loads(out.read_text()), text


def layered(r: dict) -> bool:
    """Whether a stage-3 run gathered its layers (on one node with shared memory it
    reads the node's copy in place and publishes it once per step, as stage 2)."""
    return r["stage"] == 3 and not (r["shared_memory"] and r["nodes"][0] == 1)


def expected_comm(r: dict) -> dict[str, float]:
    """Textbook bytes a rank sends per step and collective, mean over ranks: every
    reduce-scatter or allgather of the P parameters sends P * itemsize * (W-1) / W.
    Stages 2-3 reduce-scatter (and stage 3 gathers, in forward and backward) once per
    micro-batch; an allreduce is a reduce-scatter plus an allgather (and is one, through
    memory, at stage 0 on one node)."""
    itemsize = 4 if r["dtype"] == "float32" else 8
    world, n = r["world_size"], r["micro_batches"]
    one = r["params"] * itemsize * (world - 1)  # / world, last, as the driver does
    node_sum = r["stage"] == 0 and r["shared_memory"]  # stage 0 summed in one node's memory
    times = {
        0: {"reduce_scatter": 1, "allgather": 1} if node_sum else {"allreduce": 2},
        1: {"reduce_scatter": 1, "allgather": 1},
        2: {"reduce_scatter": n, "allgather": 1},
        3: {"reduce_scatter": n, "allgather": 2 * n if layered(r) else 1},
    }[r["stage"]]
    return {op: times.get(op, 0) * one / world for op in r["comm_bytes"]}


def check_comm(r: dict) -> None:
    """``comm_bytes`` is the textbook volume: exactly in stages 1-3 (exact counts, no
    padding), and within a byte per bucket in stage 0 (the counter rounds the
    allreduce down). The theory field counts one micro-batch."""
    k = 3 if layered(r) else 2
    one = r["params"] * (4 if r["dtype"] == "float32" else 8) * (r["world_size"] - 1)
    assert r["comm_bytes_theory"] == k * one / r["world_size"]
    expected = expected_comm(r)
    assert set(r["comm_bytes"]) == set(r["comm_bytes_max"]) == set(expected)
    for op, value in r["comm_bytes"].items():
        slack = r["buckets"] if r["stage"] == 0 else 0
        assert abs(value - expected[op]) <= slack, (op, value, expected[op])
        assert r["comm_bytes_max"][op] >= value
    if r["micro_batches"] == 1:
        total = sum(r["comm_bytes"].values())
        assert abs(total - r["comm_bytes_theory"]) <= (r["buckets"] if r["stage"] == 0 else 0)


#: (ranks, stage): the launches scripts/test_openmpi repeats under Open MPI are one per
#: world size; the others differ only in numbers (same_launch).
_OPENMPI_RUNS = {(1, 2), (2, 3), (3, 2), (4, 3)}
DEFAULT_RUNS = [
    pytest.param(ranks, stage,
                 marks=() if (ranks, stage) in _OPENMPI_RUNS else pytest.mark.same_launch)
    for ranks in (1, 2, 3, 4) for stage in (2, 3)
]


@pytest.mark.mpi_skip
@pytest.mark.parametrize(("ranks", "stage"), DEFAULT_RUNS)
def test_default_run_trains_and_matches_the_reference(
    ranks: int, stage: int, tmp_path: Path
) -> None:
    args = ("--verify", "--steps", "60") + (("--stage", "3") if stage == 3 else ())
    result, text = run_driver(ranks, tmp_path, *args)
    assert result["world_size"] == ranks and result["stage"] == stage
    assert result["params"] == mlp.count_params(result["layer_sizes"])
    assert result["loss_last"] < 0.6 * result["loss_first"], result["losses"]
    assert len(result["losses"]) == len(result["grad_norms"]) == result["steps"] == 60
    assert result["steps_run"] == 60 and result["first_step"] == 0
    assert result["max_rel_diff"] <= 1e-4, text
    assert result["grad_norm_rel_diff"] <= 1e-4 and result["verify_ok"], text
    if ranks == 1:
        assert result["max_abs_diff"] == 0.0  # one rank reproduces the reference exactly
    for key in ("step_ms", "train_step_ms"):
        assert result[key] > 0
    assert set(result["phase_ms"]) == {"reduce_scatter", "adam", "allgather"}
    check_comm(result)
    assert 0 < result["rss_floor_bytes"] <= result["rss_peak_bytes"]
    memory = result["memory_bytes"]
    assert set(memory) >= {
        "optimizer_states", "gradient_partitions", "parameter_partitions",
        "communication_buffers",
    }
    itemsize, params, buckets = 4, result["params"], result["buckets"]
    shard = -(-params // ranks)  # bucket shards sum to at most ceil(P/W) + buckets
    widths = result["layer_sizes"]
    largest_layer = max(a * b + b for a, b in pairwise(widths))
    assert memory["optimizer_states"] <= 2 * itemsize * (shard + buckets)
    assert memory["gradient_partitions"] <= itemsize * (shard + buckets)
    buffers = result["memory_buffers"]
    assert sum(buffers.values()) == sum(memory.values())  # rank 0 holds the largest of all
    if stage == 2:  # the node's one copy, rank 0's share of it (one node here)
        share = -(-params * itemsize // ranks) if result["shared_memory"] else params * itemsize
        assert memory["parameter_partitions"] == share
        assert "param_bucket.float32" not in buffers
    else:  # parameters as shards, one layer gathered at a time
        assert memory["parameter_partitions"] <= itemsize * (shard + buckets)
        assert buckets == len(result["layer_sizes"]) - 1
        if layered(result):  # gathered: two buffers (prefetch); else the node's copy
            assert buffers["param_bucket.float32"] == 2 * largest_layer * itemsize
        else:
            assert "param_bucket.float32" not in buffers
        assert buffers["grad_bucket.float32"] == 2 * largest_layer * itemsize  # overlap
    assert "step " in text and "loss" in text  # rank 0 prints progress


@pytest.mark.mpi_skip
@pytest.mark.same_launch  # test_default_run_trains_and_matches_the_reference launches it
@pytest.mark.parametrize(
    "args",
    [
        ("--stage", "0", "--micro-batches", "3", "--batch", "30"),
        ("--stage", "1"),
        ("--stage", "1", "--micro-batches", "3", "--batch", "30"),
        ("--stage", "2", "--micro-batches", "3", "--batch", "30", "--adamw",
         "--weight-decay", "0.1"),
        ("--stage", "3", "--micro-batches", "3", "--batch", "30", "--adamw",
         "--weight-decay", "0.1"),
        ("--batch", "3"),  # fewer rows than ranks: some ranks compute on nothing
        ("--stage", "0", "--batch", "3"),
        ("--stage", "3", "--batch", "3"),
        ("--dtype", "float64", "--bucket-elems", "1000", "--weight-decay", "0.01"),
        ("--stage", "3", "--dtype", "float64", "--weight-decay", "0.01"),
    ],
    ids=["stage0-accum", "stage1", "stage1-accum", "stage2-accum-adamw",
         "stage3-accum-adamw", "tiny-batch", "stage0-tiny-batch", "stage3-tiny-batch",
         "float64-buckets", "stage3-float64"],
)
def test_variants_match_the_reference_at_4_ranks(args: tuple[str, ...], tmp_path: Path) -> None:
    result, text = run_driver(4, tmp_path, "--verify", "--steps", "20", *args)
    tolerance = 1e-10 if "float64" in args else 1e-4
    assert result["max_rel_diff"] <= tolerance, text
    check_comm(result)  # with micro-batches: stages 2-3 reduce-scatter n times
    if result["batch"] >= 30:  # a 3-row batch's loss is mostly noise
        assert result["loss_last"] < result["loss_first"], result["losses"]


@pytest.mark.mpi_skip
def test_stages_train_alike_and_send_the_textbook_bytes(tmp_path: Path) -> None:
    runs = [run_driver(3, tmp_path, "--stage", str(s), "--steps", "15")[0] for s in range(4)]
    for r in runs:
        check_comm(r)
    zero, one, two, three = runs
    # Stages 1-3 reduce with the same sums in node memory: the same numbers. Stage 0
    # is compared to rounding.
    assert one["losses"] == two["losses"] == three["losses"]
    np.testing.assert_allclose(zero["losses"], one["losses"], rtol=1e-5)
    grads = [r["memory_bytes"]["gradient_partitions"] for r in runs]
    params = [r["memory_bytes"]["parameter_partitions"] for r in runs]
    states = [r["memory_bytes"]["optimizer_states"] for r in runs]
    # Stage 3 cuts every layer into shards, 1-2 the whole model: a few elements apart.
    assert states[0] == 2 * params[0] > states[1] == states[2] and states[0] > states[3]
    assert grads[0] == grads[1] == params[0] > grads[2] and grads[1] > grads[3]
    # Stages 1-2: one parameter copy on the node, rank 0's share of it (the largest);
    # stage 0 shares its gradient buffers there (one node).
    assert all(r["shared_memory"] for r in runs)
    assert params[1] == params[2] == -(-params[0] // 3) and params[0] > params[3]


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


@pytest.mark.mpi_skip
def test_json_folder_is_made_and_an_unwritable_path_fails_before_training(
    tmp_path: Path,
) -> None:
    result, _ = run_driver(2, tmp_path / "new" / "folder", "--steps", "2")
    assert result["steps_run"] == 2
    (tmp_path / "file").write_text("")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.driver", "--steps", "2",
           "--json", str(tmp_path / "file" / "out.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("error: --json: cannot create the folder") == 1, proc.stderr
    assert "zerompi.driver: MLP" not in proc.stdout  # nothing was trained


def _scaled_micro_batch(factor: float) -> Callable[..., float]:
    """The driver's ``micro_batch`` handing over ``factor`` times the gradient."""
    original = zerompi.driver.training.micro_batch

    def wrong(opt, names, x, y, scale):  # type: ignore[no-untyped-def]
        return original(opt, names, x, y, scale * factor)

    return wrong


@pytest.mark.parametrize(
    "error", ["none", "over_w_minus_1", "micro_batches_summed", "adam_divisor"]
)
def test_verify_catches_an_averaging_error(
    error: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--verify`` fails (status 1 on every rank) when the gradient is averaged
    wrongly, although Adam's m/sqrt(v) hides the scale from the parameters: over W-1
    ranks instead of W, micro-batches summed instead of averaged (both caught by the
    gradient norms), or a wrong divisor in Adam alone (caught by the parameters once
    L2 weight decay makes Adam scale-sensitive). Collective: every rank runs main()."""
    world = WORLD.size
    if error == "over_w_minus_1" and world == 1:
        pytest.skip("needs more than one rank (run under mpiexec --with-mpi)")
    argv = ["--steps", "10", "--batch", "48", "--micro-batches", "3", "--verify",
            "--log-every", "1000", "--blas-threads", "1"]  # fmt: skip
    if error == "over_w_minus_1":
        factor = world / (world - 1)
        monkeypatch.setattr(zerompi.driver.training, "micro_batch", _scaled_micro_batch(factor))
    elif error == "micro_batches_summed":
        monkeypatch.setattr(zerompi.driver.training, "micro_batch", _scaled_micro_batch(3))
    elif error == "adam_divisor":  # Adam divides by W instead of W * micro-batches
        module = importlib.import_module("zerompi.rules.adam")  # the Adam rule's kernel call
        adam_step = module.adam_step

        def wrong_adam(*args, **kwargs):  # type: ignore[no-untyped-def]
            *head, divisor = args
            return adam_step(*head, divisor / 3, **kwargs)

        monkeypatch.setattr(module, "adam_step", wrong_adam)
        argv += ["--weight-decay", "0.01"]
    status = main(argv)
    out, err = capsys.readouterr()
    if error == "none":
        assert_all(status == 0 and (WORLD.rank or "verify OK" in out), f"{status}: {out}{err}")
        return
    assert_all(status == 1, f"verify passed despite {error}: {out}")
    if WORLD.rank == 0:
        assert "verify FAILED" in out and "verification FAILED" in err, out + err
        what = "parameters differ" if error == "adam_divisor" else "gradient norms differ"
        assert what in err, err


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


def test_deferred_params_make_init_params_one_layer_at_a_time() -> None:
    sizes = mlp.layer_sizes(6, 9, 2, 4)
    for dtype in (np.float32, np.float64):
        params = mlp.init_params(sizes, seed=5, dtype=dtype)
        deferred = mlp.deferred_params(sizes, seed=5, dtype=dtype)
        assert list(deferred) == list(params)
        for name, d in reversed(deferred.items()):  # any order: a stream per layer
            assert d.shape == params[name].shape and d.dtype == params[name].dtype
            np.testing.assert_array_equal(d.init(), params[name])
    deeper = mlp.init_params(mlp.layer_sizes(6, 9, 3, 4), seed=5)
    shallow = mlp.init_params(sizes, seed=5)
    np.testing.assert_array_equal(deeper["layer1.weight"], shallow["layer1.weight"])
    assert mlp.layer_names(sizes) == ["layer0", "layer1", "layer2"]


def test_layer_functions_handle_a_rank_without_rows() -> None:
    sizes = mlp.layer_sizes(5, 7, 1, 3)
    params = mlp.init_params(sizes, seed=1)
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    h = mlp.layer_forward(params, 0, np.zeros((0, 5), np.float32), last=False)
    logits = mlp.layer_forward(params, 1, h, last=True)
    loss, delta = mlp.loss_grad(logits, np.zeros(0, int), 0.5)
    assert loss == 0.0 and delta.shape == (0, 3)
    back = mlp.layer_backward(params, grads, 1, h, delta, first=False)
    assert back is not None and back.shape == (0, 7)
    assert mlp.layer_backward(params, grads, 0, np.zeros((0, 5), np.float32), back, True) is None
    assert all(not g.any() for g in grads.values())
