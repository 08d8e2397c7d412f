"""Failure behaviour: an exception on any rank, in any phase, ends the whole job fast.

Each case runs tests/failing_script.py under a subprocess ``mpiexec`` (serial run
only: an mpiexec inside an mpiexec'd test is not portable), with a timeout of its own
that kills the launcher's whole process group, so a regression fails the test instead
of hanging it and leaves no stray ranks behind. The failing rank prints a timestamp
just before it raises; the job must have ended within ``LIMIT`` seconds of it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import pytest
from helpers import DIES_WITH_TEST
from test_harness import mpiexec

from zerompi.mpi import launch as zcomm

pytestmark = pytest.mark.mpi_skip

HERE = Path(__file__).parent
SCRIPT = HERE / "failing_script.py"
LIMIT = 10.0  # seconds from the failure to the end of the job
TIMEOUT = 60.0  # for a run that must end by itself


def run(cmd: list[str], timeout: float = TIMEOUT, **env: str) -> tuple[int, str, float]:
    """Run ``cmd`` in a session of its own; return (status, stdout + stderr, the end
    time). On timeout kill the whole process group and raise ``TimeoutExpired``."""
    environ = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    environ.update(env)
    proc = subprocess.Popen(
        [*DIES_WITH_TEST, *cmd],  # (gone with this process, even by pytest-timeout's exit)
        cwd=HERE.parent,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and every rank
        proc.communicate()
        raise
    return proc.returncode, out, time.time()


@cache
def hydra() -> bool:
    """Whether the launcher is MPICH's hydra, whose ``-l`` tags every output line with
    the rank it came from (then the tests check the output rank by rank)."""
    try:
        proc = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in proc.stdout


def launch(ranks: int, *args: str, mpi4py_runner: bool = False) -> list[str]:
    python = [sys.executable, "-m", "mpi4py"] if mpi4py_runner else [sys.executable]
    tag = ["-l"] if hydra() else []
    return [mpiexec(), *tag, "-n", str(ranks), *python, str(SCRIPT), *args]


_TAG = re.compile(r"^\[(\d+)\] ?")


def by_rank(out: str) -> dict[int, list[str]] | None:
    """The output lines of each rank, from hydra's ``-l`` tags (``None`` without them).
    Hydra tags each chunk it forwards, so a line written in two pieces ends with the
    tag of the next chunk: that is dropped too."""
    if not hydra():
        return None
    ranks: dict[int, list[str]] = {}
    for line in out.splitlines():
        tag = _TAG.match(line)
        if tag:
            text = re.sub(r"\[\d+\] ?$", "", line[tag.end() :])
            ranks.setdefault(int(tag.group(1)), []).append(text)
    return ranks


def untagged(out: str) -> str:
    """``out`` without hydra's rank tags."""
    if not hydra():
        return out
    lines = (re.sub(r"\[\d+\] ?$", "", _TAG.sub("", line)) for line in out.splitlines())
    return "\n".join(lines) + "\n"


TRACEBACK = "Traceback (most recent call last)"


def assert_one_report(out: str, ranks: int, printer: int, failing: list[int]) -> None:
    """Exactly one traceback in ``out``, from rank ``printer``; each rank in ``failing``
    says so in one line (the printer's is followed by its traceback); every other rank
    prints at most one line (MPICH's own note when it is the one that aborts)."""
    text = untagged(out)
    assert text.count(TRACEBACK) == 1, out
    for r in range(ranks):
        assert text.count(f"zerompi: rank {r} of {ranks} failed") == (r in failing), out
    lines = by_rank(out)
    if lines is None:
        return
    for r in range(ranks):
        mine = [line for line in lines.get(r, []) if not line.startswith("FAILING_AT ")]
        if r == printer:
            assert sum(TRACEBACK in line for line in mine) == 1, out
            assert mine[0].startswith(f"zerompi: rank {r} of {ranks} failed"), out
            assert mine[1] == TRACEBACK + ":", out
        else:
            assert not any(TRACEBACK in line for line in mine), out
            assert len(mine) <= 1 + (r in failing), out  # + MPICH's "Abort(1) on node"


def seconds_after_failure(out: str, end: float) -> float:
    out = untagged(out)
    stamps = [float(s) for s in re.findall(r"^FAILING_AT (\S+)$", out, re.MULTILINE)]
    assert stamps, f"the script did not reach its failure:\n{out}"
    return end - min(stamps)


