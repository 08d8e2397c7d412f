"""``python -m zerompi.bench --model gpt`` end to end at a tiny size, and its launcher's
bookkeeping.

The command launches ``mpiexec -n 2`` once per setup itself, so it runs as a plain
subprocess here, in the serial run only (``mpi_skip``: an mpiexec inside an
mpiexec'd test is not portable). Only the JSON's shape is checked, never a timing:
every setup is a row that either ran (positive step time and peak RSS) or says why
it is unsupported; a failed setup fails the test with the worker's reason. The
setups train the same model on the same batches, so their last losses agree.
Skipped without torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import marked_processes

pytest.importorskip("torch")
from zerompi.bench.gpt import (
    DEEPSPEED_SETUPS,
    FAILED,
    SETUPS,
    _reason,
    add_ratios,
    gpt_config,
    table,
)
from zerompi.torch.gpt import parameter_count

pytestmark = pytest.mark.mpi_skip
ROOT = Path(__file__).parent.parent
OURS_AND_TORCH = [s for s in SETUPS if s not in DEEPSPEED_SETUPS]
DEEPSPEED = list(DEEPSPEED_SETUPS)


def test_tiny_run_has_a_row_per_setup(tmp_path: Path) -> None:
    out = tmp_path / "made" / "gpt.json"  # the folder is made
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--sizes", "2e5"]
    cmd += ["--steps", "2", "--warmup", "1", "--timeout", "60", "--json", str(out)]
    cmd += ["--setups", ",".join(OURS_AND_TORCH)]  # (DeepSpeed's: the tests below)
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    results = json.loads(out.read_text())
    assert results["ranks"] == 2 and results["steps"] == 2
    rows = results["rows"]
    assert [r["setup"] for r in rows] == OURS_AND_TORCH, text
    for row in rows:
        assert row["status"] in ("ok", "unsupported"), f"{row['setup']}: {row['reason']}"
        if row["status"] == "unsupported":
            assert row["reason"], row
            continue
        assert row["step_ms"] > 0 and row["rss_mib"] > 0 and row["rss_end_mib"] > 0, row
        assert 0 < row["forward_backward_ms"] <= row["step_ms"], row  # (medians of parts)
        assert row["pss_end_mib"] > 0, row
        assert len(row["step_ms_per_rank"]) == len(row["rss_mib_per_rank"]) == 2
        assert row["params"] == parameter_count(*(row["config"][k] for k in
                                                  ("vocab", "seq", "dim", "layers")))  # fmt: skip
        assert row["vs_best_torch"] > 0
    # The same training everywhere: after the same steps, the same loss (to rounding).
    losses = {r["setup"]: r["last_loss"] for r in rows if r["status"] == "ok"}
    assert max(losses.values()) - min(losses.values()) <= 1e-4 * max(losses.values()), losses
    assert "| params | setup | step ms |" in proc.stdout


@pytest.mark.timeout(960)  # (the command's own limit, 900 s, ends it first)
def test_deepspeed_zero_trains_as_ddp_does(tmp_path: Path) -> None:
    """DeepSpeed's ZeRO stages 1-3 (torch's fused AdamW as the client optimizer) and
    stage 2 with ``DeepSpeedCPUAdam``, on its CPU accelerator over gloo, are peer rows
    of the same bench: every one runs and ends at DDP's loss (DeepSpeed clips at 1.0
    by default; the bench turns it off, as no other setup clips).
    Where DeepSpeed is installed (``DS_BUILD_OPS=0 pip install --no-build-isolation
    deepspeed``; its first run compiles its ops: up to minutes)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--sizes", "2e5",
           "--setups", ",".join(["ddp", *DEEPSPEED]), "--steps", "3", "--warmup", "1",
           "--timeout", "300", "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["setup"] for r in rows] == ["ddp", *DEEPSPEED]
    for row in rows:
        assert row["status"] == "ok", f"{row['setup']}: {row['reason']}"
        assert row["loss_vs_ddp"] <= 1e-5, (row["setup"], row["loss_vs_ddp"])
        assert row["vs_best_peer"] > 0 and row["step_ms"] > 0
    assert "DeepSpeedCPUAdam" in rows[-1]["what"] and "ZeRO stage 3" in rows[-2]["what"]


