"""Benchmark of the optimizer side of a training step, against bare MPI and torch.

Run as ``mpiexec -n W python -m zerompi.bench [--sizes 1e6,1.6e7,6.4e7] [--json PATH]``.

What it measures, for every model size P and stage, with the same synthetic model
(float tensors of at most ``--tensor-elems`` elements summing to exactly P, the same
initial values on every rank, a different gradient per rank prepared once):

* ``step_ms``: the median over ``--steps`` timed iterations of the optimizer's own
  time (``opt.pop_timings()``: reduction, Adam, gather), the slowest rank's median.
  Stages 0-1 copy the gradients into ``opt.grads`` (standing for the backward, not
  counted) and call ``opt.step()``; stages 2-3 hand each tensor over in reverse order
  with ``opt.gradients()`` (reduce-scattered bucket by bucket) and call ``opt.step()``;
  stage 3 also gathers every tensor twice with ``opt.gathered()`` (a forward and a
  backward), which is its 3P communication volume. ``wall_ms`` is the whole iteration.
* the bare-MPI baseline of the same bytes: one ``Reduce_scatter`` plus one
  ``Allgatherv`` of the P-element buffer plus the Adam kernel on this rank's shard
  (``Allreduce`` plus the kernel on all P for stage 0); ``overhead = step_ms /
  baseline_ms`` is what the engine's buckets, statistics and bookkeeping cost.
* the Adam kernel's elements/s on one core (rank 0 alone, the other ranks idle), next
  to torch's fused Adam when torch is installed, and the machine's copy bandwidth as
  a roofline: Adam reads p, m, v, g and writes p, m, v, so it can run at most at
  ``copy_bw / (7 * itemsize)`` elements/s. A copy also pays an uncounted read of its
  destination (write-allocate) that Adam does not, so the bandwidth of an in-place
  update is reported next to it as a second, tighter roofline.
* where torch is installed (and not ``--no-torch``), two torch.distributed (gloo)
  peers on the same tensors and gradients, one thread per rank: a flat-buffer DDP
  (``all_reduce`` of one flat gradient, then fused Adam on every parameter) and
  ``ZeroRedundancyOptimizer`` (the same ``all_reduce``, then its sharded Adam step,
  which broadcasts the updated parameters).

Why: the issue asks for one reproducible run that shows where the time of a ZeRO step
goes and how far it is from what the machine and the MPI library can do at best.
Targets are reported, never asserted: timings on a shared machine are noisy.

Everything collective runs identically on every rank; rank 0 prints a table and writes
the JSON (``--json``) and a PNG plot (``--plot``; needs matplotlib, the ``bench``
extra). ``mpi4py.MPI`` is used directly here only for the bare collectives of the
baseline, for an idle wait (a non-blocking barrier polled with sleeps, so that idle
ranks do not spin on the core being measured) and to broadcast the torch peers' port.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from . import adam as adam_module
from .adam import BLOCK, AdamConfig, adam_step
from .mpi.collectives import Comm
from .mpi.launch import install_abort_hook, library_version
from .driver import _auto_blas_threads, _HelpFormatter, _Parser, _positive, openblas_threads
from .engine import PHASES, ZeroOptimizer
from .partition import (
    DEFAULT_BUCKET_ELEMS,
    STAGES,
    Deferred,
    default_group,
    optimizer_layout,
    shard_counts,
)

T = TypeVar("T")

DEFAULT_SIZES = (1_000_000, 16_000_000, 64_000_000)
#: Learning rate of every optimizer here: small, so that values stay finite.
LR = 1e-4
#: Gradient scale of the synthetic gradients.
GRAD_SCALE = 1e-2
#: Largest kernel measurement (elements), and elements copied for the roofline.
KERNEL_MAX_ELEMS = 1 << 24
COPY_ELEMS = 1 << 26
#: Timed samples of the kernel and copy measurements (after one warm-up each).
KERNEL_REPS = 7
#: A kernel sample repeats the call until it lasts about this long (seconds): small
#: arrays take microseconds, too short for the clock and the noise.
SAMPLE_SECONDS = 0.02
#: Adam moves 7 arrays' worth of bytes per element: reads p, m, v, g; writes p, m, v.
ADAM_ARRAYS = 7
#: Per stage: (reduction passes, gather passes) over the P parameters in one step.
PASSES = {0: (2, 0), 1: (1, 1), 2: (1, 1), 3: (1, 2)}
#: Targets of the issue at stage 2 (reported, not asserted): (key, limit, meaning).
TARGETS = (
    ("vs_ddp", 0.5, "step_ms / flat-buffer DDP + fused Adam (gloo)"),
    ("vs_zero", 0.25, "step_ms / torch ZeroRedundancyOptimizer"),
    ("overhead", 1.1, "step_ms / (bare Reduce_scatter + Allgatherv + kernel)"),
)
_MPI_TYPES = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}
clock = time.perf_counter


# -- command line ------------------------------------------------------------------------


def _count(text: str) -> int:
    """A positive integer written as ``1000``, ``1e6`` or ``1.6e7``."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(number) and number.is_integer()):
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _size_list(text: str) -> list[int]:
    return [_count(part) for part in text.split(",") if part.strip()] or _empty(text)


