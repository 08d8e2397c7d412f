"""Stage 3's prefetch (or its spare storages) in the torch adapter, on and off,
alternated in one run.

    mpiexec -n 2 python scripts/prefetch_ab.py [--size 16e6] [--rounds 6] [--steps 4]
                                               [--arch gpt|llama] [--toggle spares]
                                               [--keep-memory]

The whole-step bench's model (``python -m zerompi.bench --model gpt``'s
:func:`zerompi.bench.gpt.gpt_config`, or its ``--arch llama``) through
``shard(stage=3, shared_memory=False)``: every module's parameters gathered before its
forward and its backward. One optimizer; each round times ``--steps`` steps with the
prefetch on (the buckets of at least ``PREFETCH_MIN_ELEMS`` elements gathered ahead,
as shipped) and ``--steps`` with it off (every gather blocking), in alternating order
(on-off, off-on, ...), after two untimed steps. A step: forward, backward, ``step()``,
``zero_grad()``, from a barrier to its end, the slowest rank. Prints the median step
of each side, their ratio and the gathers served ahead per step. ``--toggle spares``
switches the other thing instead: the released buckets' memory kept for the next
gathers (:class:`zerompi.torch._units.Spares`, as shipped) or given back to the C
library every time (off); it also prints the page faults per step of each side.
``--toggle spares`` builds with ``shard(keep_memory=False)`` (the C allocator as it
comes), or with ``--keep-memory`` under ``shard()``'s default (the allocator keeping
freed memory, :mod:`zerompi.allocator`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from mpi4py import MPI

from zerompi.bench.gpt import gpt_config, make_model, timed_step
from zerompi.mpi.collectives import Comm
from zerompi.runtime import count
from zerompi.torch import shard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=count, default=16_000_000)
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--toggle", choices=("prefetch", "spares"), default="prefetch")
    p.add_argument("--keep-memory", action="store_true",
                   help="--toggle spares under shard()'s keep_memory=True")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    timer = Comm(comm, timeout=0)  # the timed steps' barrier and slowest rank
    torch.set_num_threads(1)
    cfg = gpt_config(args.size, args.seq)
    torch.manual_seed(0)
    model = make_model(args.arch, cfg)
    params = sum(p.numel() for p in model.parameters())
    model, opt = shard(model, stage=3, shared_memory=False, lr=3e-4, weight_decay=0.1,
                       keep_memory=args.toggle != "spares" or args.keep_memory)  # fmt: skip
    units = opt.units
    shipped, kept = list(units.worth), units.spares.limit
    step_no = 0

    def one_step() -> tuple[float, int]:
        nonlocal step_no
        step_no += 1
        done = timed_step(timer, model, opt, step_no - 1, cfg)
        return done["seconds"], done["faults"]

    for _ in range(2):
        one_step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    faults: dict[str, list[int]] = {"on": [], "off": []}
    served: list[int] = []
    for r in range(args.rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            if args.toggle == "prefetch":
                units.worth = shipped if side == "on" else [False] * len(shipped)
            else:
                units.spares.limit = kept if side == "on" else 0
                units.spares.clear()
            one_step()  # the first step after a switch follows the order learned before
            for _ in range(args.steps):
                before = units.prefetched
                seconds, faulted = one_step()
                times[side].append(seconds)
                faults[side].append(faulted)
                if side == "on":
                    served.append(units.prefetched - before)
    opt.close()
    if comm.rank == 0:
        on, off = (1e3 * statistics.median(times[k]) for k in ("on", "off"))
        print(f"{args.toggle} A/B{' (keep_memory)' if args.keep_memory else ''}: "
              f"{args.arch}, {params:,} "
              f"params, W={comm.size}, {len(units.worth)} buckets "
              f"({sum(shipped)} prefetchable), {args.rounds} rounds x {args.steps} steps "
              f"per side, alternated")  # fmt: skip
        print(f"median step ms: {args.toggle} on {on:.1f}, off {off:.1f}, on/off "
              f"{on / off:.3f}; gathers served ahead per step: "
              f"{statistics.median(served):.0f}; rank 0's page faults per step: on "
              f"{statistics.median(faults['on']):.0f}, off "
              f"{statistics.median(faults['off']):.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
