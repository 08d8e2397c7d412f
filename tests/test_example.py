"""The example of docs/usage.md ("The numpy API") is ``scripts/example.py``, and it trains.

Serial run only (a subprocess ``mpiexec``, as in ``tests/test_failures.py``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scripts" / "example.py"
USAGE = ROOT / "docs" / "usage.md"


def test_the_docs_show_the_example() -> None:
    """The first python block of docs/usage.md is the example from its imports on."""
    block = re.search(r"^```python\n(.*?)^```[ \t]*$", USAGE.read_text(), re.M | re.S)
    code = EXAMPLE.read_text()
    assert block is not None
    assert block.group(1) == code[code.index("import numpy as np") :]


@pytest.mark.mpi_skip
@pytest.mark.timeout(180)  # (the job's own limit, 120 s, ends it first and says so)
def test_the_example_runs_and_its_loss_falls() -> None:
    status, out, _ = run([mpiexec(), "-n", "2", sys.executable, str(EXAMPLE)], timeout=120)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert status == 0, out
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], out
