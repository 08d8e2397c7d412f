"""``examples/`` run as users launch them: ``mpiexec -n 2 python examples/...`` (a
subprocess, serial run only, as ``tests/test_example.py``). The SLURM launch of the
same files is in ``scripts/slurm_ci`` (``ZEROMPI_PROGRAM``). Skipped without torch or
transformers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.mpi_skip
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", [["--stage", "3", "--no-shared-memory"], ["--stage", "2"]],
                         ids=["stage3-gathered", "stage2"])  # fmt: skip
def test_the_transformers_example_trains_and_saves_full_weights(
    mode: list[str], tmp_path: Path
) -> None:
    """The loss falls, and ``from_pretrained`` reads the saved model: every parameter
    whole (not the empty stand-ins of stage 3), the head tied, the values trained
    (not the initial ones)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import torch_hf_model
    finally:
        sys.path.remove(str(EXAMPLES))
    save = tmp_path / "llama"
    cmd = [mpiexec(), "-n", "2", sys.executable, str(EXAMPLES / "torch_hf_model.py"), *mode,
           "--steps", "40", "--save", str(save)]  # fmt: skip
    status, out, _ = run(cmd, timeout=200)
    assert status == 0, out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0], out
    back = transformers.LlamaForCausalLM.from_pretrained(save)
    torch.manual_seed(0)
    initial = dict(torch_hf_model.build("llama", 64, 32).named_parameters())
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    for name, param in back.named_parameters():
        assert param.shape == initial[name].shape, name
    moved = [n for n, p in back.named_parameters() if not torch.equal(p, initial[n])]
    assert len(moved) == len(initial), sorted(set(initial) - set(moved))
