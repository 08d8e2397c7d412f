#!/usr/bin/env python3
"""Stage 0 with its gradients summed in node shared memory against MPI's Allreduce,
alternated step by step in one process.

    mpiexec -n 2 python scripts/stage0_ab.py [--sizes 16e6,64e6] [--steps 30]

Two stage-0 optimizers over the bench's model and gradients (``zerompi.bench``):
``shared_memory=False`` (a blocking ``Allreduce`` per bucket, then the statistics over
this rank's shard and the zeroing after Adam) and the default on one node (each rank
sums its shard from every rank's buffer with the statistics in the same pass, then
copies the others' sums: ``zerompi.nodesum.NodeCopies``). Their steps alternate, so
the machine's drift falls on both alike; prints each one's median ``step_ms`` (the
optimizer's own time, slowest rank), its reduction phase, and the ratios. Needs at
least two ranks on one node.
"""

import argparse

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes", default="16e6,64e6", help="parameters (1e6 notation)")
parser.add_argument("--steps", type=int, default=30, help="timed steps of each")
args = parser.parse_args()
comm = MPI.COMM_WORLD
f32 = np.dtype(np.float32)

for size in (int(float(x)) for x in args.sizes.split(",")):
    sizes = tensor_sizes(size, 1 << 22)
    grads = make_grads(sizes, 0, comm.rank, f32)
    opts = {
        "Allreduce": ZeroOptimizer(deferred_model(sizes, 0, f32), comm=comm, stage=0,
                                   lr=1e-3, shared_memory=False),
        "node memory": ZeroOptimizer(deferred_model(sizes, 0, f32), comm=comm, stage=0,
                                     lr=1e-3),
    }  # fmt: skip
    if not opts["node memory"].shared_memory:
        raise SystemExit("stage0_ab: stage 0 does not use node memory here (one rank?)")
    steps = {name: [] for name in opts}
    reduce = {name: [] for name in opts}
    for i in range(args.steps + 2):
        for name, opt in opts.items():
            comm.Barrier()
            run_iteration(opt, 0, grads, list(grads))
            timings = opt.pop_timings()
            if i >= 2:
                steps[name].append(sum(timings.values()))
                reduce[name].append(timings.get("reduce_scatter", 0.0))
    for opt in opts.values():
        opt.close()

    def slowest(values: list[float]) -> float:
        return 1e3 * comm.allreduce(float(np.median(values)), op=MPI.MAX)

    (a, b), (ra, rb) = ([slowest(v[n]) for n in opts] for v in (steps, reduce))
    if comm.rank == 0:
        print(f"stage0_ab: {size:,} parameters, W={comm.size}, {args.steps} steps each: "
              f"Allreduce {a:.2f} ms (reduction {ra:.2f}), node memory {b:.2f} ms "
              f"(reduction {rb:.2f}); step ratio {b / a:.3f}, reduction ratio {rb / ra:.3f}",
              flush=True)  # fmt: skip
