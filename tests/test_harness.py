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
from helpers import DIES_WITH_TEST

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
    cmd = [*DIES_WITH_TEST, mpiexec(), "-n", str(ranks), sys.executable, "-m", "pytest",
           "-p", "no:cacheprovider"]  # fmt: skip
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
    # one report, from rank 0; rank 1 (which also ran the second test) says it agrees
    assert out.count("1 failed, 1 passed") == 1, out
    assert "[rank 1 of 2] 1 collective failure(s), the same as rank 0 reports" in out, out
    # once in the report (pytest's short summary may repeat it: in full under CI=true)
    report = out.split("short test summary info")[0]
    assert report.count("CollectiveAssertionError: failed on 1 of 2 rank(s)") == 1, out
    assert "aborting the world" not in out, out


def test_a_rank_failing_alone_shows_only_the_test_frames() -> None:
    """The aborting rank prints pytest's report of its failure, not pytest's internals."""
    code, out, _ = run_selfcheck("local_fail", 2)
    assert code != 0, out
    assert "[rank 1] tests/selfcheck_harness.py::test_first failed (call) on this rank only" in out
    assert "AssertionError: rank 1 fails alone" in out, out
    assert "pluggy" not in out and "_pytest" not in out, out


def test_a_hung_collective_is_ended_by_the_timeout() -> None:
    code, out, seconds = run_selfcheck("hang", 2, "-o", "timeout=5")
    assert code != 0, out
    assert "Timeout" in out, out
    assert seconds < 60, f"took {seconds:.1f}s"


def test_passing_run_passes() -> None:
    code, out, _ = run_selfcheck("", 3)
    assert code == 0, out


def test_one_progress_stream_and_one_summary() -> None:
    """Under mpiexec only rank 0 reports: one progress line, one summary, no
    other rank's output when nothing failed."""
    code, out, _ = run_selfcheck("", 3, "-vv")  # -q -vv: verbose
    assert code == 0, out
    assert out.count("2 passed") == 1, out
    assert out.count("selfcheck_harness.py::test_first PASSED") == 1, out
    assert "mpi: rank 0 of 3 reports" in out, out
    assert "[rank " not in out, out