def _stage_list(text: str) -> list[int]:
    stages = []
    for part in text.split(","):
        if not part.strip():
            continue
        if part.strip() not in {str(s) for s in STAGES}:
            raise argparse.ArgumentTypeError(f"stages are {STAGES}, got {part!r}")
        stages.append(int(part))
    return sorted(set(stages)) or _empty(text)


def _empty(text: str) -> list[int]:
    raise argparse.ArgumentTypeError(f"an empty list: {text!r}")


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """The command line of ``python -m zerompi.bench``."""
    p = _Parser(
        prog="python -m zerompi.bench",
        rank=rank,
        description=(
            "Time the optimizer side of a step (reduction, Adam, gather) of zerompi's "
            "stages 0-3 for several model sizes, next to bare MPI collectives of the same "
            "bytes, the Adam kernel against the copy-bandwidth roofline and, with torch, "
            "torch's fused Adam, a flat-buffer DDP and ZeroRedundancyOptimizer on gloo. "
            "Run it under 'mpiexec -n W'."
        ),
        epilog=(
            "Times are the slowest rank's medians over the timed steps. step_ms is the "
            "optimizer's own time (opt.pop_timings(): reduction incl. the gradient "
            "statistics, Adam, gather), wall_ms the whole iteration including the "
            "gradient copies that stand for the backward. Bandwidths are GB/s (1e9 B/s): "
            "bus = bytes this rank sent / phase time, alg = buffer bytes / phase time. "
            "Targets at stage 2 are printed, not asserted."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=_size_list,
        default=list(DEFAULT_SIZES),
        help="comma-separated model sizes in parameters (1e6 notation accepted)",
    )
    p.add_argument(
        "--stages",
        type=_stage_list,
        default=list(STAGES),
        help="comma-separated stages to run",
    )
    p.add_argument("--steps", type=_positive, default=10, help="timed steps per measurement")
    p.add_argument(
        "--warmup", type=_non_negative, default=2, help="untimed steps before the timed ones"
    )
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results to PATH")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="rank 0 writes a PNG plot to PATH (default: the --json path with .png; "
        "none without --json)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    p.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="stages 2-3 reduce through MPI messages, not the optimizer's shared-memory "
        "window (shared_memory=True, used when every rank is on one node)",
    )
    p.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="dtype of everything"
    )
    p.add_argument(
        "--bucket-elems",
        type=_positive,
        default=DEFAULT_BUCKET_ELEMS,
        help="target elements per bucket of the optimizer",
    )
    p.add_argument(
        "--tensor-elems",
        type=_positive,
        default=1 << 22,
        help="largest parameter tensor in elements (the model is P split into such tensors)",
    )
    p.add_argument(
        "--seed", type=_non_negative, default=0, help="seed of the parameters and gradients"
    )
    p.add_argument(
        "--blas-threads",
        type=_positive,
        default=None,
        help="OpenBLAS threads per rank (default: as the driver, cores // ranks when "
        "the environment does not say)",
    )
    return p


def parse_args(argv: Sequence[str] | None, rank: int = 0) -> argparse.Namespace:
    args = build_parser(rank).parse_args(argv)
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    return args


# -- helpers -----------------------------------------------------------------------------


def tensor_sizes(params: int, tensor_elems: int) -> list[int]:
    """``params`` split into tensors of ``tensor_elems`` and a remainder."""
    full, rest = divmod(params, tensor_elems)
    return [tensor_elems] * full + ([rest] if rest else [])


def init_tensor(seed: int, index: int, size: int, dtype: np.dtype) -> np.ndarray:
    """Initial values of tensor ``index``: the same on every rank and in every peer."""
    rng = np.random.default_rng([seed, index])
    out = rng.standard_normal(size, dtype=dtype)
    out *= 0.02
    return out


def deferred_model(sizes: Sequence[int], seed: int, dtype: np.dtype) -> dict[str, Deferred]:
    """The model as ``Deferred`` tensors: only rank 0 makes the initial values."""
    return {
        f"t{i}": Deferred((n,), dtype, lambda i=i, n=n: init_tensor(seed, i, n, dtype))
        for i, n in enumerate(sizes)
    }


def make_grads(
    sizes: Sequence[int], seed: int, rank: int, dtype: np.dtype
) -> dict[str, np.ndarray]:
    """This rank's synthetic gradients (different on every rank), made once."""
    rng = np.random.default_rng([seed, 1_000_003, rank])
    grads = {}
    for i, n in enumerate(sizes):
        g = rng.standard_normal(n, dtype=dtype)
        g *= GRAD_SCALE
        grads[f"t{i}"] = g
    return grads