def test_a_peer_not_installed_is_a_skipped_row(tmp_path: Path) -> None:
    """Without DeepSpeed (hidden here by a package that will not import) its setups
    are rows saying how to install it, the others run on."""
    hide = tmp_path / "hide" / "deepspeed"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "ds.json"
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--sizes", "2e5",
           "--setups", "deepspeed-2,ddp", "--steps", "1", "--warmup", "0",
           "--timeout", "60", "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    env["PYTHONPATH"] = os.pathsep.join([str(hide.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ds, ddp = json.loads(out.read_text())["rows"]
    assert ds["status"] == "skipped" and "pip install" in ds["reason"], ds
    assert "hidden by the test" in ds["reason"] and ddp["status"] == "ok"
    row = ("| deepspeed-2 | - | - | - | - | - | - | skipped: round 1 of 1: deepspeed is not "
           "installed")  # fmt: skip
    assert row in proc.stdout, proc.stdout


@pytest.mark.timeout(260)  # (the command's own limit, 200 s, ends it first)
def test_a_transformers_llama_runs_in_the_same_bench(tmp_path: Path) -> None:
    """``--arch llama``: a model zerompi did not write, under stage 3 without shared
    memory (module gathers, prefetch), DDP and FSDP2 (its decoder layers sharded):
    every row runs and ends at the same loss."""
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--arch", "llama",
           "--sizes", "2e5", "--setups", "zerompi-3s,ddp,fsdp2", "--steps", "2",
           "--warmup", "1", "--timeout", "90", "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert results["arch"] == "llama" and [r["arch"] for r in rows] == ["llama"] * 3
    assert all(r["status"] == "ok" for r in rows), rows
    losses = [r["last_loss"] for r in rows]
    assert max(losses) - min(losses) <= 1e-4 * max(losses), losses
    assert "(llama)" in proc.stdout


def test_refused_under_mpiexec() -> None:
    """It launches mpiexec itself: a launcher's variables mean it was launched (Open
    MPI's here: MPICH, which the test runs with, ignores them)."""
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--sizes", "2e5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMPI_COMM_WORLD_SIZE="2"),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "without mpiexec" in proc.stderr


def test_sizes_are_close_to_the_target() -> None:
    for size in (200_000, 16_000_000, 64_000_000):
        cfg = gpt_config(size, 64)
        got = parameter_count(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["layers"])
        assert abs(got - size) <= cfg["dim"], (size, cfg, got)


