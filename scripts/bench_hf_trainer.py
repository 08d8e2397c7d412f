"""The cost of the Hugging Face Trainer over zerompi: the same training run through
:class:`zerompi.hf.ZeroMPITrainer` and through ``zerompi.torch.shard()`` and a plain
loop, alternated in one process (the same data per rank, accumulation 2, clipping,
AdamW, a linear schedule), and the ratios of their times (target: <= 1.1): of the
best whole runs, of the best median steps, and of the median step over all rounds
(the figure least moved by other load on the machine). A median step is the steady
state, without the setup (HF's ``train()`` starts with a ``gc.collect()`` of its own).
Before each run, untimed, a ``gc.collect()`` frees what the runs before left: a
process that trains once has no earlier run's models and optimizers in reference
cycles, and HF's own collection would otherwise pay for freeing them. ::

    mpiexec -n 2 python scripts/bench_hf_trainer.py [--stage 2] [--steps 30] [--rounds 3]

Each timing covers sharding the model and training it; building the model does not
count. Rank 0 prints the times and one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from zerompi.hf import ZeroMPITrainer
from zerompi.mpi.collectives import Comm
from zerompi.torch import shard

CONFIG = GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=1024, n_positions=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
BATCH, ACCUM, LENGTH = 8, 2, 64
SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "max_norm": 1.0}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.tokens = torch.randint(0, CONFIG.vocab_size, (size, LENGTH),
                                    generator=torch.Generator().manual_seed(0))  # fmt: skip

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def new_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


class StepClock(TrainerCallback):
    """The time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, *_: Any, **__: Any) -> None:
        self.ends.append(time.perf_counter())


def median_step(ends: list[float]) -> float:
    """The median time between step ends, the first step (its warm-up) left out."""
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def through_trainer(
    comm: Comm, data: Tokens, stage: int, steps: int, out: str
) -> tuple[float, float]:
    args = TrainingArguments(
        output_dir=out, use_cpu=True, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, max_steps=steps, learning_rate=SETTINGS["lr"],
        weight_decay=SETTINGS["weight_decay"], max_grad_norm=SETTINGS["max_norm"],
        lr_scheduler_type="linear", warmup_steps=2, train_sampling_strategy="sequential",
        save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=steps,
    )  # fmt: skip
    clock = StepClock()
    trainer = ZeroMPITrainer(model=new_model(), args=args, train_dataset=data, stage=stage,
                             callbacks=[clock])  # fmt: skip
    comm.barrier()
    start = time.perf_counter()
    trainer.train()
    comm.barrier()
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed, median_step(clock.ends)


def through_shard(comm: Comm, data: Tokens, stage: int, steps: int) -> tuple[float, float]:
    model = new_model()
    names = [n for n, _ in model.named_parameters()]
    no_decay = [n for n in names if n.endswith(".bias") or ".ln_" in n]
    groups = [{"params": [n for n in names if n not in no_decay]},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    comm.barrier()
    start = time.perf_counter()
    model, opt = shard(model, stage=stage, decoupled_weight_decay=True, param_groups=groups,
                       **SETTINGS)  # fmt: skip
    scheduler = get_linear_schedule_with_warmup(opt, 2, steps)
    model.train()
    ends = []
    for step in range(steps):
        for micro in range(ACCUM):
            first = ((step * ACCUM + micro) * comm.size + comm.rank) * BATCH
            batch = data.tokens[first : first + BATCH]
            (model(input_ids=batch, labels=batch).loss / ACCUM).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
    comm.barrier()
    elapsed = time.perf_counter() - start
    opt.close()
    return elapsed, median_step(ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-dir", default="/tmp/zerompi_bench_hf_trainer")
    options = parser.parse_args()
    torch.set_num_threads(1)
    comm = Comm()
    data = Tokens(options.steps * ACCUM * comm.size * BATCH)
    gc.collect()
    start = time.perf_counter()
    gc.collect()  # what HF's start pays where nothing is frozen (ZeroMPITrainer freezes)
    collect = (time.perf_counter() - start, len(gc.get_objects()))
    times: dict[str, list[tuple[float, float]]] = {"trainer": [], "shard": []}
    for _ in range(options.rounds):  # alternated: drift hits both alike
        gc.collect()  # the last run's garbage is not this one's to free (untimed)
        times["trainer"].append(through_trainer(comm, data, options.stage, options.steps,
                                                options.output_dir))  # fmt: skip
        gc.collect()
        times["shard"].append(through_shard(comm, data, options.stage, options.steps))
    run = {k: min(t for t, _ in v) for k, v in times.items()}
    step = {k: min(s for _, s in v) for k, v in times.items()}
    typical = {k: statistics.median(s for _, s in v) for k, v in times.items()}
    ratios = {"run": run["trainer"] / run["shard"], "step": step["trainer"] / step["shard"],
              "typical_step": typical["trainer"] / typical["shard"]}  # fmt: skip
    if comm.rank == 0:
        for k, v in times.items():
            rounds = " ".join(f"{t:.3f}s/{1e3 * s:.1f}ms" for t, s in v)
            print(f"{k:8s} run/median step: {rounds}  best {run[k]:.3f}s/{1e3 * step[k]:.1f}ms")
        print(f"ZeroMPITrainer / shard() loop: {ratios['run']:.3f}x the best run, "
              f"{ratios['step']:.3f}x the best median step, {ratios['typical_step']:.3f}x "
              f"the median step over the rounds ({comm.size} ranks, stage "
              f"{options.stage}, {options.steps} steps)", flush=True)  # fmt: skip
        print(f"one full gc.collect() with nothing frozen, before the runs: "
              f"{collect[0]:.3f} s over {collect[1]:,} tracked objects", flush=True)  # fmt: skip
        print("RESULT " + json.dumps({"ranks": comm.size, "stage": options.stage, "run": run,
                                      "step": step, "ratios": ratios,
                                      "gc_collect_s": collect[0]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
