"""Parity of ``zerompi.torch.shard`` with single-process torch, as a table.

    mpiexec -n W python -m zerompi.torch.parity [--steps 5]

Trains a small model with what real models have (an embedding tied to the output
head, a residual MLP block, a frozen layer, LayerNorm, a buffer) at every
stage with AdamW and with Adam + L2, each rank on its slice of every global
micro-batch, two ``backward()`` calls per step and a ``StepLR`` schedule, and with
AdamW over two parameter groups (decay and no decay, two learning rates); a copy of
the model trains in every process on the whole global batch with
``torch.optim.AdamW`` / ``Adam``. Prints, per stage and optimizer, the largest
difference of any parameter to the reference, absolute and relative to the
parameter's largest magnitude. ``tests/test_torch.py`` requires relative ≤ 1e-5.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ._shard import shard

VOCAB, DIM, ROWS = 13, 8, 3  # ROWS per rank and micro-batch
#: (decoupled weight decay, two parameter groups, name)
VARIANTS = ((True, False, "AdamW"), (False, False, "Adam+L2"), (True, True, "AdamW 2 groups"))


class Tiny(torch.nn.Module):
    """Embedding, a residual MLP block, a frozen linear layer, LayerNorm, a buffer,
    and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(DIM)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two modules

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(torch.tanh(self.up(h)))
        h = self.norm(self.frozen(h)) * self.scale.to(h.dtype)
        return self.head(h)


def make_model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch: ``world * ROWS`` (input, target) token pairs."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (world * ROWS,), generator=g)
    return idx, torch.randint(0, VOCAB, (world * ROWS,), generator=g)


def loss_of(model: torch.nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(idx), target)


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The usual two groups: matrices decay, vectors (biases, norms) do not and take
    a smaller learning rate here."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    vectors = [p for p in trainable if p.dim() < 2]
    return [{"params": [p for p in trainable if p.dim() >= 2]},
            {"params": vectors, "weight_decay": 0.0, "lr": 1e-2}]  # fmt: skip


