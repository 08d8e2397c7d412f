"""A small MLP ``LightningModule`` trained through ``zerompi.lightning``, run by
``tests/test_lightning.py`` under ``mpiexec``. Prints one ``RESULT {json}`` line on
rank 0.

``main DIR`` (2 ranks): the strategy's collectives; an RMSprop refused; torch's SGD
(Nesterov, L2 decay, two groups) mapped onto zerompi's at stage 2; at stage
2 (``strategy="zerompi"``) and stage 3 (no node copy) a Lightning fit (accumulation 2,
gradient clipping, two parameter groups, a per-step ``StepLR``) against the same
model trained by a plain loop through ``zerompi.torch.shard()`` on the same data;
``sync_dist`` logging; checkpoints at every epoch end of the stage-2 run and the final
parameters (``DIR/reference.pt``). ``resume DIR`` (1 rank, stage 3): resumes from the
stage-2 run's first-epoch checkpoint and compares its final parameters with it.

    mpiexec -n 2 python tests/lightning_script.py main DIR
    mpiexec -n 1 python tests/lightning_script.py resume DIR
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from mpi4py import MPI
from standins import AdamW8bit, MuonWithAuxAdam
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from zerompi.lightning import ZeroMPIStrategy
from zerompi.torch import shard

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
torch.set_num_threads(1)

WORLD = MPI.COMM_WORLD
MODE, OUT = sys.argv[1], Path(sys.argv[2])
SAMPLES, BATCH, ACCUMULATE, CLIP, EPOCHS = 64, 4, 2, 1.5, 2  # 4 optimizer steps per epoch
LR, BIAS_LR, BETAS, EPS, DECAY = 1e-2, 5e-3, (0.9, 0.95), 1e-3, 0.1
GAMMA = 0.5  # StepLR(step_size=2)
MOMENTUM = 0.9  # SGD's


def dataset(count: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 8, generator=g)
    return TensorDataset(x, 3 * torch.sin(x[:, :4] * 2) + x[:, 4:])


TRAIN, VALID = dataset(SAMPLES, 1), dataset(8, 2)


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class MLP(pl.LightningModule):
    """Two parameter groups (weights with decay, biases without and a lower lr)."""

    def __init__(self, kind: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 4))  # fmt: skip
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_of(self, batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        rank = float(self.global_rank + 1)
        self.log("val_loss", loss_of(self, batch), sync_dist=True)
        self.log("probe", rank, sync_dist=True)
        self.log("probe_max", rank, sync_dist=True, reduce_fx="max")
        self.log("probe_local", rank)

    def configure_optimizers(self) -> Any:
        if self.kind == "rmsprop":
            return torch.optim.RMSprop(self.parameters(), lr=0.1)
        named = dict(self.named_parameters())
        groups = [{"params": [p for n, p in named.items() if n.endswith("weight")]},
                  {"params": [p for n, p in named.items() if n.endswith("bias")],
                   "lr": BIAS_LR, "weight_decay": 0.0}]  # fmt: skip
        if self.kind == "sgd":  # (L2 decay, Nesterov momentum)
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                groups, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=DECAY)
        elif self.kind == "adafactor":
            optimizer = torch.optim.Adafactor(groups, lr=LR, weight_decay=DECAY)
        elif self.kind == "adam8bit":
            optimizer = AdamW8bit(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
        elif self.kind == "muon":  # Keller's API: Muon for the matrices, AdamW for the rest
            weights, biases = groups
            optimizer = MuonWithAuxAdam([
                {**weights, "use_muon": True, "lr": LR, "weight_decay": DECAY},
                {**biases, "use_muon": False, "betas": BETAS, "eps": EPS}])  # fmt: skip
        else:
            optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=GAMMA)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


#: ``shard()``'s settings of each kind of :class:`MLP`'s optimizer (and its bias group's).
DIRECT: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "adamw": ({"betas": BETAS, "eps": EPS, "decoupled_weight_decay": True}, {}),
    "sgd": ({"optimizer": "sgd", "momentum": MOMENTUM, "nesterov": True,
             "decoupled_weight_decay": False}, {}),
    "adafactor": ({"optimizer": "adafactor"}, {}),
    "adam8bit": ({"optimizer": "adam8bit", "betas": BETAS, "eps": EPS,
                  "decoupled_weight_decay": True}, {}),
    "muon": ({"optimizer": "muon"}, {"muon": False, "betas": BETAS, "eps": EPS}),
}  # fmt: skip


def lightning_fit(
    strategy: Any, batch: int = BATCH, callbacks: list | None = None,
    ckpt_path: str | None = None, kind: str = "adamw",
) -> tuple[pl.Trainer, MLP]:  # fmt: skip
    module = MLP(kind)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, num_nodes=1, max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks), callbacks=callbacks or [], default_root_dir=OUT,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TRAIN, batch_size=batch), DataLoader(VALID, batch_size=batch),
                ckpt_path=ckpt_path)  # fmt: skip
    return trainer, module


def final(trainer: pl.Trainer, module: nn.Module) -> dict[str, torch.Tensor]:
    with trainer.strategy.full_parameters():
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def direct(stage: int, shared: bool | None, clip: float | None = CLIP,
           scale: float = 1 / ACCUMULATE,
           kind: str = "adamw") -> dict[str, torch.Tensor]:  # fmt: skip
    """The same training as :func:`lightning_fit`, by hand through ``shard()``."""
    module = MLP()
    names = [n for n, _ in module.named_parameters()]
    rule, bias = DIRECT[kind]
    groups = [{"params": [n for n in names if n.endswith("weight")]},
              {"params": [n for n in names if n.endswith("bias")], "lr": BIAS_LR,
               "weight_decay": 0.0, **bias}]  # fmt: skip
    model, optimizer = shard(module, stage=stage, lr=LR, weight_decay=DECAY, max_norm=clip,
                             param_groups=groups, shared_memory=shared, **rule)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=GAMMA)
    # What Lightning puts in: a shuffling DistributedSampler (seed 0), set to each epoch.
    sampler = DistributedSampler(TRAIN, WORLD.size, WORLD.rank, shuffle=True, seed=0)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(DataLoader(TRAIN, batch_size=BATCH, sampler=sampler)):
            (loss_of(model, batch) * scale).backward()
            if (i + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
    with optimizer.full_parameters():
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.close()
    return out


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference of any parameter, relative to its largest magnitude."""
    assert sorted(a) == sorted(b) and all(t.numel() for t in a.values()), (sorted(a), sorted(b))
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