def slowest_median_ms(comm: Comm, seconds: Sequence[float]) -> float:
    """The largest over ranks of this rank's median, in milliseconds."""
    return comm.max(1e3 * float(np.median(seconds)) if len(seconds) else 0.0)


def idle_barrier(comm: Comm) -> None:
    """A barrier that waits by sleeping, not by spinning in the MPI progress loop, so
    that waiting ranks leave the cores to the rank being measured."""
    request = comm.mpi.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def on_rank0_alone(comm: Comm, work: Callable[[], T]) -> T:
    """Collective: ``work()`` on rank 0 while the other ranks idle; its result on every
    rank (an exception on rank 0 aborts the job through the abort hook)."""
    comm.barrier()
    result = work() if comm.rank == 0 else None
    idle_barrier(comm)
    return comm.allgather(result)[0]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _gbps(nbytes: float, ms: float) -> float | None:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None


# -- our optimizer -----------------------------------------------------------------------


def run_iteration(
    opt: ZeroOptimizer, stage: int, grads: dict[str, np.ndarray], names: Sequence[str]
) -> None:
    """One optimizer-side iteration of ``stage`` with this rank's gradients."""
    if stage < 2:
        for name in names:
            np.copyto(opt.grads[name], grads[name])  # stands for the backward
    else:
        if stage == 3:
            for name in names:  # the forward gathers every tensor once
                with opt.gathered(name):
                    pass
        for name in reversed(names):  # the backward gathers again and hands over
            if stage == 3:
                with opt.gathered(name), opt.gradients(name) as g:
                    np.copyto(g[name], grads[name])
            else:
                with opt.gradients(name) as g:
                    np.copyto(g[name], grads[name])
    opt.step()


