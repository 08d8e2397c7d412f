"""Launchers stop with what they launched (``zerompi.children``, ``scripts/_env.sh``'s
``zerompi_wait``): a script or launcher stopped by SIGTERM (``timeout``), SIGINT
(Ctrl-C) or SIGHUP leaves none of its commands running, though they run in process
groups of their own (``timeout``'s, mpiexec's session), and ends by that signal.

Each test marks the environment of everything it starts and looks for the mark in
``/proc`` afterwards (Linux). The GPT benchmark's launcher, the same for its setups'
mpiexec and ranks: ``tests/test_bench_gpt.py``. Serial only (``mpi_skip``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import marked_processes as marked

from zerompi.children import descendants, process_group

pytestmark = [
    pytest.mark.mpi_skip,
    pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc"),
]
ROOT = Path(__file__).parent.parent
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


@contextlib.contextmanager
def cleaned(mark: str):  # type: ignore[no-untyped-def]
    """Whatever the test leaves carrying ``mark`` is killed (a failing test included)."""
    try:
        yield
    finally:
        for pid, _ in marked(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def sleepers(mark: str) -> list[int]:
    """The marked sleepers (not a shell whose script names them)."""
    return [p for p, c in marked(mark) if c.startswith(" ".join(SLEEPER))]


def wait_for(mark: str, count: int, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + 60
    while len(sleepers(mark)) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {count} sleeper(s) started"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_script_leaves_nothing_running(signum: int) -> None:
    """A script of ``scripts/`` running a command under ``timeout`` with ``zerompi_tee``
    (``zerompi_wait``; ``timeout`` puts it in a process group of its own, as
    ``scripts/test`` runs mpiexec), sent
    a signal alone: the command ends before the script, which ends by the signal.
    Without ``zerompi_wait`` the command outlives the script (checked too)."""
    mark = f"zerompi-children-test-{uuid.uuid4().hex}"
    env = dict(os.environ, ZEROMPI_CHILDREN_MARK=mark, PYTHON=sys.executable)
    command = " ".join(SLEEPER[:2]) + ' "import time; time.sleep(300)"'
    for waited in (True, False):
        run = (f"zerompi_tee /dev/null timeout 300 {command}\n" if waited  # (as scripts/test)
               else f'( timeout 300 {command} 2>&1 | cat; exit "${{PIPESTATUS[0]}}" ) &\nwait $!\n')
        script = ". scripts/_env.sh\n" + run + "echo reached the end\n"
        with cleaned(mark):
            proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            wait_for(mark, 1, proc)
            proc.send_signal(signum)  # the script alone, as timeout does
            if not waited:  # (bash runs no trap until its foreground child is done)
                time.sleep(1.0)
                assert sleepers(mark), "the control failed: the command ended with the script"
                continue
            out = proc.communicate(timeout=30)[0]
            assert proc.returncode == -signum, (proc.returncode, out)
            assert "reached the end" not in out
            assert not marked(mark), marked(mark)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_process_group_is_ended_when_its_block_is_left() -> None:
    """``process_group``: a command still running when the block is left (here by an
    exception) is ended with every process of its group, and the handlers it put in
    place for the forwarded signals are gone again."""
    mark = f"zerompi-children-test-{uuid.uuid4().hex}"
    env = dict(os.environ, ZEROMPI_CHILDREN_MARK=mark)
    before = signal.getsignal(signal.SIGTERM)
    with cleaned(mark):
        with pytest.raises(RuntimeError), process_group(
            ["bash", "-c", f"{' '.join(SLEEPER[:2])} 'import time; time.sleep(300)' & wait"],
            env=env,
        ) as proc:  # fmt: skip
            wait_for(mark, 1, proc)
            assert signal.getsignal(signal.SIGTERM) is not before  # forwarding
            assert len(descendants(proc.pid)) == 1
            raise RuntimeError("leave the block")
        assert proc.returncode is not None and not marked(mark)
        assert signal.getsignal(signal.SIGTERM) is before
