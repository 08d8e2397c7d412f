"""What the optimizer holds: ``memory_usage()`` is exact (every buffer counted, per
category), and training allocates nothing the size of the model."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED,
    MODES,
    Spec,
    assert_all,
    backward,
    bucket_sizes,
    forward,
    make_params,
    rank_grads,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer, shard_counts
from zerompi.adam import BLOCK
from zerompi.buffers import CATEGORIES


def expected_usage(
    spec: Spec,
    size: int,
    rank: int,
    bucket_elems: int,
    stage: int,
    full_grads: bool = False,
    slots: int = 2,
) -> tuple[dict[str, int], int]:
    """Bytes per category: parameters full (stage 3: the shard), gradients full
    (stages 2-3: the shard), Adam moments the shard (stage 0: full), ``slots``
    staging buckets of the largest bucket's size in stages 2-3 (2 with ``overlap``,
    1 without) and as many gather buckets in stage 3 (prefetch), per dtype; ``full_grads``: the full
    staging buffer stage 2 allocates for ``opt.grads``. Also returns an upper bound
    for the Adam kernel's scratch."""
    usage = dict.fromkeys(CATEGORIES, 0)
    scratch_bound = 0
    for dtype, buckets in bucket_sizes(spec, bucket_elems, stage).items():
        item = dtype.itemsize
        full = sum(buckets) * item
        shard = sum(shard_counts(b, size)[0][rank] for b in buckets) * item
        biggest = max(buckets) * item
        usage["parameter_partitions"] += shard if stage == 3 else full
        usage["gradient_partitions"] += full if stage <= 1 else shard
        usage["optimizer_states"] += 2 * (full if stage == 0 else shard)
        usage["communication_buffers"] += {0: 0, 1: 0, 2: slots, 3: 2 * slots}[stage] * biggest
        if full_grads:
            usage["communication_buffers"] += full
        scratch_bound += min(BLOCK * item, max(full if stage == 0 else shard, item))
    return usage, scratch_bound


def usage_problems(usage: dict[str, int], want: dict[str, int], bound: int) -> list[str]:
    problems = []
    if set(usage) != set(CATEGORIES) or not all(type(v) is int for v in usage.values()):
        problems.append(f"categories {usage}")
    for cat, value in want.items():
        if cat != "scratch" and usage.get(cat) != value:
            problems.append(f"{cat} {usage.get(cat)} bytes, want {value}")
    if not 0 < usage.get("scratch", 0) <= bound:
        problems.append(f"scratch {usage.get('scratch')}, want in (0, {bound}]")
    return problems


@pytest.mark.parametrize("mode", MODES)
def test_memory_usage_is_exact(comm: MPI.Intracomm, mode: str) -> None:
    """``memory_usage()`` equals the documented layout to the byte, before and after
    training; summed over ranks, what a stage shards is stored exactly once (no
    duplication, no padding). Stage 2 holds a full staging buffer only once
    ``opt.grads`` has been used."""
    stage, api = MODES[mode]
    spec = {**MIXED, "big": ((37, 3), F32)}
    params = make_params(spec)
    total = sum(p.nbytes for p in params.values())
    copies = {  # how many times the world stores each category
        "optimizer_states": 2 * (comm.size if stage == 0 else 1),
        "gradient_partitions": comm.size if stage <= 1 else 1,
        "parameter_partitions": comm.size if stage <= 2 else 1,
    }
    problems = []
    for bucket_elems in (1, 7, 1 << 22):
        what = f"bucket_elems={bucket_elems}"
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems,
                            shared_memory=False)  # per-rank copies; node copies: test_stages
        want, bound = expected_usage(spec, comm.size, comm.rank, bucket_elems, stage)
        usage = opt.memory_usage()
        problems += [f"{what}: {p}" for p in usage_problems(usage, want, bound)]
        sums = comm.allreduce(np.array([usage.get(cat, 0) for cat in copies]))
        for (cat, n), got in zip(copies.items(), sums, strict=True):
            if got != n * total:
                problems.append(f"{what}: {cat} sum to {got} over ranks, want {n} x {total}")
        # Training allocates nothing further, except stage 2's full gradient for opt.grads.
        backward(opt, rank_grads(spec, 0, comm.rank), api)
        opt.accumulate()
        opt.step()
        full_grads = stage == 2 and api == "grads"
        want, bound = expected_usage(spec, comm.size, comm.rank, bucket_elems, stage, full_grads)
        after = opt.memory_usage()
        problems += [f"{what} after training: {p}" for p in usage_problems(after, want, bound)]
        if full_grads:
            buffers = opt.memory_buffers()
            for dtype in (F32, F64):
                name = f"grads_full.{dtype.name}"
                size = sum(p.nbytes for p in params.values() if p.dtype == dtype)
                if buffers.get(name) != size:
                    problems.append(f"{what}: buffer {name} {buffers.get(name)}, want {size}")
        elif after != usage:
            problems.append(f"{what}: usage changed in training: {after} vs {usage}")
    verdict(problems, mode)


