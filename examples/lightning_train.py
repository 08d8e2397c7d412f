"""Train a PyTorch Lightning module sharded by zerompi (ZeRO over MPI, CPU).

Every rank runs this same script; the launcher starts the ranks, Lightning spawns
nothing. One core per rank::

    mpiexec -n 4 python examples/lightning_train.py --stage 2
    mpiexec -n 4 python examples/lightning_train.py --stage 3 --resume ckpts/last.ckpt
    srun --ntasks=8 --cpus-per-task=1 python examples/lightning_train.py --stage 3

(``srun`` needs an MPI that speaks SLURM's PMI: see ``slurm/README.md``.) Checkpoints
go to ``--ckpt-dir``, one directory per checkpoint, and resume at any world size and
stage. ``--max-steps`` stops early (the test suite runs this example with it).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerompi.lightning import ZeroMPIStrategy

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Regressor(pl.LightningModule):
    """An MLP; weights decay, biases and norms do not (the usual two groups)."""

    def __init__(self, width: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.GELU(), nn.LayerNorm(width),
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)  # the mean over ranks
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in self.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=self.hparams.lr, betas=(0.9, 0.95),
        )  # fmt: skip
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def data(samples: int, seed: int) -> TensorDataset:
    """A fixed random regression task (the same on every rank: Lightning's
    ``DistributedSampler`` gives each rank its part)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=g)
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)) / 4
    return TensorDataset(x, torch.tanh(x @ w) + 0.01 * torch.randn(samples, 8, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--ckpt-dir", default="ckpts")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=ZeroMPIStrategy(stage=args.stage),  # or strategy="zerompi" (stage 2)
        accelerator="cpu", devices=1,                 # one process per rank
        max_epochs=args.epochs, max_steps=args.max_steps,
        accumulate_grad_batches=2, gradient_clip_val=1.0,  # zerompi's max_norm
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)],
        logger=False, enable_progress_bar=False,
    )  # fmt: skip
    model = Regressor()
    train = DataLoader(data(4096, 1), batch_size=args.batch_size, shuffle=True)
    valid = DataLoader(data(512, 2), batch_size=args.batch_size)
    trainer.fit(model, train, valid, ckpt_path=args.resume)
    losses = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps on {trainer.world_size} ranks, {losses}")


if __name__ == "__main__":
    main()
