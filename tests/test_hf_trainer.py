"""``zerompi.hf.ZeroMPITrainer`` (``tests/hf_trainer_script.py`` under a subprocess
``mpiexec``; serial run only, as ``tests/test_hf.py``): at stages 1, 2 and 3 the
trainer ends where a plain ``shard()`` loop over the same data ends (accumulation,
clipping, decay groups, warmup schedule, a loss averaged over every rank's label
tokens); ``save_model`` is read by ``from_pretrained`` bit for bit; a refused
``optim`` is an error on every rank; ``train()`` freezes the objects alive before it
for HF's garbage collection (and leaves a program's own freeze alone); a checkpoint
saved at 2 ranks and stage 3 resumes at 1 rank and stage 2 to the parameters of the
uninterrupted run; the example runs. Skipped without torch or transformers (CI
installs both)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "hf_trainer_script.py"
EXAMPLE = HERE.parent / "examples" / "hf_trainer.py"
QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
         "HF_HUB_OFFLINE": "1"}  # fmt: skip
pytestmark = pytest.mark.mpi_skip


def launch(ranks: int, *argv: str, timeout: float = 150) -> tuple[int, str, dict | None]:
    """``mpiexec -n ranks python argv...``: status, output and its RESULT line."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    status, out, _ = run([mpiexec(), "-n", str(ranks), sys.executable, *argv],
                         timeout=timeout, **QUIET)  # fmt: skip
    found = re.findall(r"RESULT (\{.*\})", out)  # (a log line may share its line)
    return status, out, json.loads(found[0]) if len(found) == 1 else None


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The two-rank run of the script (the stages, the refusal, checkpoint-3)."""
    folder = tmp_path_factory.mktemp("hf_trainer")
    status, out, result = launch(2, str(SCRIPT), "parity", str(folder))
    assert status == 0 and result is not None, out[-4000:]
    return folder, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_trainer_ends_where_a_plain_shard_loop_ends(stage: int, parity: tuple) -> None:
    result = parity[1][f"stage{stage}"]
    assert parity[1]["ranks"] == 2
    assert result["diff"] <= 1e-5, result
    assert result["moved"] > 1e-3, result  # it trained
    assert max(result["norms"]) > 1.0 > min(result["norms"]), result  # max_norm clipped some


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_model_is_read_by_from_pretrained_bit_for_bit(stage: int, parity: tuple) -> None:
    result = parity[1][f"stage{stage}"]
    assert result["saved_diff"] == 0.0, result
    assert result["saved_names_match"] and result["saved_tied"], result


@pytest.mark.timeout(200)
def test_train_freezes_what_lives_before_it_for_the_collector(parity: tuple) -> None:
    """HF's full ``gc.collect()`` at the start of training scans no object that was
    alive before ``train()`` (frozen during it, unfrozen after); where the program
    had frozen objects itself (the stage-3 run), the trainer leaves them frozen."""
    mine, theirs = parity[1]["stage2"]["frozen"], parity[1]["stage3"]["frozen"]
    assert mine["before"] == 0 and mine["during"] > 100_000 and mine["after"] == 0, mine
    # (frozen objects that die leave the count: it only falls while nothing freezes)
    assert theirs["before"] > 100_000 and theirs["during"] <= theirs["before"], theirs
    assert theirs["after"] > 100_000, theirs  # not unfrozen by the trainer


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["sgd", "lion"])
def test_optim_sgd_and_lion_are_zerompi_s(name: str, parity: tuple) -> None:
    """``optim="sgd"`` (``optim_args`` momentum and nesterov) and ``"lion_32bit"``
    train as ``shard(optimizer=...)`` with HF's settings does (decay groups, clipping,
    schedule, accumulation), and not as AdamW would."""
    result = parity[1][name]
    assert result["rule"] == name and result["diff"] <= 1e-5, result
    assert result["vs_adamw"] > 1e-3, result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name, rule", [("adafactor_class", "adafactor"),
                                        ("muon_instance", "muon")])  # fmt: skip
def test_a_torch_optimizer_given_is_read_and_stepped_by_zerompi(
    name: str, rule: str, parity: tuple
) -> None:  # fmt: skip
    """``optimizer_cls_and_kwargs=(torch.optim.Adafactor, {...})`` (built over HF's
    decay groups) and ``optimizers=(MuonWithAuxAdam(...), None)`` (Keller Jordan's
    class, a stand-in; the user's groups: Muon for the hidden matrices, AdamW for the
    rest) train as ``shard(optimizer=...)`` with those settings and groups does
    (clipping, HF's schedule over zerompi's optimizer, accumulation), and not as
    AdamW would."""
    result = parity[1][name]
    assert result["rule"] == rule and result["diff"] <= 1e-5, result
    assert result["vs_adamw"] > 1e-3, result


@pytest.mark.timeout(200)
def test_a_refused_optim_is_an_error_on_every_rank(parity: tuple) -> None:
    errors = parity[1]["refused"]
    assert len(errors) == 2 and all("optim='adafactor' is not supported (HF's own Adafactor"
                                    in e and "torch.optim.Adafactor" in e for e in errors)
    scheduler, rmsprop = zip(*parity[1]["refused_given"], strict=True)
    assert all("with a scheduler is not supported" in e for e in scheduler), scheduler
    assert all("torch.optim.RMSprop is not supported" in e for e in rmsprop), rmsprop


@pytest.mark.timeout(200)
def test_each_rank_is_one_process_to_transformers(parity: tuple) -> None:
    """use_cpu=True under mpiexec: no torch.distributed of accelerate's; the process
    index is the rank (files written by rank 0 only)."""
    assert parity[1]["single"] == [[False, 1, 0], [False, 1, 1]], parity[1]["single"]


@pytest.mark.timeout(200)
def test_a_checkpoint_resumes_at_another_world_size_and_stage(parity: tuple) -> None:
    folder, result = parity
    assert {"optimizer.zmpi", "model.safetensors", "scheduler.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= set(result["checkpoint_files"])  # fmt: skip
    status, out, resumed = launch(1, str(SCRIPT), "resume", str(folder))
    assert status == 0 and resumed is not None, out[-4000:]
    assert resumed["steps"] == 6 and resumed["diff"] <= 1e-5, resumed


@pytest.mark.timeout(200)
def test_the_example_trains(tmp_path: Path) -> None:
    status, out, result = launch(2, str(EXAMPLE), "--max-steps", "4", "--output-dir",
                                 str(tmp_path), "--stage", "3")  # fmt: skip
    assert status == 0 and result is not None, out[-4000:]
    assert result["ranks"] == 2 and result["steps"] == 4, result
    assert 0 < result["eval_loss"] < 10, result  # evaluate() ran at stage 3 on both ranks
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_8bit"])
def test_optim_8bit_adamw_is_zerompis_8bit_adam(optim: str, tmp_path: Path) -> None:
    """bitsandbytes' 8-bit AdamW is mapped to ``optimizer="adam8bit"`` with exactly
    AdamW's settings (betas, eps, weight decay, decoupled, clipping)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zerompi.hf import adamw_settings, optimizer_settings

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), optim=optim, use_cpu=True, learning_rate=3e-4,
        adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7, weight_decay=0.05,
        max_grad_norm=0.5)  # fmt: skip
    got = optimizer_settings(args)
    assert got == {**adamw_settings(args), "optimizer": "adam8bit"}, got
    assert got["betas"] == (0.8, 0.9) and got["max_norm"] == 0.5, got
