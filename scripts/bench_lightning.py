"""Lightning's overhead over zerompi: one training run through ``Trainer.fit`` with
:class:`zerompi.lightning.ZeroMPIStrategy` and the same run by hand through
``zerompi.torch.shard()``, alternated in one process, and the ratio of their times.

    mpiexec -n 2 python scripts/bench_lightning.py [--stage 2] [--steps 30] [--reps 3]

Both runs shard a fresh MLP, then take ``--steps`` optimizer steps of two
micro-batches each (``accumulate_grad_batches=2``, clipping, a per-step schedule),
with the same per-rank data (Lightning's shuffling ``DistributedSampler``). Times are
rank 0's, between barriers: ``loop`` from the first batch to the last step (Lightning:
``on_train_start`` to ``on_train_end``), ``fit`` all of it (sharding, Lightning's
setup and teardown). Prints each repetition and the medians; target: Lightning's loop
within 1.1x of the direct one.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from zerompi.lightning import ZeroMPIStrategy
from zerompi.torch import shard

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*treespec.*")  # (Lightning 2.6 on torch 2.13)
WORLD = MPI.COMM_WORLD
ACCUMULATE, CLIP, LR = 2, 1.0, 1e-3


def network(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 256))  # fmt: skip


class Module(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = network(width)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


class LoopTimer(pl.Callback):
    """The training loop's time (after Lightning's setup, before its teardown)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = clocks()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seconds = since(self.start)


def clocks() -> tuple[float, float]:
    """Wall and this process's CPU time (the CPU time is less disturbed by other jobs
    on a busy machine; it includes MPI's busy waiting)."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    now = clocks()
    return now[0] - start[0], now[1] - start[1]


def lightning_run(data: TensorDataset, args: argparse.Namespace) -> tuple[float, float]:
    """Wall and CPU seconds of the training loop through ``Trainer.fit``."""
    timer = LoopTimer()
    trainer = pl.Trainer(
        strategy=ZeroMPIStrategy(stage=args.stage), accelerator="cpu", devices=1,
        max_steps=args.steps, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[timer],
    )  # fmt: skip
    trainer.fit(Module(args.width), DataLoader(data, batch_size=args.batch))
    trainer.strategy.sharded_optimizer.close()
    return timer.seconds


def direct_run(data: TensorDataset, args: argparse.Namespace) -> tuple[float, float]:
    """Wall and CPU seconds of the same training loop by hand through ``shard()``."""
    model, optimizer = shard(network(args.width), stage=args.stage, lr=LR, weight_decay=0.1,
                             max_norm=CLIP)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    sampler = DistributedSampler(data, WORLD.size, WORLD.rank, shuffle=True, seed=0)
    start, steps, epoch = clocks(), 0, 0
    while steps < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(DataLoader(data, batch_size=args.batch, sampler=sampler)):
            (F.mse_loss(model(x), y) / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                steps += 1
                if steps == args.steps:
                    break
        epoch += 1
    seconds = since(start)
    optimizer.close()
    return seconds


def timed(run: Any, data: TensorDataset, args: argparse.Namespace) -> tuple[float, float, float]:
    """``(loop wall, loop CPU, fit wall)`` seconds of ``run``, rank 0's, started together."""
    WORLD.Barrier()
    start = time.perf_counter()
    loop = run(data, args)
    WORLD.Barrier()
    return loop[0], loop[1], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per rank and micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    samples = 4 * args.batch * WORLD.size * ACCUMULATE
    x, y = torch.randn(samples, 256, generator=g), torch.randn(samples, 256, generator=g)
    data = TensorDataset(x, y)
    params = sum(p.numel() for p in network(args.width).parameters())
    say = print if WORLD.rank == 0 else (lambda *a, **k: None)
    say(f"bench_lightning: {WORLD.size} ranks, stage {args.stage}, {params / 1e6:.2f}M "
        f"parameters, {args.steps} steps of {ACCUMULATE} micro-batches of {args.batch} per "
        "rank", flush=True)  # fmt: skip
    runs: dict[str, list[tuple[float, float, float]]] = {"direct": [], "lightning": []}
    timed(direct_run, data, args)  # warm-up (first-touch allocations, imports)
    for rep in range(args.reps):
        order = ["direct", "lightning"] if rep % 2 == 0 else ["lightning", "direct"]
        for name in order:
            runs[name].append(timed(direct_run if name == "direct" else lightning_run, data, args))
        d, lt = runs["direct"][-1], runs["lightning"][-1]
        say(f"rep {rep + 1}: loop direct {d[0]:.3f} s (cpu {d[1]:.3f}, fit {d[2]:.3f}), "
            f"lightning {lt[0]:.3f} s (cpu {lt[1]:.3f}, fit {lt[2]:.3f}), ratio {lt[0] / d[0]:.3f}",
            flush=True)  # fmt: skip
    # Paired: each repetition's two runs are neighbours in time (a busy machine's noise
    # hits both alike), so the median of the per-repetition ratios is the estimate.
    pairs = list(zip(runs["direct"], runs["lightning"], strict=True))
    loop, cpu, fit = (statistics.median(lt[i] / d[i] for d, lt in pairs) for i in range(3))
    med = {k: statistics.median(t[0] for t in v) for k, v in runs.items()}
    say(f"median: direct loop {med['direct']:.3f} s, lightning loop {med['lightning']:.3f} s; "
        f"ratio lightning/direct: loop {loop:.3f} (target <= 1.1), loop CPU time {cpu:.3f}, "
        f"whole fit {fit:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