@pytest.mark.parametrize("mode", MODES)
def test_training_allocates_nothing_the_size_of_the_model(comm: MPI.Intracomm, mode: str) -> None:
    """numpy reports its allocations to tracemalloc: the peak during a whole forward
    pass, backward pass and step (after a warm-up) must be far below the model's
    size. In stages 2-3 that covers the streamed hand-over (each bucket
    reduce-scattered through the staging buffer) and stage 3's gathers. Memory, not
    time."""
    stage, api = MODES[mode]
    spec: Spec = {
        "l1.w": ((200, 150), F32),
        "l1.b": ((150,), F32),
        "v": ((17_500,), F32),
        "d": ((2_500,), F64),
        "s": ((), F32),
    }
    params = make_params(spec)
    model_bytes = sum(p.nbytes for p in params.values())
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=12_500)
    grads = [rank_grads(spec, step, comm.rank, exact=False) for step in range(3)]
    peaks = []
    for step in range(3):  # step 0 warms up (stage 2 allocates its full grads for opt.grads)
        tracing = step > 0
        if tracing:
            tracemalloc.start()
        try:
            if api == "streamed":
                forward(opt, spec)
            backward(opt, grads[step], api)
            if step == 2:
                opt.accumulate()  # stages 2-3: the reduce-scatters happen here or before
            opt.step()
            if tracing:
                peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            if tracing:
                tracemalloc.stop()
    # Control: the tracer does see a model-sized numpy allocation.
    tracemalloc.start()
    try:
        np.ones(model_bytes // 8)
        control = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_all(
        control >= model_bytes // 2 and max(peaks) < model_bytes / 10,
        f"peak traced allocation in training: {peaks} bytes, model {model_bytes} bytes "
        f"(control allocation traced as {control} bytes)",
    )


@pytest.mark.parametrize("optimizer", ["sgd", "lion", "adam8bit", "adafactor", "muon"])
@pytest.mark.parametrize("mode", ["stage0", "stage2-streamed", "stage3"])
def test_every_rules_step_allocates_nothing_the_size_of_the_model(
    comm: MPI.Intracomm, mode: str, optimizer: str
) -> None:  # fmt: skip
    """As above for every update rule, on a model of matrices (cut by buckets and
    shards: Adafactor's factored sums, Muon's exchanges and Newton-Schulz products)
    and vectors: the peak traced allocation of a step (after a warm-up step) stays
    below a tenth of the model. Adafactor's temporaries are bounded by its pieces of
    65536 elements; Muon works in its planned workspace (``memory_usage()``'s
    ``scratch``), not in arrays of its step's own."""
    stage, api = MODES[mode]
    spec: Spec = {"w1": ((600, 700), F32), "b1": ((700,), F32), "w2": ((700, 500), F32),
                  "w3": ((900, 400), F32), "v": ((30_000,), F32)}  # fmt: skip
    params = make_params(spec)
    model_bytes = sum(p.nbytes for p in params.values())
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=300_000,
                        optimizer=optimizer)  # fmt: skip
    grads = [rank_grads(spec, step, comm.rank, exact=False) for step in range(2)]
    peaks = []
    for step in range(2):
        backward(opt, grads[step], api)
        if step:
            tracemalloc.start()
        try:
            opt.step()
            if step:
                peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            if step:
                tracemalloc.stop()
    opt.close()
    assert_all(max(peaks) < model_bytes / 10,
               f"{optimizer} {mode}: peak traced allocation in step() {peaks} bytes, model "
               f"{model_bytes} bytes")  # fmt: skip