#: phase -> what stderr must say, given the failing rank and the world size
EXPECTED = {
    "model": [
        "zerompi: rank {r} of {w} failed: InjectedFailure: injected failure in "
        "phase 'model' on rank {r}"
    ],
    "collective": [
        "zerompi: rank {r} of {w} failed: InjectedFailure: injected failure in phase 'collective'"
    ],
    "step": ["zerompi: rank {r} of {w} failed: InjectedFailure: injected failure in phase 'step'"],
    # checkpoint errors are agreed on: every rank raises, naming the rank they came from
    "save": [
        "failed: zerompi.mpi.agreement.CollectiveError: [Errno 28] No space left on device "
        "(injected) (on rank {r} of {w})"
    ],
    "load": [
        "failed: zerompi.mpi.agreement.CollectiveError:",
        "Permission denied (injected)",
        "(on rank {r} of {w})",
    ],
    "interrupt": ["zerompi: rank {r} of {w} interrupted (KeyboardInterrupt); aborting"],
    "thread": ["zerompi: rank {r} of {w} failed in thread 'loader': InjectedFailure"],
}


#: phases whose error every rank raises (a collective verdict): rank 0 prints it
EVERY_RANK = ("save", "load")


def check_report(out: str, phase: str, ranks: int, bad: int) -> None:
    """One traceback in all, from the failing rank (from rank 0 for an error raised on
    every rank, the others one line each); no runner frames; no traceback for ^C."""
    text = untagged(out)
    if phase == "interrupt":
        assert "Traceback" not in text, out  # a short message only
    elif phase in EVERY_RANK:
        assert_one_report(out, ranks, printer=0, failing=list(range(ranks)))
        assert text.count("(raised on every rank: traceback from rank 0)") == ranks - 1, out
    else:
        assert_one_report(out, ranks, printer=bad, failing=[bad])
    assert "mpi4py/run.py" not in text and "runpy" not in text, out


#: At 4 ranks, the phases other than these repeat the 2-rank launch with more ranks
#: (same abort path, same report): scripts/test_openmpi runs these two at 4.
_AT_FOUR = ("collective", "step")
FAILURE_CASES = [
    pytest.param(phase, ranks,
                 marks=() if ranks == 2 or phase in _AT_FOUR else pytest.mark.same_launch)
    for phase in EXPECTED for ranks in (2, 4)
]


@pytest.mark.parametrize(("phase", "ranks"), FAILURE_CASES)
def test_failure_on_one_rank_ends_the_job(phase: str, ranks: int) -> None:
    bad = 0 if phase == "collective" else ranks - 1
    code, out, end = run(launch(ranks, phase, str(bad)))
    assert code != 0, out
    for text in EXPECTED[phase]:
        assert text.format(r=bad, w=ranks) in untagged(out), out
    check_report(out, phase, ranks, bad)
    if phase == "interrupt":
        assert code == 130, out
    seconds = seconds_after_failure(out, end)
    assert seconds < LIMIT, f"the job took {seconds:.1f}s to end after the failure\n{out}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_killed_rank_ends_the_job(ranks: int) -> None:
    """SIGKILL leaves zerompi no chance to abort: the launcher must end the others,
    which wait in the reduce-scatter the dead rank never joins. (Under SLURM the same
    is srun's --kill-on-bad-exit, which the slurm/ scripts pass; scripts/slurm_ci
    checks it.)"""
    code, out, end = run(launch(ranks, "kill", str(ranks - 1)))
    assert code != 0, out
    assert "done:" not in out, out
    seconds = seconds_after_failure(out, end)
    assert seconds < LIMIT, f"the job took {seconds:.1f}s to end after the kill\n{out}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_run_without_failure_exits_0(ranks: int, tmp_path: Path) -> None:
    code, out, _ = run(launch(ranks, "none", "0", str(tmp_path / "state.ckpt")))
    assert code == 0, out
    assert f"done: 3 steps on {ranks} ranks" in out, out
    assert "zerompi: rank" not in out, out


@pytest.mark.parametrize("phase", ["model", "step", "load", "thread"])
def test_mpi4py_runner_still_aborts(phase: str) -> None:
    """``python -m mpi4py script.py`` aborts on its own; the hook must not get in its way,
    nor print the traceback twice or with the runner's frames."""
    code, out, end = run(launch(2, phase, "1", mpi4py_runner=True))
    assert code != 0, out
    assert "zerompi: rank 1 of 2 failed" in untagged(out), out
    check_report(out, phase, 2, 1)
    assert seconds_after_failure(out, end) < LIMIT, out


def test_opt_out_leaves_the_others_waiting() -> None:
    """With ZEROMPI_NO_ABORT_HOOK=1 rank 1 dies alone and zerompi does not end the
    job: rank 0 waits in its reduction. Under MPICH's hydra only the timeout ends the
    run; Open MPI's launcher may end the job itself once the dead rank's MPI_Finalize
    returns (whether it returns while rank 0 waits varies run to run), never with
    zerompi's abort."""
    try:
        code, out, _ = run(launch(2, "collective", "1"), timeout=8, ZEROMPI_NO_ABORT_HOOK="1")
    except subprocess.TimeoutExpired as info:
        out = info.output or ""
        out = out if isinstance(out, str) else out.decode(errors="replace")
    else:
        assert not hydra() and code != 0, f"the job ended (exit {code}):\n{out}"
    assert "zerompi: rank" not in out and "InjectedFailure" in out, out


