"""A Hugging Face ``transformers`` model through zerompi's safetensors in and out
(``tests/hf_script.py`` under a subprocess ``mpiexec -n 2``; serial run only, as in
``tests/test_failures.py``): ``save_pretrained``'s files load into the sharded model
bit for bit, and a zerompi checkpoint exported with ``--safetensors`` is read by
``from_pretrained`` bit for bit, the tied head tied again. Skipped without torch or
transformers (CI installs both)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

SCRIPT = Path(__file__).resolve().parent / "hf_script.py"


#: (stage, shared_memory) of the launch: every stage with node memory, stage 3 without.
CASES = [(1, True), (2, True), (3, True), (3, False)]


@pytest.mark.mpi_skip
@pytest.mark.timeout(300)  # the subprocess has its own limit, 240 s (importing transformers)
def test_a_transformers_model_in_and_out_through_safetensors(tmp_path: Path) -> None:
    """One launch for every case (importing transformers on every rank is most of a
    launch's time): each loads bit for bit, trains, and exports bit for bit."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    specs = [f"{stage}:{int(shared)}" for stage, shared in CASES]
    status, out, _ = run([mpiexec(), "-n", "2", sys.executable, str(SCRIPT), str(tmp_path),
                          *specs], timeout=240)  # fmt: skip
    found = [json.loads(f) for f in re.findall(r"RESULT (\{.*\})", out)]  # (a progress bar
    # may share its line)
    assert status == 0 and [(r["stage"], r["shared"]) for r in found] == CASES, out
    for result in found:
        assert result["loaded_diff"] == 0.0, result
        assert result["exported_diff"] == 0.0, result
        assert result["names_match"] and result["tied"], result
        assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0], result
