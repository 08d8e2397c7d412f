"""The yardsticks: bare MPI collectives of the same bytes, the Adam kernel alone, and
the machine's copy bandwidth as a roofline.

* the bare-MPI baseline of a step: one ``Reduce_scatter`` plus one ``Allgatherv`` of
  the P-element buffer plus the Adam kernel on this rank's shard (``Allreduce`` plus
  the kernel on all P for stage 0), every collective also timed bucket by bucket as
  the optimizer cuts the model; ``overhead = step_ms / baseline_ms`` is what the
  engine's buckets, statistics and bookkeeping cost. The collectives are
  :mod:`zerompi.mpi.bare`'s, unwrapped.
* the Adam kernel's elements/s on one core (rank 0 alone, the other ranks idle), next
  to torch's fused Adam when torch is installed, and the copy bandwidth: Adam reads
  p, m, v, g and writes p, m, v, so it can run at most at ``copy_bw / (7 * itemsize)``
  elements/s. A copy also pays an uncounted read of its destination (write-allocate)
  that Adam does not, so the bandwidth of an in-place update is reported next to it
  as a second, tighter roofline.
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import adam as adam_module
from ..adam import BLOCK, AdamConfig, adam_step
from ..mpi import bare
from ..mpi.collectives import Comm
from ..partition import Layout, default_group, optimizer_layout, shard_counts
from ..runtime import clock
from .model import GRAD_SCALE, LR, init_tensor, tensor_sizes
from .peers import torch_fused_adam
from .timing import ADAM_ARRAYS, ratio, slowest_median_ms

#: Largest kernel measurement (elements), and elements copied for the roofline.
KERNEL_MAX_ELEMS = 1 << 24
COPY_ELEMS = 1 << 26
#: Timed samples of the kernel and copy measurements (after one warm-up each).
KERNEL_REPS = 7
#: A kernel sample repeats the call until it lasts about this long (seconds): small
#: arrays take microseconds, too short for the clock and the noise.
SAMPLE_SECONDS = 0.02

#: A bucket's slice of a flat buffer, its counts and displacements.
Piece = tuple[np.ndarray, list[int], list[int]]



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
        result["ratio"] = ratio(result["elems_per_s"], result["torch_fused_elems_per_s"])
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


def time_calls(
    comm: Comm, calls: dict[str, Callable[[], None]], args: argparse.Namespace
) -> dict[str, float]:
    """Median ms (slowest rank) of every call, after ``--warmup`` untimed rounds;
    each call starts after a barrier, all ranks at once, as in a step."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    for i in range(args.warmup + args.steps):
        for key, call in calls.items():
            comm.barrier()
            start = clock()
            call()
            if i >= args.warmup:
                times[key].append(clock() - start)
    return {key: slowest_median_ms(comm, t) for key, t in times.items()}


def bucket_pieces(buf: np.ndarray, layout: Layout) -> list[Piece]:
    """``(bucket's slice of buf, counts, displs)`` of every bucket of ``layout``."""
    return [(buf[b.start : b.stop], list(b.counts), list(b.displs)) for b in layout.buckets]


def per_bucket(comm: Comm, op: str, pieces: Sequence[Piece]) -> Callable[[], None]:
    """One bare ``op`` ("reduce_scatter", "allgatherv" or "allreduce") per piece,
    blocking, one after the other."""
    if op == "reduce_scatter":
        return lambda: [bare.reduce_scatter(comm, b, c) for b, c, _ in pieces] and None
    if op == "allgatherv":
        return lambda: [bare.allgatherv(comm, b, c, d) for b, c, d in pieces] and None
    return lambda: [bare.allreduce(comm, b) for b, _, _ in pieces] and None


def bench_baseline(comm: Comm, params: int, args: argparse.Namespace) -> dict[str, float]:
    """Bare MPI on one ``params``-element buffer, and the kernel on this rank's shard
    (all ranks at once, as in a step): median ms, slowest rank."""
    dtype = np.dtype(args.dtype)
    counts, displs = shard_counts(params, comm.size)
    buf = np.zeros(params, dtype)
    # The same collectives once more, bucket by bucket as the optimizer cuts the model
    # (blocking, one after the other): MPI may be faster on either.
    specs = [(f"t{i}", (n,), dtype) for i, n in enumerate(tensor_sizes(params, args.tensor_elems))]
    layout = optimizer_layout(specs, comm.size, comm.rank, 1, args.bucket_elems, default_group)
    pieces = bucket_pieces(buf, layout)
    ops: dict[str, Callable[[], None]] = {
        "reduce_scatter": lambda: bare.reduce_scatter(comm, buf, counts),
        "allgatherv": lambda: bare.allgatherv(comm, buf, counts, displs),
        "allreduce": lambda: bare.allreduce(comm, buf),
        "reduce_scatter_bucketed": per_bucket(comm, "reduce_scatter", pieces),
        "allgatherv_bucketed": per_bucket(comm, "allgatherv", pieces),
        "allreduce_bucketed": per_bucket(comm, "allreduce", pieces),
    }
    if 0 not in args.stages:
        del ops["allreduce"], ops["allreduce_bucketed"]
    result = time_calls(comm, ops, args)
    pieces.clear()
    buf.resize(0, refcheck=False)  # free it (the lambdas above still refer to it)
    kernels = {"kernel_shard": counts[comm.rank]}
    if 0 in args.stages:
        kernels["kernel_full"] = params
    for key, n in kernels.items():
        arrays = KernelArrays.make(n, dtype, float(comm.size), args.seed)
        result.update(time_calls(comm, {key: arrays.run}, args))
        del arrays
        gc.collect()
    return result


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


