"""``scripts/node_measure``, the one-call measurement of a whole node (#27), run here
at W=2 on small sizes: it must leave, in at most 8 files (what the device tool brings
back), the log with the machine's facts and every part's output (the within-node
sum's loop alone among them), one benchmark JSON per world size and the GPT step's
JSON, each with its rows. Serial only (it launches
mpiexec itself); skipped without torch (the GPT step and the bench's peers need it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi_skip
ROOT = Path(__file__).parent.parent


@pytest.mark.timeout(300)
def test_one_call_leaves_every_part_in_few_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_NO_ABORT_HOOK"}
    env.update(ZEROMPI_NODE_SIZES="1e5", ZEROMPI_NODE_GPT="2e5",
               ZEROMPI_NODE_SETUPS="zerompi-2,ddp", ZEROMPI_NODE_LIMIT="120",
               ZEROMPI_NODE_SUM_REGION="100000")  # fmt: skip
    proc = subprocess.run(["bash", "scripts/node_measure", str(out), "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench-w2.json", "gpt-w2.json", "log.txt"], files
    log = (out / "log.txt").read_text()
    for fact in ("commit:", "python:", "mpi:", "kernel:", "MemTotal", "== bench-w2", "== gpt-w2",
                 "== sum-w2", "loop alone, 2 core(s) at once, k= 2 parts of 100,000"):
        assert fact in log, fact
    assert "ended with status" not in log, log[-3000:]
    bench = json.loads((out / "bench-w2.json").read_text())
    assert bench["world_size"] == 2 and [r["stage"] for r in bench["rows"]] == [0, 1, 2, 3]
    assert all(r["step_per_floor"] > 0 and r["step_per_floor_paired"] > 0 for r in bench["rows"])
    gpt = json.loads((out / "gpt-w2.json").read_text())
    assert [(r["setup"], r["status"]) for r in gpt["rows"]] == [("zerompi-2", "ok"), ("ddp", "ok")]
