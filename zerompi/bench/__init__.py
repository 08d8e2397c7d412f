"""Benchmark of the optimizer side of a training step, against bare MPI and torch.

Run as ``mpiexec -n W python -m zerompi.bench [--sizes 1e6,1.6e7,6.4e7] [--json PATH]``.

What it measures, for every model size P and stage, with the same synthetic model
(float tensors of at most ``--tensor-elems`` elements summing to exactly P, the same
initial values on every rank, a different gradient per rank prepared once):

* ``step_ms`` and ``wall_ms`` of our optimizer (:mod:`.timing`);
* the bare-MPI baseline of the same bytes and the ``overhead`` ratio, the Adam
  kernel's elements/s on one core against the copy-bandwidth roofline
  (:mod:`.baseline`);
* ``floor_ms``, the bytes the step's data flow must read and write at minimum over
  the memory bandwidth all ranks reach streaming together (measured once per run),
  and ``step_per_floor = step_ms / floor_ms`` (:mod:`.floor`);
* where torch is installed (and not ``--no-torch``), a flat-buffer DDP and
  ``ZeroRedundancyOptimizer`` on gloo, and torch's fused Adam (:mod:`.peers`);

and then, with ``--tensors N`` (default 1000), a model of N one-tensor layers of
``--tensor-size`` elements, stage by stage, with the optimizer's cost per tensor per
step above the bare collectives (:mod:`.tensors`): per-tensor Python overhead stays
measured.

Why: the issue asks for one reproducible run that shows where the time of a ZeRO step
goes and how far it is from what the machine and the MPI library can do at best.
Targets are reported, never asserted: timings on a shared machine are noisy.

Everything collective runs identically on every rank; rank 0 prints a table and writes
the JSON (``--json``) and a PNG plot (``--plot``; needs matplotlib, the ``bench``
extra) (:mod:`.report`); their folders are made before anything is measured
(:mod:`.cli`). Every MPI call goes through :mod:`zerompi.mpi`: the baseline's bare
collectives and the idle wait through :mod:`zerompi.mpi.bare`, the rest through
:class:`zerompi.mpi.collectives.Comm`. What the benchmark shares with the driver is in
:mod:`zerompi.runtime`.
"""

from .baseline import baseline_ms, bench_baseline, copy_roofline, measure_kernel
from .cli import build_parser, main, parse_args
from .floor import floor_bytes, floor_fields, fused_floor_bytes, stream_bandwidth
from .model import deferred_model, init_tensor, make_grads, tensor_sizes
from .report import plot, table, targets
from .run import bench_size, run
from .tensors import bench_many_tensors
from .timing import bench_stage, run_iteration

__all__ = [
    "baseline_ms",
    "bench_baseline",
    "bench_many_tensors",
    "bench_size",
    "bench_stage",
    "build_parser",
    "copy_roofline",
    "deferred_model",
    "floor_bytes",
    "floor_fields",
    "fused_floor_bytes",
    "init_tensor",
    "main",
    "make_grads",
    "measure_kernel",
    "parse_args",
    "plot",
    "run",
    "run_iteration",
    "stream_bandwidth",
    "table",
    "targets",
    "tensor_sizes",
]
