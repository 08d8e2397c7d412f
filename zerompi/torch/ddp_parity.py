"""Parity of ``zerompi.torch.shard`` with torch's own DDP, as a table.

    mpiexec -n W python -m zerompi.torch.ddp_parity [--steps 5]

The same processes train the parity model of :mod:`zerompi.torch.parity` twice: with
``torch.nn.parallel.DistributedDataParallel`` on a gloo group of the same ranks
(:func:`zerompi.torch.gloo.init_gloo`) and ``torch.optim.AdamW`` / ``Adam`` (+ L2) /
AdamW over two parameter groups, and with :func:`zerompi.torch.shard` at every stage.
Both sides start from rank-dependent initial values (each must take rank 0's), see
each rank's slice of every global micro-batch, accumulate two ``backward()`` calls per step (DDP
reduces on the second, under ``no_sync()`` for the first, as a DDP user writes it)
and follow a ``StepLR`` schedule: the setting of :func:`zerompi.torch.parity.compare`,
whose reference is one process on the global batch; this one is DDP itself.

Reported per stage and optimizer: the largest difference of any final parameter,
relative to that parameter's largest magnitude, and of any micro-batch's loss,
relative to DDP's loss (max over ranks). ``tests/test_torch_ddp.py`` requires ≤ 1e-5.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from ._shard import shard
from .gloo import init_gloo
from .parity import (
    ROWS,
    VARIANTS,
    batch,
    cli,
    differences,
    loss_of,
    make_model,
    param_groups,
)

#: Every stage zerompi has.
STAGES = (0, 1, 2, 3)
LR, WEIGHT_DECAY, BUCKET_ELEMS = 3e-2, 0.05, 40  # as zerompi.torch.parity.compare


def _optimizer(model: torch.nn.Module, optimizer: Any, decoupled: bool, groups: bool) -> Any:
    """``optimizer`` (``None``: torch's AdamW / Adam) and its ``StepLR``."""
    if optimizer is None:
        params = param_groups(model) if groups else [p for p in model.parameters()
                                                      if p.requires_grad]  # fmt: skip
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        optimizer = cls(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _train(
    rank: int, world: int, module: torch.nn.Module, optimizer: Any, steps: int, ddp: bool
) -> list[float]:
    """The training loop both sides share; this rank's loss of every micro-batch."""
    optimizer, scheduler = optimizer
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    losses = []
    for step in range(steps):
        for micro in range(2):
            idx, target = batch(step, micro, world)
            quiet = ddp and micro == 0
            with module.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                loss = loss_of(module, idx[mine], target[mine])
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def train_ddp(
    comm: Any, decoupled: bool, groups: bool = False, steps: int = 5
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Collective over ``comm``: torch DDP (gloo, the group of ``comm``'s ranks) with
    AdamW / Adam; the final trainable parameters and this rank's losses."""
    c = init_gloo(comm)
    rank, world = c.rank(), c.size()
    model = make_model(rank)  # DDP broadcasts rank 0's parameters and buffers
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=c)
    losses = _train(rank, world, ddp, _optimizer(model, None, decoupled, groups), steps, True)
    final = {n: p.detach().numpy().copy() for n, p in model.named_parameters()
             if p.requires_grad}  # fmt: skip
    return final, losses


def train_zerompi(
    comm: Any, stage: int, decoupled: bool, groups: bool = False, steps: int = 5
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Collective over ``comm``: ``zerompi.torch.shard`` at ``stage``; the final
    trainable parameters (:meth:`zerompi.ZeroOptimizer.full_params`, so at any stage)
    and this rank's losses."""
    rank, world = comm.rank, comm.size
    model = make_model(rank)
    model, opt = shard(model, stage=stage, comm=comm, lr=LR, weight_decay=WEIGHT_DECAY,
                       decoupled_weight_decay=decoupled, bucket_elems=BUCKET_ELEMS,
                       param_groups=param_groups(model) if groups else None)  # fmt: skip
    try:
        losses = _train(rank, world, model, _optimizer(model, opt, decoupled, groups), steps,
                        False)  # fmt: skip
        return opt.zero.full_params(), losses
    finally:
        opt.close()


def compare_ddp(
    comm: Any,
    stage: int,
    decoupled: bool,
    groups: bool = False,
    steps: int = 5,
    ddp: tuple[dict[str, np.ndarray], list[float]] | None = None,
) -> dict[str, Any]:
    """Collective over ``comm`` (needs a gloo group of its ranks: :func:`init_gloo`
    is called, and returns the active one if it was made for ``comm``). This rank's
    differences between DDP and zerompi at ``stage``: per parameter ``(absolute,
    relative)``, and the largest absolute and relative loss difference.
    ``ddp``: :func:`train_ddp`'s result for the same arguments, when the caller has
    it already (it does not depend on the stage); trained here otherwise."""
    mine, mine_losses = train_zerompi(comm, stage, decoupled, groups, steps)
    theirs, losses = ddp if ddp is not None else train_ddp(comm, decoupled, groups, steps)
    loss_abs = [abs(a - b) for a, b in zip(mine_losses, losses, strict=True)]
    loss_rel = [d / max(abs(b), 1e-30) for d, b in zip(loss_abs, losses, strict=True)]
    return {"diffs": differences(mine, theirs), "loss_abs": max(loss_abs),
            "loss_rel": max(loss_rel), "losses": (mine_losses, losses)}  # fmt: skip


def worst(comm: Any, result: dict[str, Any]) -> dict[str, float]:
    """Collective: :func:`compare_ddp`'s result reduced to the largest parameter and
    loss differences over the parameters and ``comm``'s ranks."""
    from ..mpi.collectives import Comm

    c = Comm(comm, timeout=0)
    own = [max(d[0] for d in result["diffs"].values()), max(d[1] for d in result["diffs"].values()),
           result["loss_abs"], result["loss_rel"]]  # fmt: skip
    keys = ("param_abs", "param_rel", "loss_abs", "loss_rel")
    return {k: c.max(v) for k, v in zip(keys, own, strict=True)}


def main(argv: list[str] | None = None) -> None:
    """Print one row per stage: DDP-vs-zerompi parameter / loss differences."""
    args, comm = cli(argv, __doc__.splitlines()[0])
    init_gloo(comm.mpi)
    if comm.rank == 0:
        print(f"zerompi.torch vs torch DDP (gloo): W={comm.size}, torch {torch.__version__}, "
              f"float32, {args.steps} steps of 2 backward() each; max relative difference "
              "of any parameter / of any micro-batch's loss, over ranks")  # fmt: skip
        print("| stage | " + " | ".join(name for _, _, name in VARIANTS) + " |")
        print("|---:|" + "---|" * len(VARIANTS))
    ddp = [train_ddp(comm.mpi, decoupled, groups, args.steps) for decoupled, groups, _ in VARIANTS]
    for stage in STAGES:
        cells = []
        for (decoupled, groups, _), ref in zip(VARIANTS, ddp, strict=True):
            result = compare_ddp(comm.mpi, stage, decoupled, groups, args.steps, ref)
            result = worst(comm.mpi, result)
            cells.append(f"{result['param_rel']:.1e} / {result['loss_rel']:.1e}")
        if comm.rank == 0:
            print(f"| {stage} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
