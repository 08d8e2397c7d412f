"""Checkpoints through the driver: resume is bit-identical, any world size resumes, and
a rank killed with SIGKILL in the middle of a save loses nothing already saved.

Subprocess mpiexec runs, so serial only (``mpi_skip``), each bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_harness import mpiexec

from zerompi import checkpoint

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.mpi_skip


def driver(ranks: int, *args: str, timeout: float = 180) -> str:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.driver",
           "--blas-threads", "1", "--log-every", "1000", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def complete_checkpoints(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("ck.*") if re.fullmatch(r"ck\.\d{8}", p.name))


def ranks_of(tag: str) -> list[int]:
    """PIDs of the driver processes whose command line carries ``--seed tag``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"zerompi.driver" in argv and tag.encode() in argv and entry.name.isdigit():
            pids.append(int(entry.name))
    return pids


def same_state(a: str | Path, b: str | Path) -> bool:
    x, y = checkpoint.read(str(a)), checkpoint.read(str(b))
    return x["optimizer"]["step"] == y["optimizer"]["step"] and all(
        np.array_equal(x[k][n], y[k][n]) for k in ("params", "exp_avg", "exp_avg_sq")
        for n in x["params"]
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_is_bit_identical_and_keeps_the_newest(stage: int, tmp_path: Path) -> None:
    common = ["--stage", str(stage), "--steps", "12"]
    driver(3, *common, "--save", str(tmp_path / "full"))
    driver(3, "--stage", str(stage), "--steps", "7", "--save", str(tmp_path / "part"),
           "--save-every", "2", "--keep", "2")
    assert sorted(p.name for p in tmp_path.glob("part.*")) == ["part.00000006", "part.00000007"]
    out = driver(3, *common, "--resume", str(tmp_path / "part"), "--save", str(tmp_path / "part"),
                 "--json", str(tmp_path / "resumed.json"))
    assert "resumed from" in out and "part.00000007 at step 7" in out
    # The summary counts the 5 steps this run made, not the 12 reached.
    assert "over 5 steps (steps 8-12, resumed at step 7;" in out, out
    result = json.loads((tmp_path / "resumed.json").read_text())
    assert (result["steps_run"], result["first_step"], result["steps"]) == (5, 7, 12)
    assert len(result["losses"]) == len(result["grad_norms"]) == 5
    assert same_state(tmp_path / "full.00000012", tmp_path / "part.00000012")


def test_resume_at_other_world_sizes_and_stages(tmp_path: Path) -> None:
    driver(3, "--stage", "2", "--steps", "5", "--save", str(tmp_path / "a"))
    for ranks, stage in ((2, 3), (4, 0)):
        out = driver(ranks, "--stage", str(stage), "--steps", "8", "--verify",
                     "--resume", str(tmp_path / "a.00000005"))
        assert "verify OK" in out, out  # the resumed run still matches the reference
        assert f"over {8 - 5} steps (steps 6-8, resumed at step 5;" in out, out


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    prefix = tmp_path / "ck"
    tag = f"{os.getpid()}{time.monotonic_ns() % 100000}"  # identifies our processes
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.driver", "--blas-threads",
           "1", "--hidden", "1024", "--depth", "4", "--in-dim", "1024", "--steps", "200",
           "--save", str(prefix), "--save-every", "1", "--keep", "2", "--log-every", "1000",
           "--seed", tag]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and killed is None:
            complete = complete_checkpoints(tmp_path)
            temps = list(tmp_path.glob("ck.*.tmp-*"))
            if complete and temps:  # a save is being written right now: kill one rank
                pids = [p for p in ranks_of(tag) if p != proc.pid]
                if pids:
                    os.kill(max(pids), signal.SIGKILL)
                    killed = [p.name for p in temps]
            time.sleep(0.005)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, "never caught a save in progress"
    assert code != 0  # the job ended (no hang) and says it failed
    complete = complete_checkpoints(tmp_path)
    assert complete, "the checkpoints saved before the kill are gone"
    for path in complete:
        assert checkpoint.verify(str(path)) == [], path  # every complete file is intact
    # The newest complete checkpoint resumes, at another world size.
    out = driver(3, "--hidden", "1024", "--depth", "4", "--in-dim", "1024", "--seed", tag,
                 "--steps", str(checkpoint.read(str(complete[-1]))["optimizer"]["step"] + 1),
                 "--resume", str(prefix))
    assert f"resumed from {complete[-1]}" in out
