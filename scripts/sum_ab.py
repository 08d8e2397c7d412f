#!/usr/bin/env python3
"""The within-node sum's compiled loop against another revision's, alternated in one
process: the loop alone over k parts, and the whole step of stages 0-3.

    python scripts/sum_ab.py --rev REV [--parts 2,4,8,16] [--region 1e6]
    mpiexec -n 2 python scripts/sum_ab.py --rev REV [--sizes 16e6] [--steps 20]
    mpiexec -n 16 python scripts/sum_ab.py --parts 16     # this checkout's loop alone

``--rev`` names a git revision whose ``zerompi/_kernels.c`` is compiled here (with
``pyproject.toml``'s flags) into a temporary directory and loaded next to this
checkout's build, so both run in the same process, in turns (the order reversed
every round), and the machine's drift falls on both alike.

* **The loop alone** (every rank at once, each on its own arrays: under ``mpiexec -n
  2`` two cores share the memory, as on a node): ``zerompi.adam.sum_parts`` of ``k``
  parts of ``--region`` float32 elements into a separate output, with the statistics,
  without and with zeroing the parts (``clear``), each part rewritten and the caches
  flushed by a stream over 256 MiB before each sample. A 16-rank node sums k = 16
  parts, each rank its region (a 16M model's shard is 1e6 elements), so k = 16 on
  one core is that node's loop; the node's shared bandwidth it does not emulate.
  Prints each loop's median ms, the bytes it must move (reads of k parts and the
  output written) per second, and the ratio.
* **The whole step** (with two or more ranks on one node): the bench's model and
  gradients (``zerompi.bench``), stages 0-3 through node memory, each step's sums by
  one loop or the other (``zerompi.adam._kernels`` swapped between steps). Prints the
  median ``step_ms`` and reduction phase (slowest rank) of each, and the ratios.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from types import ModuleType

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi import adam as adam_module
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration
from zerompi.runtime import count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: pyproject.toml's extra-compile-args for zerompi._kernels
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]


def build(rev: str, where: str) -> str:
    """``rev``'s ``zerompi/_kernels.c`` compiled into ``where``: the module's path."""
    source = os.path.join(where, "_kernels.c")
    with open(source, "wb") as f:
        f.write(subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:zerompi/_kernels.c"]))
    target = os.path.join(where, "_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = os.environ.get("CC", "cc")
    subprocess.check_call([cc, "-shared", "-fPIC", *FLAGS, "-I", sysconfig.get_paths()["include"],
                           "-o", target, source])  # fmt: skip
    return target


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loop_alone(kernels: dict[str, ModuleType], parts: list[int], region: int, rounds: int,
               comm: MPI.Intracomm) -> None:  # fmt: skip
    flush = np.ones(1 << 26, np.float32)
    for k in parts:
        arrays = [np.full(region, 0.5, np.float32) for _ in range(k)]
        out = np.zeros(region, np.float32)
        for clear in (False, True):
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for r in range(rounds + 1):
                for name in kernels if r % 2 == 0 else list(kernels)[::-1]:
                    for q, a in enumerate(arrays):
                        a.fill(0.5 + q)  # written, as a backward writes its gradients
                    np.add(flush, 1.0, out=flush)
                    comm.Barrier()
                    start = time.perf_counter()
                    kernels[name].sum_parts(out, arrays, False, True, clear=clear,
                                            variant=adam_module.VARIANT)  # fmt: skip
                    took = time.perf_counter() - start
                    if r:
                        times[name].append(took)
            ms = {name: 1e3 * comm.allreduce(float(np.median(t)), op=MPI.MAX)
                  for name, t in times.items()}  # fmt: skip
            nbytes = 4 * region * (k + 1)
            if comm.rank == 0:
                cells = [f"{name} {t:.3f} ms ({nbytes / t / 1e6:.1f} GB/s a rank, "
                         f"{comm.size * nbytes / t / 1e6:.1f} all)" for name, t in ms.items()]
                if len(ms) == 2:
                    (_, ta), (_, tb) = ms.items()
                    cells.append(f"ratio {tb / ta:.3f}")
                print(f"sum_ab: loop alone, {comm.size} core(s) at once, k={k:2d} parts of "
                      f"{region:,}, stats, clear={clear}: " + ", ".join(cells), flush=True)


def whole_step(kernels: dict[str, ModuleType], sizes_arg: str, steps: int,
               comm: MPI.Intracomm) -> None:  # fmt: skip
    f32 = np.dtype(np.float32)
    for size in (count(x) for x in sizes_arg.split(",")):
        sizes = tensor_sizes(size, 1 << 22)
        grads = make_grads(sizes, 0, comm.rank, f32)
        for stage in (0, 1, 2, 3):
            opt = ZeroOptimizer(deferred_model(sizes, 0, f32), comm=comm, stage=stage, lr=1e-3)
            if not opt.shared_memory or opt.nodes.count != 1:
                raise SystemExit("sum_ab: the whole step needs 2+ ranks on one node, node memory")
            step: dict[str, list[float]] = {name: [] for name in kernels}
            reduce: dict[str, list[float]] = {name: [] for name in kernels}
            for i in range(steps + 2):
                for name in kernels if i % 2 == 0 else list(kernels)[::-1]:
                    adam_module._kernels = kernels[name]
                    comm.Barrier()
                    run_iteration(opt, stage, grads, list(grads))
                    timings = opt.pop_timings()
                    if i >= 2:
                        step[name].append(sum(timings.values()))
                        reduce[name].append(timings.get("reduce_scatter", 0.0))
            opt.close()
            (a, b), (ra, rb) = (
                [1e3 * comm.allreduce(float(np.median(v[n])), op=MPI.MAX) for n in kernels]
                for v in (step, reduce)
            )
            if comm.rank == 0:
                na, nb = kernels
                print(f"sum_ab: whole step, {size:,} parameters, stage {stage}, W={comm.size}: "
                      f"{na} {a:.2f} ms (reduction {ra:.2f}), {nb} {b:.2f} ms (reduction "
                      f"{rb:.2f}); step ratio {b / a:.3f}, reduction ratio {rb / ra:.3f}",
                      flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", help="the git revision to compare against (none: this "
                   "checkout's loop alone, no whole step)")
    p.add_argument("--parts", default="2,4,8,16")
    p.add_argument("--region", type=count, default=1_000_000)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--sizes", default="16e6")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if adam_module._kernels is None:
        sys.exit("sum_ab: zerompi._kernels is not built here")
    parts = [int(k) for k in args.parts.split(",")]
    if args.rev is None:  # this checkout's loop alone (a machine without git, too)
        loop_alone({"this checkout": adam_module._kernels}, parts, args.region, args.rounds,
                   comm)  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as where:  # (rank 0's is the one used)
        path = comm.bcast(build(args.rev, where) if comm.rank == 0 else None)
        kernels = {args.rev: load(path), "this checkout": adam_module._kernels}
        comm.Barrier()  # every rank loaded it before rank 0 removes the directory
        loop_alone(kernels, parts, args.region, args.rounds, comm)
        if comm.size > 1:
            whole_step(kernels, args.sizes, args.steps, comm)


if __name__ == "__main__":
    main()
