#!/usr/bin/env python3
"""The gradient buffers zeroed after a step by ``zerompi.adam.zero`` (non-temporal
stores) or by numpy's ``fill(0)``, alternated step by step in one process.

    mpiexec -n 2 python scripts/zero_ab.py [--sizes 16e6,64e6] [--stages 0,1] [--steps 20]

One optimizer per stage and size (node shared memory where there is more than one
rank, the bench's model and gradients, ``zerompi.bench``), its iterations (the
gradients copied into ``opt.grads``, then ``step()``, whose ``reduce`` phase holds the
zeroing) alternated between the two ways of zeroing, so that the machine's drift
falls on both alike. Prints each one's median ``step_ms`` (the optimizer's own time,
slowest rank), streamed / fill, and the median of the per-round ratios. Stages 0-1
zero their buffers after the update (stage 0 the whole buffer, stage 1 its own
shard); stages 2-3 through ``opt.add_gradients`` zero nothing.
"""

import argparse

import numpy as np
from mpi4py import MPI

import zerompi.reducer as reducer
from zerompi import ZeroOptimizer, adam
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration
from zerompi.runtime import count

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes", default="16e6,64e6", help="parameters (1e6 notation)")
parser.add_argument("--stages", default="0,1")
parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
args = parser.parse_args()
comm = MPI.COMM_WORLD
f32 = np.dtype(np.float32)
WAYS = {"streamed": adam.zero, "fill": lambda a: a.fill(0)}

for size in (count(x) for x in args.sizes.split(",")):
    sizes = tensor_sizes(size, 1 << 22)
    grads = make_grads(sizes, 0, comm.rank, f32)
    for stage in (int(s) for s in args.stages.split(",")):
        opt = ZeroOptimizer(deferred_model(sizes, 0, f32), comm=comm, stage=stage, lr=1e-3)
        steps: dict[str, list[float]] = {way: [] for way in WAYS}
        for i in range(args.steps + 2):
            for way in WAYS if i % 2 == 0 else list(WAYS)[::-1]:
                reducer.zero = WAYS[way]  # (every rank alike, between two steps)
                comm.Barrier()
                run_iteration(opt, stage, grads, list(grads))
                took = comm.allreduce(sum(opt.pop_timings().values()), op=MPI.MAX)
                if i >= 2:  # two rounds fault in and warm up
                    steps[way].append(took)
        reducer.zero = adam.zero
        opt.close()
        new, old = (1e3 * float(np.median(steps[w])) for w in WAYS)
        rounds = float(np.median(np.array(steps["streamed"]) / np.array(steps["fill"])))
        if comm.rank == 0:
            print(f"zero_ab: {size:,} parameters, stage {stage}, W={comm.size}, {args.steps} "
                  f"steps each: streamed {new:.2f} ms, fill {old:.2f} ms, streamed / fill "
                  f"{new / old:.3f}, per-round median {rounds:.3f}", flush=True)  # fmt: skip