def differences(got: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Per name in ``want``: the largest absolute difference of ``got[name]`` (tensors
    or arrays alike) and that relative to ``want[name]``'s largest magnitude."""
    out = {}
    for name, ref in want.items():
        a, b = torch.as_tensor(got[name]).detach(), torch.as_tensor(ref).detach()
        diff = (a - b).abs().max().item()
        out[name] = (diff, diff / max(b.abs().max().item(), 1e-30))
    return out


def cli(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, Any]:
    """The parity tables' command line (``--steps``), one thread per rank, and the
    world's :class:`zerompi.mpi.collectives.Comm`."""
    from ..mpi.collectives import Comm

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return args, Comm(None, timeout=0)


def compare(
    comm: Any, stage: int, decoupled: bool, steps: int = 5, groups: bool = False,
    shared_memory: bool | None = None, overlap: bool | None = None,
) -> dict[str, Any]:
    """Collective over ``comm``: train both; per parameter ``(absolute, relative)``
    difference to the reference, the two final learning rates, and whether the
    buffers are rank 0's. Rank-dependent initial values: ``shard`` must take rank
    0's everywhere. ``groups``: with :func:`param_groups` on both sides; ``overlap``:
    ``shard``'s (its staging slots)."""
    rank, world = comm.rank, comm.size
    model = make_model(rank)
    model, opt = shard(model, stage=stage, comm=comm, lr=3e-2, weight_decay=0.05,
                       decoupled_weight_decay=decoupled, bucket_elems=40,
                       param_groups=param_groups(model) if groups else None,
                       shared_memory=shared_memory, overlap=overlap)  # fmt: skip
    ref = make_model(0)
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref_params = param_groups(ref) if groups else [p for p in ref.parameters() if p.requires_grad]
    ref_opt = ref_cls(ref_params, lr=3e-2, weight_decay=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(steps):
        for micro in range(2):
            idx, target = batch(step, micro, world)
            loss_of(model, idx[mine], target[mine]).backward()
            loss_of(ref, idx, target).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for sched in scheds:
            sched.step()
    with opt.full_parameters():  # (stage 3: gathered for the comparison)
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    diffs = differences(got, dict(ref.named_parameters()))
    buffers = dict(model.named_buffers())
    same = all(torch.equal(buffers[n], b) for n, b in ref.named_buffers())
    lrs = ([opt.zero.engine.configs[i].lr for i in opt.zero_groups], scheds[1].get_last_lr())
    opt.close()
    return {"diffs": diffs, "lrs": lrs, "buffers_from_rank_0": same}


def compare_low(
    comm: Any, stage: int, param_dtype: torch.dtype, steps: int = 5,
    shared_memory: bool | None = None, decoupled: bool = True,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Collective: :func:`compare` for a ``param_dtype`` run (float32 master; AdamW,
    or Adam + L2 with ``decoupled=False``; ``reduce_dtype`` as given: never summed
    in 16 bits, so the reference is the same). The reference is FSDP2's
    mixed-precision semantics computed in one process: a ``param_dtype`` copy of the
    float32 master computes each rank's slice of each micro-batch in turn, the
    gradients are summed in float32 (per rank over the micro-batches, then over
    ranks) and averaged, and ``torch.optim.AdamW`` (``Adam``) updates the master.
    Per parameter ``(absolute, relative)`` difference of the masters, and whether the
    module's parameters are exactly the master rounded."""
    rank, world = comm.rank, comm.size
    model, opt = shard(make_model(rank), stage=stage, comm=comm, lr=3e-2, weight_decay=0.05,
                       decoupled_weight_decay=decoupled, bucket_elems=40,
                       param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       shared_memory=shared_memory)  # fmt: skip
    ref, low = make_model(0), make_model(0).to(param_dtype)
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref_opt = ref_cls(list(trainable.values()), lr=3e-2, weight_decay=0.05)
    low_params = dict(low.named_parameters())
    for step in range(steps):
        for micro in range(2):
            idx, target = batch(step, micro, world)
            mine = slice(rank * ROWS, (rank + 1) * ROWS)
            loss_of(model, idx[mine], target[mine]).backward()
        totals = {n: torch.zeros_like(p) for n, p in trainable.items()}
        with torch.no_grad():
            for name, p in trainable.items():
                low_params[name].copy_(p)  # rounded to param_dtype
        for r in range(world):
            acc = {n: torch.zeros_like(p) for n, p in trainable.items()}
            for micro in range(2):
                idx, target = batch(step, micro, world)
                rows = slice(r * ROWS, (r + 1) * ROWS)
                low.zero_grad()
                loss_of(low, idx[rows], target[rows]).backward()
                for n in acc:
                    acc[n] += low_params[n].grad.float()
            for n in totals:
                totals[n] += acc[n]
        for n, p in trainable.items():
            p.grad = totals[n] / world
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    masters = opt.zero.full_params()
    diffs = differences(masters, trainable)
    with opt.full_parameters():
        rounded = all(torch.equal(p, torch.from_numpy(masters[n]).to(param_dtype))
                      for n, p in model.named_parameters() if p.requires_grad)  # fmt: skip
    opt.close()
    return {"diffs": diffs, "rounded": rounded}


#: (stage, shared_memory, label): stage 3 with the node's copy of the parameters
#: (the default on one node with W > 1) and without it ("3s": per-module storages).
MODES = ((0, None, "0"), (1, None, "1"), (2, None, "2"), (3, None, "3"), (3, False, "3s"))
#: (decoupled weight decay, reduce dtype, name) of the bfloat16 ``param_dtype`` rows.
LOW_VARIANTS = ((True, None, "AdamW bf16"), (False, None, "Adam+L2 bf16"),
                (True, torch.bfloat16, "AdamW bf16/bf16"))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args, comm = cli(argv, __doc__.splitlines()[0])
    if comm.rank == 0:
        print(f"zerompi.torch parity: W={comm.size}, torch {torch.__version__}, "
              f"{args.steps} steps of 2 backward() each; max over parameters, ranks. "
              "bf16 rows: param_dtype=bfloat16 (/bf16: reduce_dtype too), masters "
              "against FSDP2's mixed-precision semantics in one process")  # fmt: skip
        print(f"{'stage':>5} {'optimizer':>16} {'max abs diff':>13} {'max rel diff':>13}")
    for stage, shared, label in MODES:
        runs = [(name, partial(compare, comm.mpi, stage, d, args.steps, g, shared))
                for d, g, name in VARIANTS]  # fmt: skip
        runs += [(name, partial(compare_low, comm.mpi, stage, torch.bfloat16, args.steps,
                                shared, d, r)) for d, r, name in LOW_VARIANTS]  # fmt: skip
        for name, run in runs:
            result = run()
            worst = [comm.max(max(d[i] for d in result["diffs"].values())) for i in (0, 1)]
            if comm.rank == 0:
                print(f"{label:>5} {name:>16} {worst[0]:>13.3g} {worst[1]:>13.3g}")


if __name__ == "__main__":
    main()
