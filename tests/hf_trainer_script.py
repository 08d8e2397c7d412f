"""``zerompi.hf.ZeroMPITrainer`` against a plain ``zerompi.torch.shard()`` loop, run by
``tests/test_hf_trainer.py`` under ``mpiexec``. A tiny random GPT-2 (no dropout) on
generated token sequences. Prints one ``RESULT {json}`` line on rank 0.

    mpiexec -n 2 python tests/hf_trainer_script.py parity DIR
        stages 1, 2 and 3 (3 without node shared memory: parameters are empty outside a
        forward): the trainer (accumulation 2, max_grad_norm, decay groups, linear
        schedule with warmup, sequential data sliced by rank) and the same training
        written as a loop over shard(); save_model read back by from_pretrained;
        optim='adafactor' refused on every rank; then a run of STEPS steps at stage 3
        that saves checkpoint-3 (random order), its final parameters in DIR/full.pt.
    mpiexec -n 1 python tests/hf_trainer_script.py resume DIR
        resumes DIR/run/checkpoint-3 at one rank, stage 2, the same global batch, and
        compares the final parameters with DIR/full.pt.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before transformers is imported
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from standins import MuonWithAuxAdam
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from zerompi import ZeroConfig
from zerompi.hf import ZeroMPITrainer
from zerompi.mpi.collectives import Comm
from zerompi.torch import shard

torch.set_num_threads(1)
comm = Comm()
CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    bos_token_id=0, eos_token_id=0)  # fmt: skip
SAMPLES, LENGTH, BATCH, ACCUM, STEPS = 32, 12, 2, 2, 6
#: AdamW with a large eps, so that the update depends on the gradient's scale (a loss
#: scaled twice would show), and a max norm the first steps exceed.
ADAM = {"learning_rate": 1e-2, "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_epsilon": 1e-3,
        "weight_decay": 0.1, "max_grad_norm": 1.0}  # fmt: skip
TOKENS = torch.randint(0, 97, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(7))
#: The labels: the tokens, with the first position and about a quarter of the others
#: ignored (-100), so that ranks and micro-batches hold different numbers of label
#: tokens. (HF's Trainer counts a GPT-2's labels unshifted: with the first one
#: ignored its count is the number of tokens the loss sums.)
_DROP = torch.rand(SAMPLES, LENGTH, generator=torch.Generator().manual_seed(8)) < 0.25
LABELS = TOKENS.masked_fill(_DROP, -100)
LABELS[:, 0] = -100


class Tokens(torch.utils.data.Dataset):
    """The generated sequences and their labels."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": TOKENS[i], "labels": LABELS[i]}


def new_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def arguments(out: str, **changes: object) -> TrainingArguments:
    settings = {
        "output_dir": out, "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUM, "max_steps": 4, "lr_scheduler_type": "linear",
        "warmup_steps": 2, "use_cpu": True, "report_to": "none", "save_strategy": "no",
        "logging_steps": 1, "disable_tqdm": True, "seed": 0, **ADAM,
    }  # fmt: skip
    settings.update(changes)
    return TrainingArguments(**settings)


def parameters(model: torch.nn.Module, optimizer: object) -> dict[str, torch.Tensor]:
    with optimizer.full_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest ``max|a - b| / max|b|`` over the tensors (names must match)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)).item() for n in b)


#: Other optimizers through ``TrainingArguments.optim``: the trainer's arguments and
#: the zerompi settings the plain loop uses instead of AdamW's.
OTHERS = {
    "sgd": ({"optim": "sgd", "optim_args": "momentum=0.9, nesterov=True"},
            {"optimizer": "sgd", "momentum": 0.9, "nesterov": True,
             "decoupled_weight_decay": False}),
    "lion": ({"optim": "lion_32bit", "learning_rate": 1e-3},
             {"optimizer": "lion", "lr": 1e-3, "betas": (0.9, 0.99)}),
}  # fmt: skip


def muon_groups(named: list[str]) -> tuple[list[bool], list[dict[str, object]]]:
    """Keller Jordan's split of a GPT-2: Muon for the hidden matrices, AdamW (lr 3e-3)
    for the embeddings, biases and norms; which parameter is Muon's, and the groups'
    settings."""
    muon = [n.endswith(".weight") and ".h." in n and ".ln_" not in n for n in named]
    return muon, [{"use_muon": True, "lr": 1e-2, "weight_decay": 0.1},
                  {"use_muon": False, "lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-8,
                   "weight_decay": 0.0}]


