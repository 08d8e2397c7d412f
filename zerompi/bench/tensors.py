"""The many-tensor row: a model of ``--tensors`` one-tensor layers of
``--tensor-size`` elements each, so that what the optimizer pays per tensor (Python
calls, context managers, bucket bookkeeping) stays measured, not hidden behind the
bandwidth of a few large buckets.

For every stage it times the same iteration as :func:`.timing.bench_stage` and, as
its yardstick, the bare collectives a step of that stage makes over the optimizer's
own layout (stage 0 one ``Allreduce`` per bucket; stages 1-2 one ``Reduce_scatter``
and one ``Allgatherv`` per bucket; stage 3, where a bucket is one layer, one
``Reduce_scatter`` and two ``Allgatherv``) plus the Adam kernel on this rank's
elements, blocking, one after the other. ``overhead_us_per_tensor`` is
``(wall_ms - bare_ms) / tensors``: the optimizer's cost per tensor per step above
its collectives (the gradient copies that stand for the backward, about a
microsecond each, included).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import numpy as np

from ..mpi.collectives import Comm
from ..partition import default_group, optimizer_layout
from .baseline import KernelArrays, bucket_pieces, per_bucket, time_calls
from .model import make_grads
from .timing import bench_stage


def bare_step_ms(comm: Comm, stage: int, sizes: list[int], args: argparse.Namespace) -> float:
    """Median ms (slowest rank) of the bare collectives and kernel of one step of
    ``stage`` over the optimizer's layout of tensors ``sizes``."""
    dtype = np.dtype(args.dtype)
    specs = [(f"t{i}", (n,), dtype) for i, n in enumerate(sizes)]
    layout = optimizer_layout(
        specs, comm.size, comm.rank, stage, args.bucket_elems, default_group
    )
    buf = np.zeros(sum(sizes), dtype)
    pieces = bucket_pieces(buf, layout)
    local = sum(sizes) if stage == 0 else sum(layout.shard_sizes.values())
    kernel = KernelArrays.make(local, dtype, float(comm.size), args.seed)
    calls: list[Callable[[], None]]
    if stage == 0:
        calls = [per_bucket(comm, "allreduce", pieces)]
    else:
        gathers = 2 if stage == 3 else 1  # stage 3 gathers in forward and in backward
        calls = [per_bucket(comm, "reduce_scatter", pieces)]
        calls += [per_bucket(comm, "allgatherv", pieces)] * gathers
    calls.append(kernel.run)

    def step() -> None:
        for call in calls:
            call()

    ms = time_calls(comm, {"step": step}, args)["step"]
    pieces.clear()
    buf.resize(0, refcheck=False)  # free it (the calls above still refer to it)
    gc.collect()
    return ms


def bench_many_tensors(comm: Comm, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Collective: one row per stage of ``--stages`` for ``--tensors`` one-tensor
    layers of ``--tensor-size`` elements."""
    dtype = np.dtype(args.dtype)
    sizes = [args.tensor_size] * args.tensors
    grads = make_grads(sizes, args.seed, comm.rank, dtype, args.matrix_cols)
    rows = []
    for stage in args.stages:
        row = bench_stage(comm, stage, sizes, grads, args)
        bare_ms = bare_step_ms(comm, stage, sizes, args)
        n = args.tensors
        row.update(
            {
                "tensor_elems": args.tensor_size,
                "bare_ms": bare_ms,
                "step_us_per_tensor": 1e3 * row["step_ms"] / n,
                "us_per_tensor": 1e3 * row["wall_ms"] / n,
                "overhead_us_per_tensor": 1e3 * (row["wall_ms"] - bare_ms) / n,
            }
        )
        rows.append(row)
    del grads
    gc.collect()
    return rows
