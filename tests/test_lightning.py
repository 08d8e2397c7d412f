"""PyTorch Lightning through ``zerompi.lightning`` (``tests/lightning_script.py`` and
``examples/lightning_train.py`` under a subprocess ``mpiexec``; serial run only, as
in ``tests/test_hf.py``): a Lightning fit equals the same training by hand through
``zerompi.torch.shard()`` at stages 2 and 3, ``sync_dist`` logs the mean over ranks,
a checkpoint saved on 2 ranks at stage 2 resumes on 1 rank at stage 3 to the
uninterrupted run's parameters, and the example runs. Skipped without torch or
Lightning (CI installs both)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_failures import run
from test_harness import mpiexec

pytestmark = pytest.mark.mpi_skip
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "lightning_script.py"
EXAMPLE = HERE.parent / "examples" / "lightning_train.py"
#: Largest difference of any parameter, relative to its largest magnitude, allowed
#: between two runs that should be the same training.
TOLERANCE = 1e-5


def _script(ranks: int, *args: str) -> dict[str, Any]:
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    status, out, _ = run([mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), *args],
                         timeout=150)  # fmt: skip
    found = re.findall(r"RESULT (\{.*\})", out)
    assert status == 0 and len(found) == 1, out[-6000:]
    return json.loads(found[0])


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``mpiexec -n 2`` of the script's ``main`` (its checkpoints stay in the
    directory for :func:`test_a_stage_2_checkpoint_resumes_on_one_rank_at_stage_3`)."""
    out = tmp_path_factory.mktemp("lightning")
    return out, _script(2, "main", str(out))


@pytest.mark.timeout(200)
def test_a_lightning_fit_equals_the_same_training_through_shard(
    main_run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = main_run
    assert result["stage2"] <= TOLERANCE, result  # strategy="zerompi": stage 2
    assert result["stage3"] <= TOLERANCE, result  # ZeroMPIStrategy(stage=3), no node copy
    # ... and the comparison can fail: without the Trainer's clipping, or without
    # Lightning's 1/accumulate_grad_batches loss scaling, the same loop ends elsewhere.
    assert result["clip_matters"] > 100 * TOLERANCE, result
    assert result["scale_matters"] > 100 * TOLERANCE, result
    assert result["lrs"] == [1e-2 * 0.5**4, 5e-3 * 0.5**4], result  # StepLR(2, 0.5), 8 steps
    assert result["stage3_empty_outside"], result


@pytest.mark.timeout(200)
def test_sync_dist_logs_the_mean_over_ranks(main_run: tuple[Path, dict[str, Any]]) -> None:
    _, result = main_run
    # Each rank logs rank + 1: synced, both ranks see the mean (the max with
    # reduce_fx="max"); not synced, each its own.
    assert [m["probe"] for m in result["metrics"]] == [1.5, 1.5], result
    assert [m["probe_max"] for m in result["metrics"]] == [2.0, 2.0], result
    assert [m["probe_local"] for m in result["metrics"]] == [1.0, 2.0], result
    for rank, checks in enumerate(result["collectives"]):  # broadcast, reduce, all_gather
        assert all(checks.values()), (rank, checks)


@pytest.mark.timeout(200)
def test_an_optimizer_zerompi_cannot_step_is_refused_on_every_rank(
    main_run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = main_run
    message = result["refused_rmsprop"]
    assert message.startswith("TypeError: ") and "torch.optim.RMSprop" in message, message
    assert "on all 2 ranks" in message, message


@pytest.mark.timeout(200)
def test_torch_sgd_is_mapped_onto_zerompi_s_sgd(main_run: tuple[Path, dict[str, Any]]) -> None:
    """``configure_optimizers`` returning ``torch.optim.SGD`` (Nesterov momentum, L2
    decay, two groups, a StepLR, clipping, accumulation) trains as
    ``shard(optimizer="sgd")`` with those settings does, and not as AdamW would."""
    _, result = main_run
    assert result["sgd_stage2"] <= TOLERANCE, result
    assert result["sgd_moved"] > 100 * TOLERANCE, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["adafactor", "adam8bit", "muon"])
def test_adafactor_8bit_adamw_and_muon_are_mapped(
    main_run: tuple[Path, dict[str, Any]], kind: str
) -> None:  # fmt: skip
    """``configure_optimizers`` returning ``torch.optim.Adafactor``, bitsandbytes'
    ``AdamW8bit`` (a stand-in of its name and defaults) or Keller Jordan's
    ``MuonWithAuxAdam`` (a stand-in: Muon for the weights, AdamW for the biases, by
    ``use_muon``), with two groups, a StepLR, clipping and accumulation, trains as
    ``shard(optimizer=...)`` with those settings does, and not as AdamW would."""
    _, result = main_run
    assert result[f"{kind}_rule"] == kind, result
    assert result[f"{kind}_stage2"] <= TOLERANCE, result
    assert result[f"{kind}_moved"] > 100 * TOLERANCE, result


@pytest.mark.timeout(200)
def test_checkpoints_are_directories_with_full_weights(
    main_run: tuple[Path, dict[str, Any]],
) -> None:
    out, result = main_run
    assert result["saved_files"] == ["epoch=0.ckpt", "epoch=1.ckpt"], result
    for name in result["saved_files"]:
        assert sorted(p.name for p in (out / "ckpts" / name).iterdir()) == [
            "lightning.ckpt", "zerompi.zmpi"]  # fmt: skip
    assert result["saved_full"] == 0.0, result  # the last epoch's state_dict: the final weights
    assert result["stage3_saved_full"] == 0.0, result  # full at stage 3 too, not empty


@pytest.mark.timeout(200)
def test_a_stage_2_checkpoint_resumes_on_one_rank_at_stage_3(
    main_run: tuple[Path, dict[str, Any]],
) -> None:
    out, _ = main_run
    result = _script(1, "resume", str(out))
    assert result["resumed"] <= TOLERANCE, result
    assert result["steps"] == 8 and result["lrs"] == result["reference_lrs"], result


@pytest.mark.timeout(200)
def test_the_example_trains_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    ckpts = tmp_path / "ckpts"
    base = [mpiexec(), "-n", "2", sys.executable, str(EXAMPLE), "--epochs", "1",
            "--ckpt-dir", str(ckpts)]  # fmt: skip
    status, out, _ = run([*base, "--max-steps", "4"], timeout=150)
    assert status == 0 and "done: 4 steps on 2 ranks" in out, out[-6000:]
    assert (ckpts / "last.ckpt" / "zerompi.zmpi").is_file(), sorted(ckpts.iterdir())
    # (max_steps ended the first epoch early: the checkpoint counts it as done)
    resumed = [*base, "--epochs", "2", "--stage", "3", "--max-steps", "6", "--resume",
               str(ckpts / "last.ckpt")]  # fmt: skip
    status, out, _ = run(resumed, timeout=150)
    assert status == 0 and "done: 6 steps on 2 ranks" in out, out[-6000:]


def test_import_zerompi_does_not_import_lightning() -> None:
    code = ("import sys, zerompi; "
            "print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    assert out.strip() == "[]", out
