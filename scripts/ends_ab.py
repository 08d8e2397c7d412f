"""One staging slot used from both ends, or with a node fence after every sum:
stage 3 (or 2) through node memory with ``overlap=False``, alternated in one run.

    mpiexec -n 2 python scripts/ends_ab.py [--size 64e6] [--rounds 6] [--steps 4]
                                           [--arch gpt|llama] [--stage 3]
                                           [--first ends|after]

The whole-step bench's model (:func:`zerompi.bench.gpt.gpt_config`) built twice with
the same weights, each through ``shard(stage=..., overlap=False)`` on one node: one
with its staging slot used from both ends (:func:`zerompi.reducer.staging_offsets`, as
shipped: one node fence per bucket, and one more where two buckets handed over one
after the other do not fit side by side), one with the node fence after every sum
(``zerompi.reducer.ENDS = False`` while it is built: two fences per bucket). Each
round times ``--steps`` steps of each, in alternating order, after two untimed steps
of each. A step: forward, backward, ``step()``, ``zero_grad()``, from a barrier to
its end, the slowest rank. The optimizer built second measured 1.5-3 % slower here
whichever it was (where its memory lies), so ``--first`` swaps them: run both.
Prints the median step of each, their ratio, the node fences per step of each, and
whether the two models' losses agreed bit for bit.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from mpi4py import MPI

from zerompi import reducer
from zerompi.bench.gpt import gpt_config, make_model, timed_step
from zerompi.mpi.collectives import Comm
from zerompi.runtime import count
from zerompi.torch import shard

FENCES = [0]


def counted_fence(fence):  # type: ignore[no-untyped-def]
    def fenced(self: Comm) -> None:
        FENCES[0] += 1
        fence(self)

    return fenced


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=count, default=64_000_000)
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--stage", type=int, choices=(2, 3), default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--first", choices=("ends", "after"), default="ends",
                   help="which optimizer is built first (the second measured 1.5-3 %% "
                   "slower either way here: run both)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    timer = Comm(comm, timeout=0)  # the timed steps' barrier and slowest rank
    torch.set_num_threads(1)
    cfg = gpt_config(args.size, args.seq)
    Comm.fence = counted_fence(Comm.fence)  # type: ignore[method-assign]
    built = {}
    for side in ("ends", "fence after") if args.first == "ends" else ("fence after", "ends"):
        reducer.ENDS = side == "ends"
        torch.manual_seed(0)
        model = make_model(args.arch, cfg)
        built[side] = shard(model, stage=args.stage, overlap=False, lr=3e-4, weight_decay=0.1)
    reducer.ENDS = True
    params = sum(p.numel() for p in built["ends"][0].parameters())
    steps = {side: 0 for side in built}

    def one_step(side: str) -> tuple[float, int, float]:
        model, opt = built[side]
        steps[side] += 1
        fences = FENCES[0]
        done = timed_step(timer, model, opt, steps[side] - 1, cfg)
        return done["seconds"], FENCES[0] - fences, done["loss"]

    losses: dict[str, list[float]] = {side: [] for side in built}
    for side in built:
        for _ in range(2):
            losses[side].append(one_step(side)[2])
    times: dict[str, list[float]] = {side: [] for side in built}
    fences: dict[str, list[int]] = {side: [] for side in built}
    sides = list(built)
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            for _ in range(args.steps):
                seconds, fenced, loss = one_step(side)
                times[side].append(seconds)
                fences[side].append(fenced)
                losses[side].append(loss)
    for _, opt in built.values():
        opt.close()
    if comm.rank == 0:
        ends, after = (1e3 * statistics.median(times[s]) for s in sides)
        print(f"ends A/B: {args.arch}, {params:,} params, stage {args.stage}, overlap=False, "
              f"built first: {args.first}, "
              f"W={comm.size}, {args.rounds} rounds x {args.steps} steps per side, "
              f"alternated")  # fmt: skip
        print(f"median step ms: ends {ends:.1f}, fence after {after:.1f}, ends/after "
              f"{ends / after:.3f}; node fences per step: ends "
              f"{statistics.median(fences['ends']):.0f}, fence after "
              f"{statistics.median(fences['fence after']):.0f}; losses equal: "
              f"{losses['ends'] == losses['fence after']}")  # fmt: skip


if __name__ == "__main__":
    main()