def plain_loop(stage_settings: dict[str, object], rule: dict[str, object] | None = None,
               groups: list[dict] | None = None) -> tuple[dict, list[float]]:  # fmt: skip
    """The same training written by hand: rank r's micro-batch k holds samples
    ``[(k*W + r)*B, +B)`` (sequential order, sliced by rank); the loss is the mean
    over the label tokens of the whole global batch (every rank's micro-batches of
    the step: the sum of this micro-batch's token losses over their count / W, as
    zerompi averages over ranks); zerompi's AdamW with HF's decay groups and HF's
    linear schedule."""
    model = new_model()
    names = [n for n, _ in model.named_parameters()]
    no_decay = [n for n in names if n.endswith(".bias") or ".ln_" in n]
    groups = groups or [{"params": [n for n in names if n not in no_decay], "weight_decay": 0.1},
                        {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    optimizer = rule or {"lr": ADAM["learning_rate"], "betas": (0.9, 0.99), "eps": 1e-3,
                         "decoupled_weight_decay": True}  # fmt: skip
    optimizer = {"lr": ADAM["learning_rate"], **optimizer}
    model, opt = shard(model, weight_decay=0.1, max_norm=1.0, param_groups=groups,
                       **optimizer, **stage_settings)  # fmt: skip
    scheduler = get_linear_schedule_with_warmup(opt, 2, 4)
    norms = []
    window = ACCUM * comm.size * BATCH
    for step in range(4):
        count = int((LABELS[step * window : (step + 1) * window] != -100).sum())
        for micro in range(ACCUM):
            k = step * ACCUM + micro
            first = (k * comm.size + comm.rank) * BATCH
            rows = slice(first, first + BATCH)
            logits = model(input_ids=TOKENS[rows]).logits[:, :-1]
            total = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), LABELS[rows, 1:].reshape(-1),
                ignore_index=-100, reduction="sum")  # fmt: skip
            (total / (count / comm.size)).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        norms.append(opt.zero.last_grad_norm)
    trained = parameters(model, opt)
    opt.close()
    return trained, norms


class FreezeSeen(TrainerCallback):
    """The garbage collector's frozen object count when training begins."""

    def __init__(self) -> None:
        self.frozen = -1

    def on_train_begin(self, *_: object, **__: object) -> None:
        self.frozen = gc.get_freeze_count()


def trainer_run(out: str, user_froze: bool = False, **keywords: object) -> tuple[dict, dict]:
    """The trainer over the same data; its parameters and save_model read back; what
    the collector had frozen during and after ``train()`` (``user_froze``: the
    program froze objects itself before, which the trainer must leave frozen)."""
    args = arguments(out, train_sampling_strategy="sequential")
    seen = FreezeSeen()
    trainer = ZeroMPITrainer(model=new_model(), args=args, train_dataset=Tokens(),
                             callbacks=[seen], **keywords)  # fmt: skip
    if user_froze:
        gc.freeze()
    before = gc.get_freeze_count()
    trainer.train()
    after = gc.get_freeze_count()
    if user_froze:
        gc.unfreeze()
    trained = parameters(trainer.model, trainer.sharded)
    trainer.save_model(f"{out}/saved")
    single = [torch.distributed.is_initialized(), args.world_size, args.process_index]
    result: dict = {"single": comm.allgather(single),
                    "frozen": {"before": before, "during": seen.frozen, "after": after}}
    if comm.rank == 0:
        back = GPT2LMHeadModel.from_pretrained(f"{out}/saved")
        loaded = dict(back.named_parameters())
        result |= {
            "saved_names_match": sorted(loaded) == sorted(trained),
            "saved_diff": max((loaded[n] - p).abs().max().item() for n, p in trained.items()),
            "saved_tied": back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr(),
        }
    trainer.close()
    return trained, result


def refused(out: str) -> list[str]:
    """Every rank's error for optim='adafactor' (one each, none hanging)."""
    try:
        ZeroMPITrainer(model=new_model(), args=arguments(out, optim="adafactor"),
                       train_dataset=Tokens())  # fmt: skip
    except Exception as exc:  # the refusal, on every rank alike
        return comm.allgather(f"{type(exc).__name__}: {exc}")
    return comm.allgather("no error")


def refused_given(out: str) -> list[list[str]]:
    """Every rank's errors for an optimizer with its own scheduler, and for one zerompi
    does not step."""
    errors = []
    for keywords in ({"scheduler": True}, {"optimizer": "rmsprop"}):
        model = new_model()
        opt = (torch.optim.RMSprop if "optimizer" in keywords else torch.optim.AdamW)(
            model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1) if "scheduler" in keywords else None
        try:
            ZeroMPITrainer(model=model, args=arguments(out), train_dataset=Tokens(),
                           optimizers=(opt, sched))  # fmt: skip
            errors.append("no error")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return comm.allgather(errors)


def checkpointed_run(out: str) -> dict[str, torch.Tensor]:
    """STEPS steps at stage 3 in random order, checkpoint-3 saved on the way."""
    args = arguments(out, max_steps=STEPS, save_strategy="steps", save_steps=3)
    trainer = ZeroMPITrainer(model=new_model(), args=args, train_dataset=Tokens(), stage=3)
    trainer.train()
    trained = parameters(trainer.model, trainer.sharded)
    trainer.close()
    return trained


