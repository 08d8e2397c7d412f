"""The whole benchmark: the memory bandwidth of all ranks streaming at once (at the
start, and right before each stage for that row's floor), every model size (one row
per stage, the bare baseline, the torch peers, the kernel, the floor), then the
many-tensor rows; the results, identical on every rank."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import adam as adam_module
from ..mpi.collectives import Comm
from ..mpi.launch import library_version
from ..runtime import blas_threads
from .baseline import KERNEL_MAX_ELEMS, baseline_ms, bench_baseline, measure_kernel
from .floor import floor_fields, stream_bandwidth
from .model import make_grads, tensor_sizes
from .peers import bench_torch, load_torch
from .report import fmt_dict, targets
from .tensors import bench_many_tensors
from .timing import bench_stage, on_rank0_alone, ratio


def say(comm: Comm, text: str) -> None:
    """A progress line, printed by rank 0."""
    if comm.rank == 0:
        print(f"zerompi.bench: {text}", flush=True)


def bench_size(
    comm: Comm, params: int, args: argparse.Namespace, torch: Any | None
) -> list[dict[str, Any]]:
    """Every measurement of one model size: one row per stage."""
    dtype = np.dtype(args.dtype)
    sizes = tensor_sizes(params, args.tensor_elems)
    grads = make_grads(sizes, args.seed, comm.rank, dtype, args.matrix_cols)
    rows, mixed = [], []
    precision = (args.param_dtype, args.reduce_dtype)
    for stage in args.stages:
        gbps = stream_bandwidth(comm, args.stream_elems)["stream_gbps"]  # (right before)
        row = bench_stage(comm, stage, sizes, grads, args)
        row["stream_gbps"] = gbps
        say(comm, f"{params:,} params, stage {stage}: step {row['step_ms']:.3f} ms")
        rows.append(row)
        if any(precision):  # the same stage in mixed precision, right after
            low = bench_stage(comm, stage, sizes, grads, args, precision)
            low["stream_gbps"] = gbps
            low["vs_same_stage"] = ratio(low["step_ms"], row["step_ms"])
            say(comm, f"{params:,} params, stage {stage}, {low['param_dtype']} params, "
                      f"{low['reduce_dtype']} gradients: step {low['step_ms']:.3f} ms")  # fmt: skip
            mixed.append(low)
    base = bench_baseline(comm, params, args)
    say(comm, f"{params:,} params, bare MPI + kernel: " + fmt_dict(base))
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
        row["overhead"] = ratio(row["step_ms"], row["baseline_ms"])
        row["kernel"] = kernel
        if peer is not None:
            row["torch"] = peer
            row["vs_ddp"] = ratio(row["step_ms"], peer["ddp_fused_ms"])
            row["vs_zero"] = ratio(row["step_ms"], peer["zero_ms"])
    return rows + mixed


def run(args: argparse.Namespace, comm: Comm, argv: Sequence[str]) -> dict[str, Any]:
    """Collective: the whole benchmark; the results (identical on every rank)."""
    with blas_threads(args.blas_threads, comm.size) as threads:
        torch = load_torch(comm, not args.no_torch)
        try:
            return _measure(args, comm, argv, torch, threads)
        finally:
            if torch is not None:
                torch.distributed.destroy_process_group()


def _measure(
    args: argparse.Namespace, comm: Comm, argv: Sequence[str], torch: Any | None,
    threads: int | None,
) -> dict[str, Any]:  # fmt: skip
    say(
        comm,
        f"world size {comm.size}, {library_version()}, kernel "
        f"{getattr(adam_module, 'KERNEL', 'numpy')}, torch "
        f"{torch.__version__ if torch is not None else 'not used'}, sizes "
        f"{', '.join(f'{s:,}' for s in args.sizes)}, stages {args.stages}, "
        f"{args.steps} timed steps after {args.warmup} warm-up"
        + (f", also {args.param_dtype or args.dtype} params / {args.reduce_dtype or args.dtype} "
           "gradients" if args.param_dtype or args.reduce_dtype else "")
        + (f", {args.tensors:,} tensors of {args.tensor_size:,}" if args.tensors else ""),
    )
    stream = stream_bandwidth(comm, args.stream_elems)
    say(
        comm,
        f"memory bandwidth, {comm.size} rank(s) streaming at once: "
        f"{stream['stream_gbps']:.2f} GB/s (np.add over {args.stream_elems:,} float32 "
        f"elements, best of {stream['reps']})",
    )
    rows: list[dict[str, Any]] = []
    for params in args.sizes:
        rows.extend(bench_size(comm, params, args, torch))
    for row in rows:  # each against the bandwidth probed right before its stage
        row.update(floor_fields(row, row.get("stream_gbps") or stream["stream_gbps"]))
    tensor_rows = bench_many_tensors(comm, args) if args.tensors else []
    for row in tensor_rows:
        say(
            comm,
            f"{row['tensors']:,} tensors of {row['tensor_elems']:,}, stage {row['stage']}: "
            f"wall {row['wall_ms']:.3f} ms, {row['us_per_tensor']:.2f} us per tensor, "
            f"{row['overhead_us_per_tensor']:.2f} above the bare collectives",
        )
    kernels = {row["kernel"]["n"]: row["kernel"] for row in rows if "kernel" in row}
    return {
        "world_size": comm.size,
        "mpi_library": library_version(),
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "bucket_elems": args.bucket_elems,
        "tensor_elems": args.tensor_elems,
        "blas_threads": threads,
        "torch": torch is not None,
        "kernel": kernels[max(kernels)],
        "kernels": [kernels[n] for n in sorted(kernels)],
        "roofline": kernels[max(kernels)]["roofline"],
        "stream_gbps": stream["stream_gbps"],
        "stream": stream,
        "argv": list(argv),
        "rows": rows,
        "many_tensors": tensor_rows,
        "targets": targets([r for r in rows if "kernel" in r], tensor_rows),
    }