EARLY = """
import sys, time
import zerompi
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1:
    print(f"FAILING_AT {time.time():.6f}", file=sys.stderr, flush=True)
    raise RuntimeError("failed before any optimizer")
MPI.COMM_WORLD.barrier()
"""


def test_failure_before_any_optimizer_ends_the_job() -> None:
    """``import zerompi`` alone installs the hook: rank 1 failing while rank 0 waits in
    a barrier ends the job (before, rank 0 waited forever)."""
    code, out, end = run([mpiexec(), "-n", "2", sys.executable, "-c", EARLY], timeout=30)
    assert code != 0, out
    assert "zerompi: rank 1 of 2 failed: RuntimeError: failed before any optimizer" in out, out
    assert out.count(TRACEBACK) == 1, out
    assert seconds_after_failure(out, end) < LIMIT, out


AFTER_GLOO = """
from mpi4py import MPI
from zerompi.torch.gloo import init_gloo
init_gloo(MPI.COMM_WORLD)  # torch wraps sys.excepthook here, pointing stderr at a StringIO
if MPI.COMM_WORLD.rank == 1:
    raise RuntimeError("failed after torch.distributed started")
MPI.COMM_WORLD.barrier()
"""


def test_the_report_survives_torch_distributed_excepthook() -> None:
    """torch's ``init_process_group`` wraps the excepthook in one that captures stderr
    and prints it after the hook returns, which never happens when it aborts: the
    report must go to the process's own stderr (it was lost before)."""
    pytest.importorskip("torch")
    code, out, _ = run([mpiexec(), "-n", "2", sys.executable, "-c", AFTER_GLOO], timeout=60)
    assert code != 0, out
    assert "RuntimeError: failed after torch.distributed started" in out, out
    assert out.count(TRACEBACK) == 1, out


def test_import_does_not_initialise_mpi() -> None:
    code, out, _ = run(
        [sys.executable, "-c", "import zerompi, sys; assert 'mpi4py.MPI' not in sys.modules"]
    )
    assert code == 0, out


def test_one_process_keeps_the_normal_traceback() -> None:
    """Without mpiexec (a world of one) the hook defers to the default excepthook."""
    code, out, _ = run([sys.executable, str(SCRIPT), "model", "0"])
    assert code == 1, out
    assert "InjectedFailure: injected failure in phase 'model' on rank 0" in out, out
    assert "zerompi: rank" not in out and "MPI_Abort" not in out, out


# -- the hook itself, in this (one-process) interpreter ------------------------------


@pytest.fixture
def no_hook():
    """Start without the hook (ZeroOptimizer may have installed it) and restore after."""
    was_installed = zcomm._previous_hooks is not None
    zcomm.uninstall_abort_hook()
    before = (sys.excepthook, threading.excepthook)
    yield before
    zcomm.uninstall_abort_hook()
    assert (sys.excepthook, threading.excepthook) == before
    if was_installed:
        zcomm.install_abort_hook()


def test_install_is_idempotent_and_uninstall_restores(no_hook) -> None:
    assert zcomm.install_abort_hook() is True
    hooks = (sys.excepthook, threading.excepthook)
    assert hooks != no_hook
    assert zcomm.install_abort_hook() is True  # a second call changes nothing
    assert (sys.excepthook, threading.excepthook) == hooks
    zcomm.uninstall_abort_hook()
    assert (sys.excepthook, threading.excepthook) == no_hook
    zcomm.uninstall_abort_hook()  # harmless when not installed


def test_environment_variable_opts_out(no_hook, monkeypatch) -> None:
    monkeypatch.setenv("ZEROMPI_NO_ABORT_HOOK", "1")
    assert zcomm.install_abort_hook() is False
    assert (sys.excepthook, threading.excepthook) == no_hook


def test_one_process_defers_to_the_previous_hooks(no_hook, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(("sys", a[0])))
    monkeypatch.setattr(threading, "excepthook", lambda a: seen.append(("thread", a.exc_type)))
    zcomm.install_abort_hook()
    try:
        raise ValueError("boom")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    worker = threading.Thread(target=lambda: 1 / 0)
    worker.start()
    worker.join()
    zcomm.uninstall_abort_hook()
    assert seen == [("sys", ValueError), ("thread", ZeroDivisionError)]
