"""A small GPT-style language model trained with zerompi.torch on data it generates.

    mpiexec -n 4 python scripts/gpt.py --stage 3 [--steps 200 --layers 2 --dim 128 ...]

The model: token and position embeddings, ``--layers`` pre-norm blocks (causal
self-attention through ``scaled_dot_product_attention``, a GELU MLP), a final
LayerNorm and an output head tied to the token embedding; AdamW over two parameter
groups (matrices decay, biases/norms/position embeddings do not), linear warm-up then
cosine decay (``torch.optim.lr_scheduler.LambdaLR``). The data: each sequence is a
random run of ``--seq // 2`` tokens written twice, so the second half can be
predicted from the first (copying, which attention learns in a few hundred steps:
the loss on the second half falls from about ln(vocab) towards 0; on the first half it
cannot fall below ln(vocab)). Each rank draws its own rows of every global batch.
Rank 0 prints the loss (mean over the ranks) and tokens per second. The model and the
data are :mod:`zerompi.torch.gpt`'s (also timed by ``python -m zerompi.bench --model gpt``).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

from zerompi.torch import shard
from zerompi.torch.gpt import GPT, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--every", type=int, default=20, help="print every this many steps")
    parser.add_argument("--optimizer", choices=["adam", "adam8bit"], default="adam",
                        help="AdamW, or AdamW with 8-bit states (zerompi.rules)")
    parser.add_argument("--json", default=None,
                        help="write every step's loss (mean over the ranks) here (rank 0)")
    parser.add_argument("--param-dtype", choices=["bfloat16"], default=None,
                        help="compute in bfloat16 (float32 master, float32 reduction)")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="no node copy of the parameters: stage 3 then gathers each "
                             "module's parameters before its forward and backward")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    trainable = list(model.parameters())
    n = sum(p.numel() for p in trainable)  # (counted before stage 3 empties them)
    decay = [p for p in trainable if p.dim() >= 2 and p is not model.pos]
    no_decay = [p for p in trainable if p.dim() < 2] + [model.pos]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    model, opt = shard(model, stage=args.stage, optimizer=args.optimizer, lr=args.lr,
                       weight_decay=0.1,
                       betas=(0.9, 0.95), param_groups=groups, max_norm=1.0,
                       param_dtype=args.param_dtype,
                       shared_memory=False if args.no_shared_memory else None)  # fmt: skip
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))  # fmt: skip
    if comm.rank == 0:
        print(f"gpt: {n:,} parameters, stage {args.stage}, {comm.size} rank(s), "
              f"{args.rows * comm.size} sequences of {args.seq} tokens per step")  # fmt: skip
    start, tokens = time.perf_counter(), 0
    half = args.seq // 2
    curve = []
    for step in range(args.steps):
        data = batch(step, comm.rank, args.rows, args.seq, args.vocab)
        logits = model(data[:, :-1]).float()
        losses = F.cross_entropy(logits.transpose(1, 2), data[:, 1:], reduction="none")
        losses.mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        tokens += args.rows * args.seq * comm.size
        if args.json:
            curve.append(comm.allreduce(losses.mean().item()) / comm.size)
        if step % args.every == 0 or step == args.steps - 1:
            second = comm.allreduce(losses[:, half:].mean().item()) / comm.size
            whole = comm.allreduce(losses.mean().item()) / comm.size
            rate = tokens / (time.perf_counter() - start)
            if comm.rank == 0:
                print(f"step {step:4d}  loss {whole:.3f}  second half {second:.3f}  "
                      f"{rate:,.0f} tokens/s")  # fmt: skip
    opt.close()
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"optimizer": args.optimizer, "stage": args.stage, "ranks": comm.size,
                       "parameters": n, "losses": curve}, f)  # fmt: skip


if __name__ == "__main__":
    main()
