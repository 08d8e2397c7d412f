#!/usr/bin/env python3
"""Update rules' whole steps against the first one's, alternated step by step in one
process, at each stage.

    mpiexec -n 2 python scripts/rules_ab.py [--rules adam,adam8bit] [--sizes 16e6]
        [--stages 0,1,2,3] [--steps 20] [--matrix-cols 1024]

One optimizer per rule over the bench's model and gradients (``zerompi.bench``: four
4096 x 1024 matrices at 16M with ``--matrix-cols 1024``), the same data on every
rank, their steps taken in turn (the order reversed every other round), so that the
machine's drift falls on all of them alike, which separate runs minutes apart do not
give on a machine whose memory bandwidth moves (issue 26's 8-bit target, step time
<= 1.1x float32 Adam's, read from ``scripts/bench_optimizers`` runs, swung 0.74-1.48
between runs). Prints per stage each rule's median ``step_ms`` (the optimizer's own
time, slowest rank) and its ratio to the first rule's, and the median of the
per-round ratios.
"""

import argparse

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration
from zerompi.runtime import count

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rules", default="adam,adam8bit", help="the first is the yardstick")
parser.add_argument("--sizes", default="16e6", help="parameters (1e6 notation)")
parser.add_argument("--stages", default="0,1,2,3")
parser.add_argument("--steps", type=int, default=20, help="timed steps of each rule")
parser.add_argument("--matrix-cols", type=int, default=1024)
args = parser.parse_args()
comm = MPI.COMM_WORLD
f32 = np.dtype(np.float32)
rules = args.rules.split(",")

for size in (count(x) for x in args.sizes.split(",")):
    sizes = tensor_sizes(size, 1 << 22)
    grads = make_grads(sizes, 0, comm.rank, f32, args.matrix_cols)
    for stage in (int(s) for s in args.stages.split(",")):
        opts = {
            rule: ZeroOptimizer(deferred_model(sizes, 0, f32, args.matrix_cols), comm=comm,
                                stage=stage, lr=1e-3, optimizer=rule)
            for rule in rules
        }  # fmt: skip
        steps: dict[str, list[float]] = {rule: [] for rule in rules}
        for i in range(args.steps + 2):
            order = rules if i % 2 == 0 else rules[::-1]
            for rule in order:
                opt = opts[rule]
                comm.Barrier()
                run_iteration(opt, stage, grads, list(grads))
                took = comm.allreduce(sum(opt.pop_timings().values()), op=MPI.MAX)
                if i >= 2:  # two rounds fault in and warm up
                    steps[rule].append(took)
        for opt in opts.values():
            opt.close()
        del opts
        if comm.rank == 0:
            first = rules[0]
            base = float(np.median(steps[first]))
            cells = []
            for rule in rules:
                med = float(np.median(steps[rule]))
                paired = float(np.median(np.array(steps[rule]) / np.array(steps[first])))
                cells.append(f"{rule} {1e3 * med:.2f} ms ({med / base:.3f}; per round "
                             f"{paired:.3f})")  # fmt: skip
            print(f"rules_ab: {size:,} parameters, stage {stage}, W={comm.size}, "
                  f"{args.steps} steps each: " + ", ".join(cells), flush=True)
