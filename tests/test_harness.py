"""The harness itself: one rank failing must end an mpiexec run fast, never hang it.

Runs tests/selfcheck_harness.py under a subprocess ``mpiexec`` (so only in the serial
run: an mpiexec inside an mpiexec'd test is not portable) and bounds each run with a
timeout of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def mpiexec() -> str:
    """The launcher that goes with this Python's mpi4py (as scripts/_env.sh picks it)."""
    beside = Path(sysconfig.get_path("scripts")) / "mpiexec"
    found = os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else None)
    found = found or shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec")
    return found


def run_selfcheck(mode: str, ranks: int, *extra: str) -> tuple[int, str, float]:
    env = dict(os.environ, ZEROMPI_SELFCHECK=mode)
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    cmd += ["--with-mpi", "-q", *extra, str(HERE / "selfcheck_harness.py")]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


pytestmark = pytest.mark.mpi_skip


@pytest.mark.parametrize("ranks", [2, 4])
def test_failure_on_one_rank_aborts_the_world(ranks: int) -> None:
    code, out, seconds = run_selfcheck("local_fail", ranks)
    assert code != 0, out
    assert "rank 1 fails alone" in out and "aborting the world" in out, out
    assert seconds < 60, f"took {seconds:.1f}s"


def test_collective_failure_fails_every_rank_and_continues() -> None:
    code, out, _ = run_selfcheck("collective_fail", 2)
    assert code == 1, out
    assert "failed on 1 of 2 rank(s)" in out and "rank 1: rank 1 fails" in out, out
    assert out.count("1 failed, 1 passed") == 2, out  # both ranks ran the second test
    assert "aborting the world" not in out, out


def test_a_hung_collective_is_ended_by_the_timeout() -> None:
    code, out, seconds = run_selfcheck("hang", 2, "-o", "timeout=5")
    assert code != 0, out
    assert "Timeout" in out, out
    assert seconds < 60, f"took {seconds:.1f}s"


def test_passing_run_passes() -> None:
    code, out, _ = run_selfcheck("", 3)
    assert code == 0, out