def parity(folder: str) -> dict:
    result: dict = {"ranks": comm.size}
    stages = {1: {"stage": 1}, 2: {"stage": 2}, 3: {"stage": 3, "shared_memory": False}}
    for stage, settings in stages.items():
        keywords: dict = {"stage": stage}
        if stage == 3:  # a config and the stage over it; the program froze objects
            keywords["zero_config"] = ZeroConfig().replace(shared_memory=False)
            keywords["user_froze"] = True
        trained, saved = trainer_run(f"{folder}/stage{stage}", **keywords)
        reference, norms = plain_loop(settings)
        initial = {n: p.detach() for n, p in new_model().named_parameters()}
        result[f"stage{stage}"] = {
            "diff": max_relative(trained, reference), "moved": max_change(trained, initial),
            "norms": norms, **saved,
        }  # fmt: skip
    result["single"] = result["stage2"].pop("single")
    for name, (changes, rule) in OTHERS.items():  # stage 2, another optimizer
        args = arguments(f"{folder}/{name}", train_sampling_strategy="sequential", **changes)
        trainer = ZeroMPITrainer(model=new_model(), args=args, train_dataset=Tokens())
        trainer.train()
        trained = parameters(trainer.model, trainer.sharded)
        kind = trainer.sharded.zero.engine.rule.name
        trainer.close()
        reference, _ = plain_loop({"stage": 2}, rule)
        adamw, _ = plain_loop({"stage": 2})
        result[name] = {"diff": max_relative(trained, reference), "rule": kind,
                        "vs_adamw": max_relative(trained, adamw)}  # fmt: skip
    adamw, _ = plain_loop({"stage": 2})
    for name in ("adafactor_class", "muon_instance"):  # a torch optimizer zerompi reads
        model = new_model()
        names = [n for n, _ in model.named_parameters()]
        groups = None
        if name == "adafactor_class":  # built by the trainer over HF's decay groups
            keywords: dict = {"optimizer_cls_and_kwargs": (torch.optim.Adafactor, {"lr": 1e-2})}
            rule: dict = {"optimizer": "adafactor", "lr": 1e-2}
        else:  # the user's own, over their groups
            muon, (first, second) = muon_groups(names)
            params = [p for _, p in model.named_parameters()]
            given = MuonWithAuxAdam([
                {"params": [p for p, m in zip(params, muon, strict=True) if m], **first},
                {"params": [p for p, m in zip(params, muon, strict=True) if not m], **second}])
            keywords = {"optimizers": (given, None)}
            rule = {"optimizer": "muon"}
            groups = [{"params": [n for n, m in zip(names, muon, strict=True) if m],
                       **{k: v for k, v in first.items() if k != "use_muon"}},
                      {"params": [n for n, m in zip(names, muon, strict=True) if not m],
                       "muon": False, **{k: v for k, v in second.items() if k != "use_muon"}}]
        args = arguments(f"{folder}/{name}", train_sampling_strategy="sequential")
        trainer = ZeroMPITrainer(model=model, args=args, train_dataset=Tokens(), **keywords)
        trainer.train()
        trained = parameters(trainer.model, trainer.sharded)
        kind = trainer.sharded.zero.engine.rule.name
        trainer.close()
        reference, _ = plain_loop({"stage": 2}, rule, groups)
        result[name] = {"diff": max_relative(trained, reference), "rule": kind,
                        "vs_adamw": max_relative(trained, adamw)}  # fmt: skip
    result["refused"] = refused(f"{folder}/refused")
    result["refused_given"] = refused_given(f"{folder}/refused_given")
    full = checkpointed_run(f"{folder}/run")
    if comm.rank == 0:
        torch.save(full, f"{folder}/full.pt")
        result["checkpoint_files"] = sorted(os.listdir(f"{folder}/run/checkpoint-3"))
    return result


def resume(folder: str) -> dict:
    """checkpoint-3 of the W=2 run, resumed here at stage 2 with a per-device batch
    that keeps the global batch (W * B)."""
    wide = BATCH * 2 // comm.size
    args = arguments(f"{folder}/resumed", max_steps=STEPS, per_device_train_batch_size=wide)
    trainer = ZeroMPITrainer(model=new_model(), args=args, train_dataset=Tokens(), stage=2)
    trainer.train(resume_from_checkpoint=f"{folder}/run/checkpoint-3")
    trained = parameters(trainer.model, trainer.sharded)
    steps = trainer.state.global_step
    trainer.close()
    full = torch.load(f"{folder}/full.pt")
    return {"ranks": comm.size, "diff": max_relative(trained, full), "steps": steps}


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    outcome = parity(directory) if mode == "parity" else resume(directory)
    if comm.rank == 0:
        print("RESULT " + json.dumps(outcome), flush=True)
