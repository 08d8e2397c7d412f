"""The C allocator keeping freed memory for the next step, or giving it back to the
kernel: one bench setup's whole step with each, alternated in one run.

    mpiexec -n 2 python scripts/malloc_ab.py [--setup zerompi-3] [--size 64e6]
                                             [--rounds 6] [--steps 4] [--arch gpt]

The whole-step bench's model and setup (``python -m zerompi.bench --model gpt``'s
:func:`zerompi.bench.gpt.build`: ``zerompi-1`` ... ``zerompi-3s``, ``ddp``,
``zero-redundancy``, ``fsdp2``), one optimizer; each round times ``--steps`` steps
with :func:`zerompi.allocator.keep_freed` (``keep``: what ``shard()`` sets) and
``--steps`` with :func:`zerompi.allocator.give_back` (``give back``: glibc as it
comes, but for fixed thresholds), in alternating order, the first step after each
switch untimed. A step: forward, backward, ``step()``, ``zero_grad()``, from a barrier
to its end, the slowest rank. Prints the median step of each side, their ratio, the
page faults per step of each (rank 0), and what one fresh page costs here (a 256 MB
``mmap`` written once per page).
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

from zerompi import allocator
from zerompi.bench.gpt import SETUPS, build, gpt_config, make_model, timed_step
from zerompi.mpi.collectives import Comm
from zerompi.runtime import count


def fresh_page_us(nbytes: int = 256 * 2**20) -> float:
    """Microseconds per 4 KiB page of a fresh anonymous mapping written once per page
    (the fault and the kernel's zeroing), median of three."""
    seconds = []
    for _ in range(3):
        area = mmap.mmap(-1, nbytes)
        view = np.frombuffer(area, np.uint8)
        start = time.perf_counter()
        view[::4096] = 1
        seconds.append(time.perf_counter() - start)
        del view
        area.close()
    return 1e6 * statistics.median(seconds) / (nbytes // 4096)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=SETUPS, default="zerompi-3")
    p.add_argument("--size", type=count, default=64_000_000)
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    timer = Comm(comm, timeout=0)  # the timed steps' barrier and slowest rank
    torch.set_num_threads(1)
    cfg = gpt_config(args.size, args.seq)
    torch.manual_seed(0)
    model = make_model(args.arch, cfg)
    params = sum(p.numel() for p in model.parameters())
    module, opt, what = build(args.setup, model, timer, 120.0)
    step_no = 0

    def one_step() -> tuple[float, int]:
        nonlocal step_no
        step_no += 1
        done = timed_step(timer, module, opt, step_no - 1, cfg)
        return done["seconds"], done["faults"]

    for _ in range(2):
        one_step()
    times: dict[str, list[float]] = {"keep": [], "give back": []}
    faults: dict[str, list[int]] = {"keep": [], "give back": []}
    for r in range(args.rounds):
        for side in ("keep", "give back") if r % 2 == 0 else ("give back", "keep"):
            allocator.keep_freed() if side == "keep" else allocator.give_back()
            one_step()  # the first step after a switch: faults in what is kept
            for _ in range(args.steps):
                seconds, faulted = one_step()
                times[side].append(seconds)
                faults[side].append(faulted)
    allocator.keep_freed()
    if hasattr(opt, "close"):
        opt.close()
    page = fresh_page_us() if comm.rank == 0 else 0.0
    if comm.rank == 0:
        keep, back = (1e3 * statistics.median(times[k]) for k in ("keep", "give back"))
        print(f"malloc A/B: {args.setup} ({what}), {args.arch}, {params:,} params, "
              f"W={comm.size}, {args.rounds} rounds x {args.steps} steps per side, "
              f"alternated")  # fmt: skip
        print(f"median step ms: keep {keep:.1f}, give back {back:.1f}, keep/give back "
              f"{keep / back:.3f}; rank 0's page faults per step: keep "
              f"{statistics.median(faults['keep']):.0f}, give back "
              f"{statistics.median(faults['give back']):.0f}; a fresh page: "
              f"{page:.2f} us")  # fmt: skip


if __name__ == "__main__":
    main()
