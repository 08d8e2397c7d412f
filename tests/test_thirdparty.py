"""Models someone else wrote (Hugging Face ``transformers`` GPT-2, Llama, BERT, built
from small configs with random weights, and nanoGPT's GPT from the package index's
``nano-gpt`` where installed, all unmodified) through ``zerompi.torch.shard``
at stages 0, 1, 2, 3 and 3 without the node copy, against torch DDP in the same
processes (``tests/thirdparty_parity.py`` under a subprocess ``mpiexec``; serial run
only, as ``tests/test_hf.py``). Skipped without torch or transformers (CI installs
both).

What is required, from the table the script prints:

* float32: every final parameter within 1e-5 of DDP's relative to its largest
  magnitude at 2 ranks, where both sides add two ranks' gradients in the same order;
  at 3 ranks gloo's ring adds them in another order than MPI, and Adam turns that
  last bit into up to ~1.5e-5 on biases that start at zero, so 3e-5 there. Attention
  *key* biases are left out (their exact gradient is zero: rounding noise, which Adam
  scales to full steps; the script's docstring says more). Every micro-batch's loss
  within 1e-6 of DDP's.
* ``param_dtype=bfloat16``: every stage bit-identical to stage 0 (parameters and
  losses), and the losses within 2 % of DDP's float32 ones.
* ``generate()`` (greedy) gives DDP's tokens, at every stage and dtype.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

SCRIPT = Path(__file__).resolve().parent / "thirdparty_parity.py"


def has_nanogpt() -> bool:
    """Whether the package index's ``nano-gpt`` is installed (CI installs it)."""
    return importlib.util.find_spec("nano_gpt") is not None
#: world size -> float32 parameter tolerance (see the module docstring)
PARAMS = {2: 1e-5, 3: 3e-5}
#: world size -> steps: at 3 ranks (more than this 2-core CI machine's cores, every
#: rank's torch slower) the uneven layout in half the steps of 2 ranks' run
STEPS = {2: 10, 3: 5}


@pytest.mark.mpi_skip
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", sorted(PARAMS))
def test_third_party_models_match_ddp_at_every_stage(world: int) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    status, out, _ = run([mpiexec(), "-n", str(world), sys.executable, str(SCRIPT),
                          "--steps", str(STEPS[world])], timeout=240)  # fmt: skip
    found = re.findall(r"RESULT (\{.*\})", out)
    assert status == 0 and len(found) == 1, out
    rows = json.loads(found[0])["rows"]
    models = ("gpt2", "llama", "bert") + (("nanogpt",) if has_nanogpt() else ())
    assert {(r["model"], r["stage"], r["dtype"]) for r in rows} == {
        (m, s, d) for m in models for s in ("0", "1", "2", "3", "3 own")
        for d in ("float32", "bfloat16")}, rows  # fmt: skip
    table = "\n".join(line for line in out.splitlines() if line.startswith("|"))
    for r in rows:
        where = f"{r['model']} stage {r['stage']} {r['dtype']}\n{table}"
        assert r["generate"], where
        if r["dtype"] == "float32":
            assert r["params"] <= PARAMS[world], where
            assert r["loss"] <= 1e-6, where
        else:
            assert r["params_vs_stage0"] == 0.0 and r["vs_stage0"] == 0.0, where
            assert r["loss"] <= 2e-2, where
