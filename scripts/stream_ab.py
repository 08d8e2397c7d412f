#!/usr/bin/env python3
"""Stages 2-3's within-node sum writing the gradient shard plainly or streamed
(non-temporal stores), alternated in one process.

    mpiexec -n 2 python scripts/stream_ab.py [--sizes 16e6,64e6] [--stages 2,3]
        [--optimizer adam] [--steps 20]

One optimizer per stage and size (node shared memory, the bench's model and
gradients, ``zerompi.bench``; four 4096 x 1024 matrices at 16M); its iterations (every
gradient handed over through ``opt.add_gradients``, as the bench does, then
``step()``) alternate between ``NodeSum.stream`` off and on, so the machine's drift
falls on both alike. Prints each one's median wall time of the whole iteration (the
slowest rank's) and streamed / plain. Needs at least two ranks on one node.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.reduction import NodeReduce

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes", default="16e6,64e6", help="parameters (1e6 notation)")
parser.add_argument("--stages", default="2,3")
parser.add_argument("--optimizer", default="adam")
parser.add_argument("--steps", type=int, default=20, help="timed iterations of each")
args = parser.parse_args()
comm = MPI.COMM_WORLD
f32 = np.dtype(np.float32)


def iteration(opt: ZeroOptimizer, stage: int) -> None:
    """The bench's iteration through ``add_gradients`` (stage 3 gathers each tensor in
    the forward and again in the backward)."""
    if stage == 3:
        for name in names:
            with opt.gathered(name):
                pass
    for name in reversed(names):
        if stage == 3:
            with opt.gathered(name):
                opt.add_gradients({name: grads[name]})
        else:
            opt.add_gradients({name: grads[name]})
    opt.step()


for size in (int(float(x)) for x in args.sizes.split(",")):
    sizes = tensor_sizes(size, 1 << 22)
    grads = make_grads(sizes, 0, comm.rank, f32)
    names = list(grads)
    for stage in (int(s) for s in args.stages.split(",")):
        opt = ZeroOptimizer(deferred_model(sizes, 0, f32, 1024), comm=comm, stage=stage,
                            optimizer=args.optimizer, lr=1e-3)  # fmt: skip
        sums = [b.node_sum for b in opt.engine.reducer.backends if isinstance(b, NodeReduce)]
        if not sums:
            raise SystemExit("stream_ab: no sum within a node here (one rank, or no /dev/shm)")
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.steps + 2):
            for stream in (False, True) if i % 2 == 0 else (True, False):
                for node_sum in sums:  # every rank alike, between two steps
                    node_sum.stream = stream
                comm.Barrier()
                start = time.perf_counter()
                iteration(opt, stage)
                took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if i >= 2:
                    times[stream].append(took)
        opt.close()
        plain, streamed = (1e3 * float(np.median(times[s])) for s in (False, True))
        if comm.rank == 0:
            print(f"stream_ab: {size:,} parameters, {args.optimizer}, stage {stage}, "
                  f"W={comm.size}, {args.steps} iterations each: plain {plain:.2f} ms, "
                  f"streamed {streamed:.2f} ms, streamed / plain {streamed / plain:.3f}",
                  flush=True)  # fmt: skip