def bench_stage(
    comm: Comm,
    stage: int,
    sizes: Sequence[int],
    grads: dict[str, np.ndarray],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Time ``--steps`` iterations of ``stage`` (after ``--warmup``); one row."""
    dtype = np.dtype(args.dtype)
    params = sum(sizes)
    opt = ZeroOptimizer(
        deferred_model(sizes, args.seed, dtype),
        comm=comm.mpi,
        stage=stage,
        lr=LR,
        bucket_elems=args.bucket_elems,
        shared_memory=not args.no_shared_memory,
    )
    shared = opt.shared_memory
    names = list(grads)
    step_s: list[float] = []
    wall_s: list[float] = []
    phase_s: dict[str, list[float]] = {phase: [] for phase in PHASES}
    sent: dict[str, list[int]] = {"reduce_scatter": [], "allgather": []}
    opt.pop_timings()
    opt.comm.pop_traffic()
    for i in range(args.warmup + args.steps):
        comm.barrier()
        start = clock()
        run_iteration(opt, stage, grads, names)
        wall = clock() - start
        timings = opt.pop_timings()
        traffic = opt.comm.pop_traffic()
        if i < args.warmup:
            continue
        wall_s.append(wall)
        step_s.append(sum(timings.values()))
        for phase in PHASES:
            phase_s[phase].append(timings.get(phase, 0.0))
        sent["reduce_scatter"].append(
            sum(traffic.get(op, {}).get("sent", 0) for op in ("reduce_scatter", "allreduce"))
        )
        sent["allgather"].append(traffic.get("allgather", {}).get("sent", 0))
    local = params if stage == 0 else sum(opt.layout.shard_sizes.values())
    buckets = len(opt.layout.buckets)
    opt.close()
    del opt
    gc.collect()
    phase_ms = {phase: slowest_median_ms(comm, phase_s[phase]) for phase in PHASES}
    # Bytes a rank sends per step, mean over ranks (the textbook (W-1)/W volume).
    sent_bytes = {op: comm.sum(float(np.median(v))) / comm.size for op, v in sent.items()}
    busiest = comm.max(local)
    passes = PASSES[stage]
    nbytes = params * dtype.itemsize
    bandwidth = {
        "reduce_scatter": _gbps(sent_bytes["reduce_scatter"], phase_ms["reduce_scatter"]),
        "allgather": _gbps(sent_bytes["allgather"], phase_ms["allgather"]) if passes[1] else None,
        "reduce_scatter_algbw": _gbps(
            nbytes * (1 if stage == 0 else passes[0]), phase_ms["reduce_scatter"]
        ),
        "allgather_algbw": _gbps(nbytes * passes[1], phase_ms["allgather"]) if passes[1] else None,
        "adam": _gbps(ADAM_ARRAYS * dtype.itemsize * busiest, phase_ms["adam"]),
    }
    return {
        "stage": stage,
        "params": params,
        "world_size": comm.size,
        "tensors": len(sizes),
        "buckets": buckets,
        "shared_memory": shared,
        "step_ms": slowest_median_ms(comm, step_s),
        "phase_ms": phase_ms,
        "wall_ms": slowest_median_ms(comm, wall_s),
        "comm_bytes": sent_bytes,
        "adam_elems": busiest,
        "adam_elems_per_s": busiest / (phase_ms["adam"] * 1e-3) if phase_ms["adam"] > 0 else None,
        "bandwidth_gbps": bandwidth,
    }


# -- the Adam kernel and the bare collectives ---------------------------------------------


@dataclass
class KernelArrays:
    """Arrays for timing ``adam_step`` on ``n`` elements."""

    param: np.ndarray
    grad: np.ndarray
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    scratch: np.ndarray
    config: AdamConfig
    divisor: float
    step: int = 0

    @classmethod
    def make(cls, n: int, dtype: np.dtype, divisor: float, seed: int) -> KernelArrays:
        rng = np.random.default_rng([seed, 7])
        grad = rng.standard_normal(n, dtype=dtype)
        grad *= GRAD_SCALE
        return cls(
            param=init_tensor(seed, 0, n, dtype),
            grad=grad,
            exp_avg=np.zeros(n, dtype),
            exp_avg_sq=np.zeros(n, dtype),
            scratch=np.zeros(min(BLOCK, max(n, 1)), dtype),
            config=AdamConfig(lr=LR),
            divisor=divisor,
        )

    def run(self) -> None:
        # The gradient may be consumed by the kernel; what is left is finite and
        # small, so later calls time the same work on finite values.
        self.step += 1
        adam_step(
            self.param,
            self.grad,
            self.exp_avg,
            self.exp_avg_sq,
            self.step,
            self.config,
            self.scratch,
            self.divisor,
        )


def _timer(call: Callable[[], None]) -> Callable[[], float]:
    """A sampler: seconds per call of ``call``, repeated so that a sample lasts about
    ``SAMPLE_SECONDS`` (calibrated on one call)."""
    start = clock()
    call()
    once = clock() - start
    inner = max(1, min(100_000, math.ceil(SAMPLE_SECONDS / max(once, 1e-7))))

    def sample() -> float:
        start = clock()
        for _ in range(inner):
            call()
        return (clock() - start) / inner

    return sample


def interleaved_medians(samplers: Sequence[Callable[[], float]], reps: int) -> list[float]:
    """Median seconds of each sampler, run A B A B ... (one warm-up round first), so
    that a noisy neighbour slows them alike."""
    times: list[list[float]] = [[] for _ in samplers]
    for rep in range(reps + 1):
        for out, sample in zip(times, samplers, strict=True):
            value = sample()
            if rep:
                out.append(value)
    return [float(np.median(t)) for t in times]


def torch_fused_adam(torch: Any, n: int, dtype: np.dtype, seed: int) -> Callable[[], None]:
    """``step()`` of torch's fused Adam on one parameter of ``n`` elements."""
    rng = np.random.default_rng([seed, 7])
    param = torch.nn.Parameter(torch.from_numpy(init_tensor(seed, 0, n, dtype)))
    grad = rng.standard_normal(n, dtype=dtype)
    grad *= GRAD_SCALE
    param.grad = torch.from_numpy(grad)
    optimizer = torch.optim.Adam([param], lr=LR, fused=True)
    return optimizer.step


def measure_kernel(
    n: int, dtype: np.dtype, divisor: float, seed: int, torch: Any | None
) -> dict[str, Any]:
    """Elements/s of our kernel (and torch's fused Adam) on ``n`` elements on this
    core, and the copy-bandwidth roofline, sampled in turns so that the machine's
    noise weighs on all of them alike."""
    ours = KernelArrays.make(n, dtype, divisor, seed)
    src = np.ones(COPY_ELEMS, np.float32)
    dst = np.zeros_like(src)
    samplers = [
        _timer(lambda: np.copyto(dst, src)),
        _timer(lambda: np.negative(dst, out=dst)),  # read-modify-write in place
        _timer(ours.run),
    ]
    if torch is not None:
        samplers.append(_timer(torch_fused_adam(torch, n, dtype, seed)))
    copy_s, update_s, *seconds = interleaved_medians(samplers, KERNEL_REPS)
    roofline = copy_roofline(2 * src.nbytes / copy_s, 2 * src.nbytes / update_s, dtype.itemsize)
    result: dict[str, Any] = {
        "impl": getattr(adam_module, "KERNEL", "numpy"),
        "n": n,
        "divisor": divisor,
        "elems_per_s": n / seconds[0] if seconds[0] > 0 else None,
        "torch_fused_elems_per_s": None,
        "ratio": None,
        "roofline_elems_per_s": roofline["adam_roofline_elems_per_s"],
        "roofline_update_elems_per_s": roofline["adam_roofline_update_elems_per_s"],
        "roofline": roofline,
    }
    if torch is not None:
        result["torch_fused_elems_per_s"] = n / seconds[1] if seconds[1] > 0 else None
        result["ratio"] = _ratio(result["elems_per_s"], result["torch_fused_elems_per_s"])
    return result


def copy_roofline(copy_bw: float, update_bw: float, itemsize: int) -> dict[str, Any]:
    """The Adam rooflines implied by one core's memory bandwidth on ``COPY_ELEMS``
    float32, counted as bytes read + written per second: ``np.copyto`` (the
    issue's roofline) and an in-place update (``np.negative(a, out=a)``). A copy's
    destination is also read by the cache (write-allocate) without being counted,
    which Adam, writing only what it has read, does not pay: Adam may beat the copy
    roofline, by up to 1.5x, but not the update one."""
    per_elem = ADAM_ARRAYS * itemsize
    return {
        "copy_elems": COPY_ELEMS,
        "copy_bytes_per_s": copy_bw,
        "update_bytes_per_s": update_bw,
        "adam_bytes_per_elem": per_elem,
        "adam_roofline_elems_per_s": copy_bw / per_elem,
        "adam_roofline_update_elems_per_s": update_bw / per_elem,
    }


def bench_baseline(comm: Comm, params: int, args: argparse.Namespace) -> dict[str, float]:
    """Bare MPI on one ``params``-element buffer, and the kernel on this rank's shard
    (all ranks at once, as in a step): median ms, slowest rank."""
    dtype = np.dtype(args.dtype)
    mpi, mpi_type = comm.mpi, _MPI_TYPES[dtype]
    counts, displs = shard_counts(params, comm.size)
    buf = np.zeros(params, dtype)
    # The same collectives once more, bucket by bucket as the optimizer cuts the model
    # (blocking, one after the other): MPI may be faster on either.
    specs = [(f"t{i}", (n,), dtype) for i, n in enumerate(tensor_sizes(params, args.tensor_elems))]
    layout = optimizer_layout(specs, comm.size, comm.rank, 1, args.bucket_elems, default_group)
    pieces = [(buf[b.start : b.stop], list(b.counts), list(b.displs)) for b in layout.buckets]

    def bucketed(call: Callable[[np.ndarray, list[int], list[int]], None]) -> Callable[[], None]:
        return lambda: [call(*piece) for piece in pieces] and None

    ops: dict[str, Callable[[], None]] = {
        "reduce_scatter": lambda: mpi.Reduce_scatter(
            MPI.IN_PLACE, [buf, mpi_type], recvcounts=counts, op=MPI.SUM
        ),
        "allgatherv": lambda: mpi.Allgatherv(MPI.IN_PLACE, [buf, counts, displs, mpi_type]),
        "allreduce": lambda: mpi.Allreduce(MPI.IN_PLACE, [buf, mpi_type], op=MPI.SUM),
        "reduce_scatter_bucketed": bucketed(
            lambda b, c, d: mpi.Reduce_scatter(MPI.IN_PLACE, [b, mpi_type], recvcounts=c)
        ),
        "allgatherv_bucketed": bucketed(
            lambda b, c, d: mpi.Allgatherv(MPI.IN_PLACE, [b, c, d, mpi_type])
        ),
        "allreduce_bucketed": bucketed(
            lambda b, c, d: mpi.Allreduce(MPI.IN_PLACE, [b, mpi_type], op=MPI.SUM)
        ),
    }
    if 0 not in args.stages:
        del ops["allreduce"], ops["allreduce_bucketed"]
    times: dict[str, list[float]] = {op: [] for op in ops}
    for i in range(args.warmup + args.steps):
        for op, call in ops.items():
            comm.barrier()
            start = clock()
            call()
            if i >= args.warmup:
                times[op].append(clock() - start)
    pieces.clear()
    buf.resize(0, refcheck=False)  # free it (the lambdas above still refer to it)
    kernels = {"kernel_shard": counts[comm.rank]}
    if 0 in args.stages:
        kernels["kernel_full"] = params
    for key, n in kernels.items():
        arrays = KernelArrays.make(n, dtype, float(comm.size), args.seed)
        times[key] = []
        for i in range(args.warmup + args.steps):
            comm.barrier()
            start = clock()
            arrays.run()
            if i >= args.warmup:
                times[key].append(clock() - start)
        del arrays
        gc.collect()
    return {key: slowest_median_ms(comm, t) for key, t in times.items()}


def baseline_ms(stage: int, base: dict[str, float]) -> float:
    """Bare MPI + kernel for a step of ``stage``: each collective at the faster of
    one call on the whole buffer and one call per bucket, so no cut of ours counts
    as overhead saved."""

    def bare(op: str) -> float:
        return min(base[op], base[f"{op}_bucketed"])

    if stage == 0:
        return bare("allreduce") + base["kernel_full"]
    gathers = 2 if stage == 3 else 1  # stage 3 gathers in forward and in backward
    return bare("reduce_scatter") + gathers * bare("allgatherv") + base["kernel_shard"]


# -- torch peers -------------------------------------------------------------------------


def load_torch(comm: Comm, wanted: bool) -> Any | None:
    """Collective: ``torch`` with a gloo process group over this MPI world, or ``None``
    unless every rank could import it (and ``wanted``)."""
    torch = None
    if wanted:
        try:
            import torch
            import torch.distributed
            import torch.distributed.optim
        except Exception:  # not installed, or broken: run without it
            torch = None
    if not all(comm.allgather(torch is not None)):
        return None
    torch.set_num_threads(1)  # one core per rank, like ours
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.mpi.bcast(port, root=0)  # comm.mpi is MPI.COMM_WORLD in main()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )
    return torch


class TorchModel:
    """The model as torch tensors: views of one flat parameter and one flat gradient."""

    def __init__(self, torch: Any, sizes: Sequence[int], seed: int, dtype: np.dtype) -> None:
        total = sum(sizes)
        self.flat_param = torch.empty(total, dtype=getattr(torch, dtype.name))
        self.flat_grad = torch.zeros(total, dtype=getattr(torch, dtype.name))
        self.params = []
        self.grad_views: list[np.ndarray] = []
        grad_np = self.flat_grad.numpy()
        offset = 0
        for i, n in enumerate(sizes):
            view = self.flat_param[offset : offset + n]
            view.numpy()[...] = init_tensor(seed, i, n, dtype)
            param = torch.nn.Parameter(view)
            param.grad = self.flat_grad[offset : offset + n]
            self.params.append(param)
            self.grad_views.append(grad_np[offset : offset + n])
            offset += n

    def load_grads(self, grads: dict[str, np.ndarray]) -> None:
        """The backward: this rank's gradients into the flat gradient."""
        for view, grad in zip(self.grad_views, grads.values(), strict=True):
            np.copyto(view, grad)


def bench_torch(
    torch: Any,
    comm: Comm,
    sizes: Sequence[int],
    grads: dict[str, np.ndarray],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Median ms of the flat-buffer DDP + fused Adam step and of the
    ZeroRedundancyOptimizer step (each after the same all_reduce), slowest rank."""
    dist = torch.distributed
    dtype = np.dtype(args.dtype)
    world = comm.size

    def timed(model: TorchModel, optimizer: Any) -> tuple[list[float], list[float]]:
        reduce_s, step_s = [], []
        for i in range(args.warmup + args.steps):
            model.load_grads(grads)
            comm.barrier()
            t0 = clock()
            dist.all_reduce(model.flat_grad)
            model.flat_grad.div_(world)
            t1 = clock()
            optimizer.step()
            t2 = clock()
            if i >= args.warmup:
                reduce_s.append(t1 - t0)
                step_s.append(t2 - t1)
        return reduce_s, step_s

    model = TorchModel(torch, sizes, args.seed, dtype)
    ddp = torch.optim.Adam(model.params, lr=LR, fused=True)
    reduce_s, adam_s = timed(model, ddp)
    del ddp, model
    gc.collect()
    model = TorchModel(torch, sizes, args.seed, dtype)
    zero_cls = torch.distributed.optim.ZeroRedundancyOptimizer
    try:
        zero = zero_cls(model.params, optimizer_class=torch.optim.Adam, lr=LR, fused=True)
        fused_ok = True
    except (TypeError, ValueError, RuntimeError):
        fused_ok = False
    fused = all(comm.allgather(fused_ok))
    if not fused:
        zero = zero_cls(model.params, optimizer_class=torch.optim.Adam, lr=LR)
    zero_reduce_s, zero_step_s = timed(model, zero)
    del zero, model
    gc.collect()
    total = [a + b for a, b in zip(reduce_s, adam_s, strict=True)]
    zero_total = [a + b for a, b in zip(zero_reduce_s, zero_step_s, strict=True)]
    return {
        "ddp_fused_ms": slowest_median_ms(comm, total),
        "ddp_phase_ms": {
            "all_reduce": slowest_median_ms(comm, reduce_s),
            "adam": slowest_median_ms(comm, adam_s),
        },
        "zero_ms": slowest_median_ms(comm, zero_total),
        "zero_phase_ms": {
            "all_reduce": slowest_median_ms(comm, zero_reduce_s),
            "step": slowest_median_ms(comm, zero_step_s),
        },
        "zero_fused": fused,
        "backend": "gloo",
        "torch_version": str(torch.__version__),
        "threads": int(torch.get_num_threads()),
    }


# -- the run -----------------------------------------------------------------------------


def say(comm: Comm, text: str) -> None:
    if comm.rank == 0:
        print(f"zerompi.bench: {text}", flush=True)


def bench_size(
    comm: Comm, params: int, args: argparse.Namespace, torch: Any | None
) -> list[dict[str, Any]]:
    """Every measurement of one model size: one row per stage."""
    dtype = np.dtype(args.dtype)
    sizes = tensor_sizes(params, args.tensor_elems)
    grads = make_grads(sizes, args.seed, comm.rank, dtype)
    rows = []
    for stage in args.stages:
        row = bench_stage(comm, stage, sizes, grads, args)
        say(comm, f"{params:,} params, stage {stage}: step {row['step_ms']:.3f} ms")
        rows.append(row)
    base = bench_baseline(comm, params, args)
    say(comm, f"{params:,} params, bare MPI + kernel: " + _fmt_dict(base))
    peer = None
    if torch is not None:
        peer = bench_torch(torch, comm, sizes, grads, args)
        say(
            comm,
            f"{params:,} params, torch: ddp_fused {peer['ddp_fused_ms']:.3f} ms, "
            f"zero {peer['zero_ms']:.3f} ms",
        )
    del grads
    gc.collect()
    n = min(params, KERNEL_MAX_ELEMS)
    kernel = on_rank0_alone(
        comm, lambda: measure_kernel(n, dtype, float(comm.size), args.seed, torch)
    )
    gc.collect()
    for row in rows:
        row["baseline_ms"] = baseline_ms(row["stage"], base)
        row["baseline_phase_ms"] = base
        row["overhead"] = _ratio(row["step_ms"], row["baseline_ms"])
        row["kernel"] = kernel
        if peer is not None:
            row["torch"] = peer
            row["vs_ddp"] = _ratio(row["step_ms"], peer["ddp_fused_ms"])
            row["vs_zero"] = _ratio(row["step_ms"], peer["zero_ms"])
    return rows


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's stage-2 targets against the measured rows (reported only)."""
    out = []
    for row in rows:
        if row["stage"] != 2:
            continue
        for key, limit, meaning in TARGETS:
            value = row.get(key)
            out.append(
                {
                    "params": row["params"],
                    "key": key,
                    "value": value,
                    "limit": limit,
                    "meaning": meaning,
                    "met": None if value is None else value <= limit,
                }
            )
    return out


def run(args: argparse.Namespace, comm: Comm, argv: Sequence[str]) -> dict[str, Any]:
    """Collective: the whole benchmark; the results (identical on every rank)."""
    blas = openblas_threads()
    threads = args.blas_threads or _auto_blas_threads(comm.size)
    if blas and threads:
        blas[1](threads)
    torch = load_torch(comm, not args.no_torch)
    say(
        comm,
        f"world size {comm.size}, {library_version()}, kernel "
        f"{getattr(adam_module, 'KERNEL', 'numpy')}, torch "
        f"{torch.__version__ if torch is not None else 'not used'}, sizes "
        f"{', '.join(f'{s:,}' for s in args.sizes)}, stages {args.stages}, "
        f"{args.steps} timed steps after {args.warmup} warm-up",
    )
    rows: list[dict[str, Any]] = []
    for params in args.sizes:
        rows.extend(bench_size(comm, params, args, torch))
    kernels = {row["kernel"]["n"]: row["kernel"] for row in rows}
    results = {
        "world_size": comm.size,
        "mpi_library": library_version(),
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "bucket_elems": args.bucket_elems,
        "tensor_elems": args.tensor_elems,
        "blas_threads": blas[0]() if blas else None,
        "torch": torch is not None,
        "kernel": kernels[max(kernels)],
        "kernels": [kernels[n] for n in sorted(kernels)],
        "roofline": kernels[max(kernels)]["roofline"],
        "argv": list(argv),
        "rows": rows,
        "targets": targets(rows),
    }
    if torch is not None:
        torch.distributed.destroy_process_group()
    return results


# -- output ------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _fmt_dict(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} ms" for k, v in values.items())


def table(results: dict[str, Any]) -> str:
    """The human-readable summary rank 0 prints."""
    head = (
        f"{'stage':>5} {'params':>12} {'step_ms':>9} {'rs_ms':>9} {'adam_ms':>9} "
        f"{'ag_ms':>9} {'wall_ms':>9} {'base_ms':>9} {'overhd':>7} {'ddp_ms':>9} "
        f"{'zero_ms':>9} {'vs_ddp':>7} {'vs_zero':>7}"
    )
    lines = [
        f"zerompi.bench: world size {results['world_size']}, {results['mpi_library']}, "
        f"{results['dtype']}, median of {results['steps']} steps (ms, slowest rank)",
        head,
    ]
    for r in sorted(results["rows"], key=lambda r: (r["params"], r["stage"])):
        t = r.get("torch", {})
        ph = r["phase_ms"]
        lines.append(
            f"{r['stage']:>5} {r['params']:>12,} {r['step_ms']:>9.3f} "
            f"{ph['reduce_scatter']:>9.3f} {ph['adam']:>9.3f} {ph['allgather']:>9.3f} "
            f"{r['wall_ms']:>9.3f} {r['baseline_ms']:>9.3f} {_fmt(r['overhead'], '.2f'):>7} "
            f"{_fmt(t.get('ddp_fused_ms')):>9} {_fmt(t.get('zero_ms')):>9} "
            f"{_fmt(r.get('vs_ddp'), '.2f'):>7} {_fmt(r.get('vs_zero'), '.2f'):>7}"
        )
    for k in results["kernels"]:
        torch_part = (
            f", torch fused {k['torch_fused_elems_per_s']:.3e} elems/s (ours/torch "
            f"{k['ratio']:.2f})"
            if k.get("torch_fused_elems_per_s")
            else ""
        )
        lines.append(
            f"kernel {k['impl']} n={k['n']:,}: ours {_fmt(k['elems_per_s'], '.3e')} elems/s"
            f"{torch_part}, roofline copy {k['roofline_elems_per_s']:.3e} / update "
            f"{k['roofline_update_elems_per_s']:.3e} elems/s (ours/roofline "
            f"{_fmt(_ratio(k['elems_per_s'], k['roofline_elems_per_s']), '.2f')} / "
            f"{_fmt(_ratio(k['elems_per_s'], k['roofline_update_elems_per_s']), '.2f')})"
        )
    roof = results["roofline"]
    lines.append(
        f"roofline at n={results['kernel']['n']:,}: one core's copy "
        f"{roof['copy_bytes_per_s'] / 1e9:.2f} GB/s, in-place update "
        f"{roof['update_bytes_per_s'] / 1e9:.2f} GB/s (read + written, sampled between the "
        f"kernel's runs) / {roof['adam_bytes_per_elem']} B per Adam element"
    )
    for t in results["targets"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        lines.append(
            f"target stage 2, {t['params']:,} params: {t['key']} {_fmt(t['value'], '.2f')} "
            f"<= {t['limit']} ({t['meaning']}): {verdict}"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> bool:
    """Write the PNG: step time against size, and kernel throughput against n.
    Returns False (and says so) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install zerompi[bench])", flush=True)
        return False
    rows = results["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for stage in sorted({r["stage"] for r in rows}):
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["params"])
        left.plot(
            [r["params"] for r in mine], [r["step_ms"] for r in mine], "o-", label=f"stage {stage}"
        )
    peers = {r["params"]: r["torch"] for r in rows if "torch" in r}
    if peers:
        xs = sorted(peers)
        left.plot(xs, [peers[x]["ddp_fused_ms"] for x in xs], "s--", label="torch DDP + fused")
        left.plot(xs, [peers[x]["zero_ms"] for x in xs], "^--", label="torch ZeRO (gloo)")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="parameters",
        ylabel="step ms (median, slowest rank)",
        title=f"optimizer step, {results['world_size']} rank(s), {results['dtype']}",
    )
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    kernels = results["kernels"]
    ns = [k["n"] for k in kernels]
    right.plot(ns, [k["elems_per_s"] for k in kernels], "o-", label=f"ours ({kernels[0]['impl']})")
    if any(k.get("torch_fused_elems_per_s") for k in kernels):
        right.plot(ns, [k["torch_fused_elems_per_s"] for k in kernels], "s--", label="torch fused")
    right.plot(
        ns,
        [k["roofline_elems_per_s"] for k in kernels],
        "k:",
        marker=".",
        label="roofline (copy bandwidth)",
    )
    right.plot(
        ns,
        [k["roofline_update_elems_per_s"] for k in kernels],
        "k--",
        marker=".",
        label="roofline (in-place update bandwidth)",
    )
    right.set(xscale="log", yscale="log", xlabel="elements", ylabel="Adam elements/s, one core")
    right.set_title("Adam kernel")
    right.legend()
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 on every rank)."""
    install_abort_hook()  # any exception on any rank ends the whole job
    comm = Comm()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv, comm.rank)
        results = run(args, comm, argv)
        if comm.rank == 0:
            print(table(results), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
                    f.write("\n")
            if args.plot and plot(results, args.plot):
                print(f"zerompi.bench: wrote {args.plot}", flush=True)
        comm.barrier()
        return 0
    except Exception as exc:
        if comm.size == 1:
            raise
        print(
            f"zerompi.bench: rank {comm.rank} failed: {type(exc).__name__}: {exc}\n"
            f"{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        comm.abort(1)
        raise  # not reached


if __name__ == "__main__":
    sys.exit(main())
