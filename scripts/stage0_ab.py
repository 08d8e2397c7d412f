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

A third and fourth turn time the bench's bare baseline of a stage-0 step
(``zerompi.bench``'s ``overhead``): one blocking ``Allreduce`` of a whole P-element
buffer, or one per bucket of the optimizer's layout (``zerompi.mpi.bare``), then the
Adam kernel over P elements; the faster of the two counts, as in the bench.
``overhead`` here is the node-memory step over it, alternated with it instead of
timed minutes apart.
"""

import argparse
import time
from functools import partial

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.bench.baseline import KernelArrays, bucket_pieces, per_bucket
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration
from zerompi.mpi import bare
from zerompi.mpi.collectives import Comm

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
    wrapped = Comm(comm)
    buf = np.zeros(size, f32)
    kernel = KernelArrays.make(size, f32, float(comm.size), 0)
    pieces = bucket_pieces(buf, opts["node memory"].layout)  # the optimizer's buckets
    bare_calls = {"whole": partial(bare.allreduce, wrapped, buf),
                  "per bucket": per_bucket(wrapped, "allreduce", pieces)}  # fmt: skip
    baseline: dict[str, list[float]] = {name: [] for name in bare_calls}
    for i in range(args.steps + 2):
        for name, opt in opts.items():
            comm.Barrier()
            run_iteration(opt, 0, grads, list(grads))
            timings = opt.pop_timings()
            if i >= 2:
                steps[name].append(sum(timings.values()))
                reduce[name].append(timings.get("reduce_scatter", 0.0))
        for name, call in bare_calls.items():
            comm.Barrier()
            start = time.perf_counter()
            call()
            kernel.run()
            if i >= 2:
                baseline[name].append(time.perf_counter() - start)
    del buf, kernel, pieces, bare_calls
    for opt in opts.values():
        opt.close()

    def slowest(values: list[float]) -> float:
        return 1e3 * comm.allreduce(float(np.median(values)), op=MPI.MAX)

    (a, b), (ra, rb) = ([slowest(v[n]) for n in opts] for v in (steps, reduce))
    base = min(slowest(t) for t in baseline.values())  # the faster, as the bench takes
    if comm.rank == 0:
        print(f"stage0_ab: {size:,} parameters, W={comm.size}, {args.steps} steps each: "
              f"Allreduce {a:.2f} ms (reduction {ra:.2f}), node memory {b:.2f} ms "
              f"(reduction {rb:.2f}); step ratio {b / a:.3f}, reduction ratio {rb / ra:.3f}; "
              f"bare Allreduce + kernel {base:.2f} ms, overhead {b / base:.3f}",
              flush=True)  # fmt: skip