def collectives(strategy: ZeroMPIStrategy) -> dict[str, bool]:
    """The strategy's collectives over zerompi's communicator, checked on every rank."""
    rank, size = WORLD.rank, WORLD.size
    strategy.barrier("check")
    gathered = strategy.all_gather(torch.tensor([rank, 2 * rank]))
    return {
        "broadcast": strategy.broadcast({"from": rank}, src=size - 1) == {"from": size - 1},
        "sum": strategy.reduce(torch.tensor([rank + 1.0, 2.0]), reduce_op="sum").tolist()
        == [size * (size + 1) / 2, 2.0 * size],
        "mean_of_ints": strategy.reduce(torch.tensor(rank)).item() == (size - 1) / 2,
        "max": strategy.reduce(torch.tensor(float(rank)), reduce_op="max").item() == size - 1,
        "all_gather": gathered.tolist() == [[r, 2 * r] for r in range(size)],
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "all": not strategy.reduce_boolean_decision(rank == 0) or size == 1,
    }


def refused(kind: str) -> str:
    try:
        lightning_fit(ZeroMPIStrategy(), kind=kind)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def metrics(trainer: pl.Trainer) -> dict[str, float]:
    keys = ("probe", "probe_max", "probe_local")
    return {k: float(trainer.callback_metrics[k]) for k in keys}


def main() -> dict[str, Any]:
    checks = collectives(ZeroMPIStrategy())
    result: dict[str, Any] = {"refused_rmsprop": refused("rmsprop")}
    ckpts = OUT / "ckpts"
    saver = ModelCheckpoint(dirpath=ckpts, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                            save_on_train_epoch_end=True)  # fmt: skip
    trainer, module = lightning_fit("zerompi", callbacks=[saver])
    reference = final(trainer, module)
    result["lrs"] = [g["lr"] for g in trainer.optimizers[0].param_groups]
    result["metrics"] = WORLD.allgather(metrics(trainer))
    result["stage2"] = difference(reference, direct(2, None))
    result["clip_matters"] = difference(direct(2, None, clip=None), reference)
    result["scale_matters"] = difference(direct(2, None, scale=1.0), reference)
    saved = torch.load(ckpts / "epoch=1.ckpt" / "lightning.ckpt", weights_only=False)
    result["saved_full"] = difference({n: saved["state_dict"][n] for n in reference}, reference)
    result["saved_files"] = sorted(p.name for p in ckpts.iterdir())
    trainer.strategy.sharded_optimizer.close()

    trainer, module = lightning_fit("zerompi", kind="sgd")
    result["sgd_stage2"] = difference(final(trainer, module), direct(2, None, kind="sgd"))
    result["sgd_moved"] = difference(final(trainer, module), direct(2, None))  # not AdamW's
    trainer.strategy.sharded_optimizer.close()

    for kind in ("adafactor", "adam8bit", "muon"):  # each as shard() runs it, not as AdamW
        trainer, module = lightning_fit("zerompi", kind=kind)
        result[f"{kind}_stage2"] = difference(final(trainer, module), direct(2, None, kind=kind))
        result[f"{kind}_moved"] = difference(final(trainer, module), direct(2, None))
        result[f"{kind}_rule"] = trainer.strategy.sharded_optimizer.zero.hyperparameters()["rule"]
        trainer.strategy.sharded_optimizer.close()

    trainer, module = lightning_fit(ZeroMPIStrategy(stage=3, shared_memory=False))
    trained3 = final(trainer, module)
    result["stage3_empty_outside"] = all(p.numel() == 0 for p in module.parameters())
    result["stage3"] = difference(trained3, direct(3, False))
    trainer.save_checkpoint(OUT / "stage3")
    saved = torch.load(OUT / "stage3" / "lightning.ckpt", weights_only=False)
    result["stage3_saved_full"] = difference({n: saved["state_dict"][n] for n in trained3},
                                             trained3)  # fmt: skip
    trainer.strategy.sharded_optimizer.close()
    result["collectives"] = WORLD.allgather(checks)
    if WORLD.rank == 0:
        torch.save({"params": reference, "lrs": result["lrs"]}, OUT / "reference.pt")
    return result


def resume() -> dict[str, Any]:
    """Stage 3 on this world size from the stage-2 run's first-epoch checkpoint, the
    global batch kept (``BATCH * 2`` per rank on one rank: the same samples per step)."""
    trainer, module = lightning_fit(ZeroMPIStrategy(stage=3), batch=BATCH * 2 // WORLD.size,
                                    ckpt_path=str(OUT / "ckpts" / "epoch=0.ckpt"))  # fmt: skip
    reference = torch.load(OUT / "reference.pt", weights_only=False)
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    return {"resumed": difference(final(trainer, module), reference["params"]),
            "steps": trainer.global_step, "lrs": lrs,
            "reference_lrs": reference["lrs"]}  # fmt: skip


if __name__ == "__main__":
    out = main() if MODE == "main" else resume()
    if WORLD.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