def test_a_failed_setup_is_a_row_with_its_reason() -> None:
    """The worker's own line wins over the tail; ratios skip failed rows and are
    relative to the fastest torch setup of the same size."""
    out = f"noise\n[1] {FAILED} 1: RuntimeError: gloo broke\nTraceback ...\n"
    assert _reason(out, 1) == f"{FAILED} 1: RuntimeError: gloo broke"
    assert _reason("a\nb\n", 137) == "exit status 137: a | b"
    rows = [
        {"setup": "zerompi-2", "size": 5, "params": 5, "status": "ok", "step_ms": 5.0,
         "forward_backward_ms": 4.0, "rss_mib": 1.0, "pss_end_mib": 0.5, "last_loss": 2.0},
        {"setup": "ddp", "size": 5, "params": 5, "status": "ok", "step_ms": 10.0, "rss_mib": 1.0,
         "forward_backward_ms": 4.0, "pss_end_mib": 0.5, "last_loss": 2.0},
        {"setup": "fsdp2", "size": 5, "status": "failed", "reason": "timed out after 60 s"},
        {"setup": "zerompi-3", "size": 5, "status": "unsupported", "reason": "stage 3"},
        {"setup": "deepspeed-2", "size": 5, "params": 5, "status": "ok", "step_ms": 8.0,
         "forward_backward_ms": 4.0, "rss_mib": 1.0, "pss_end_mib": 0.5, "last_loss": 2.1},
        {"setup": "deepspeed-3", "size": 5, "status": "skipped", "reason": "not installed"},
    ]  # fmt: skip
    add_ratios(rows)
    assert [r["vs_best_torch"] for r in rows] == [0.5, 1.0, None, None, 0.8, None]
    assert [r["vs_best_peer"] for r in rows] == [0.625, 1.25, None, None, 1.0, None]
    text = table(rows)
    assert "| 5 | fsdp2 | - | - | - | - | - | - | failed: timed out after 60 s |" in text
    assert "| 5 | zerompi-2 | 5 | 4 | 0.50 | 0.62 | 1 | 0 | ok |" in text
    # a peer whose training went elsewhere says so (DeepSpeed's default clipping did)
    assert ("| 5 | deepspeed-2 | 8 | 4 | 0.80 | 1.00 | 1 | 0 | ok, but its last loss is 5.0e-02"
            in text)  # fmt: skip
    assert "| 5 | deepspeed-3 | - | - | - | - | - | - | skipped: not installed |" in text


def test_rounds_merge_to_the_median_run() -> None:
    """``--rounds``: a setup's row is its median run (the lower middle of an even
    count), every run's time kept, the largest peak RSS; a failed round is the row."""
    from zerompi.bench.gpt import merge_rounds

    runs = [{"status": "ok", "step_ms": t, "rss_mib": m, "last_loss": t}
            for t, m in ((30.0, 5.0), (10.0, 7.0), (20.0, 6.0))]  # fmt: skip
    row = merge_rounds(runs)
    assert row["step_ms"] == 20.0 and row["last_loss"] == 20.0
    assert row["rounds_step_ms"] == [30.0, 10.0, 20.0] and row["rss_mib"] == 7.0
    assert merge_rounds(runs[:2])["step_ms"] == 10.0
    failed = merge_rounds([runs[0], {"status": "failed", "reason": "timed out"}])
    assert failed["status"] == "failed" and failed["reason"] == "round 2 of 2: timed out"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_launcher_leaves_no_setup_running(signum: int) -> None:
    """The launcher stopped while a setup trains (SIGTERM, as ``timeout`` sends it to
    the command alone; SIGINT, as Ctrl-C does; SIGHUP, as a closed terminal does) ends
    its setup's mpiexec and ranks before it ends (``zerompi.children``), and ends by
    that signal. Before, the setup (in a session of its own) trained on: two ranks of
    zero-redundancy spun for 11 minutes after their launcher was killed. Every process
    the launcher started carries a mark in its environment; none may be left."""
    mark = f"zerompi-orphan-test-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    env["ZEROMPI_ORPHAN_MARK"] = mark
    cmd = [sys.executable, "-m", "zerompi.bench", "--model", "gpt", "--sizes", "2e5",
           "--setups", "zero-redundancy", "--steps", "1000000", "--timeout", "300"]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while len([p for p, c in marked_processes(mark)
                   if c.startswith(f"{sys.executable} -m zerompi.bench.gpt")]) < 2:  # fmt: skip
            assert launcher.poll() is None, launcher.communicate()[0].decode()[-2000:]
            assert time.monotonic() < deadline, "the setup's two ranks never started"
            time.sleep(0.1)
        time.sleep(1.0)  # (training)
        launcher.send_signal(signum)  # the launcher alone, not its setup's group
        out = launcher.communicate(timeout=60)[0].decode(errors="replace")
        assert launcher.returncode == -signum, (launcher.returncode, out[-2000:])
        left = marked_processes(mark)
        assert not left, f"still running after the launcher ended: {left}"
    finally:
        for pid, _ in marked_processes(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
