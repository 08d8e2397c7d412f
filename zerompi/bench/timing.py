"""Timing zerompi's optimizer: one benchmark row per stage and model, and the
helpers every measurement shares (slowest-rank medians, rank 0 alone).

``step_ms`` is the median over ``--steps`` timed iterations of the optimizer's own
time (``opt.pop_timings()``: reduction, Adam, gather), the slowest rank's median.
Stages 0-1 copy the gradients into ``opt.grads`` (standing for the backward, not
counted) and call ``opt.step()``; stages 2-3 hand each tensor over in reverse order
with ``opt.gradients()`` (reduce-scattered bucket by bucket) and call ``opt.step()``;
stage 3 also gathers every tensor twice with ``opt.gathered()`` (a forward and a
backward), which is its 3P communication volume. ``wall_ms`` is the whole iteration.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..buffers import Kind, StateKind
from ..mpi.bare import idle_barrier
from ..mpi.collectives import Comm
from ..plan import Reduce
from ..runtime import clock
from ..timings import PHASES
from .model import LR, deferred_model

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer

T = TypeVar("T")

#: Adam moves 7 arrays' worth of bytes per element: reads p, m, v, g; writes p, m, v.
ADAM_ARRAYS = 7


def update_arrays(states: Sequence[StateKind], dtype: np.dtype, rereads: int = 0) -> float:
    """Arrays of the master ``dtype`` an update rule with ``states`` reads or writes
    per element: param, grad and the states read, param and the states written (a
    state of another dtype, or with one entry per block, counted by its bytes: 8-bit
    Adam's codes a quarter each, its scales 1/256), and the ``rereads`` its data flow
    needs (:attr:`zerompi.rules.Rule.rereads`)."""
    state_bytes = sum(k.storage(dtype).itemsize / (k.block or 1) for k in states
                      if k.per in ("element", "block"))  # (rows, columns: negligible)
    arrays = 3 + rereads + 2 * state_bytes / dtype.itemsize
    return int(arrays) if arrays == int(arrays) else arrays
#: Per stage: (reduction passes, gather passes) over the P parameters in one step.
PASSES = {0: (2, 0), 1: (1, 1), 2: (1, 1), 3: (1, 2)}


def slowest_median_ms(comm: Comm, seconds: Sequence[float]) -> float:
    """The largest over ranks of this rank's median, in milliseconds."""
    return comm.max(1e3 * float(np.median(seconds)) if len(seconds) else 0.0)


def on_rank0_alone(comm: Comm, work: Callable[[], T]) -> T:
    """Collective: ``work()`` on rank 0 while the other ranks idle; its result on every
    rank (an exception on rank 0 aborts the job through the abort hook)."""
    comm.barrier()
    result = work() if comm.rank == 0 else None
    idle_barrier(comm)
    return comm.allgather(result)[0]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing (or ``b`` is 0)."""
    return a / b if a is not None and b else None


def gbps(nbytes: float, ms: float) -> float | None:
    """GB/s (1e9 B/s) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None


# -- our optimizer -----------------------------------------------------------------------


class PairedProbe:
    """``--paired-floor``: the bandwidth all ranks reach streaming together, one pass
    of :func:`zerompi.bench.floor.stream_bandwidth`'s probe (its arrays kept for the
    stage), taken right before a step so that the step is divided by what the memory
    gave at that moment."""

    def __init__(self, comm: Comm, elems: int) -> None:
        self.comm = comm
        self.a = np.full(elems, 1.0, np.float32)  # filled: its pages are touched
        self.b = np.full(elems, 0.5, np.float32)
        self.total = comm.sum(3 * self.a.nbytes)  # read a, read b, write a; every rank

    def __call__(self) -> float:
        self.comm.barrier()
        start = clock()
        np.add(self.a, self.b, out=self.a)
        return self.total / self.comm.max(clock() - start) / 1e9


#: How stages 2-3 hand gradients over in the benchmark (``--hand-over``).
HAND_OVERS = ("add", "blocks")


def run_iteration(
    opt: ZeroOptimizer, stage: int, grads: dict[str, np.ndarray], names: Sequence[str],
    hand_over: str = "add",
) -> None:  # fmt: skip
    """One optimizer-side iteration of ``stage`` with this rank's gradients: the
    backward's writes (not timed by the optimizer: a copy into ``opt.grads`` at stages
    0-1; at stages 2-3 ``opt.add_gradients`` or a copy into an ``opt.gradients``
    block, ``hand_over``), then ``step()``."""
    if stage < 2:
        for name in names:
            np.copyto(opt.grads[name], grads[name])  # stands for the backward
    else:
        if stage == 3:
            for name in names:  # the forward gathers every tensor once
                with opt.gathered(name):
                    pass
        for name in reversed(names):  # the backward gathers again and hands over
            with opt.gathered(name) if stage == 3 else nullcontext():
                if hand_over == "add":
                    opt.add_gradients({name: grads[name]})
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
    precision: tuple[str | None, str | None] = (None, None),
) -> dict[str, Any]:
    """Time ``--steps`` iterations of ``stage`` (after ``--warmup``); one row.
    ``precision``: the optimizer's ``(param_dtype, reduce_dtype)`` (the gradients
    are cast to the reduce dtype once, beforehand, as a model would produce them)."""
    dtype = np.dtype(args.dtype)
    params = sum(sizes)
    from ..optimizer import ZeroOptimizer

    opt = ZeroOptimizer(
        deferred_model(sizes, args.seed, dtype, args.matrix_cols),
        comm=comm.mpi,
        stage=stage,
        optimizer=getattr(args, "optimizer", "adam"),
        **({"momentum": 0.9} if getattr(args, "optimizer", "adam") == "sgd" else {}),
        lr=LR,
        bucket_elems=args.bucket_elems,
        shared_memory=not args.no_shared_memory,
        param_dtype=precision[0],
        reduce_dtype=precision[1],
        loss_scale=1.0 if precision[1] else None,
    )
    if precision[1]:
        low = next(iter(opt.engine.precisions.values())).reduce
        grads = {name: g.astype(low) for name, g in grads.items()}
    shared = opt.shared_memory
    node_shared = Kind.PARAMS in opt.engine.plan.node_memory
    # the reduction's pass also took the gradient statistics (one node, node memory,
    # gradients in the master dtype: zerompi.nodesum)
    fused = opt.engine.plan.reduce is Reduce.NODE_SUM and opt.nodes.count == 1
    stats_fused = bool(fused and not precision[1])
    names = list(grads)
    step_s: list[float] = []
    wall_s: list[float] = []
    phase_s: dict[str, list[float]] = {phase: [] for phase in PHASES}
    sent: dict[str, list[int]] = {"reduce_scatter": [], "allgather": []}
    paired: list[tuple[float, float]] = []  # (slowest rank's step s, GB/s right before)
    probe = PairedProbe(comm, args.stream_elems) if getattr(args, "paired_floor", False) else None
    opt.pop_timings()
    opt.comm.pop_traffic()
    for i in range(args.warmup + args.steps):
        probed = probe() if probe is not None and i >= args.warmup else None
        comm.barrier()
        start = clock()
        run_iteration(opt, stage, grads, names, getattr(args, "hand_over", "add"))
        wall = clock() - start
        timings = opt.pop_timings()
        traffic = opt.comm.pop_traffic()
        if i < args.warmup:
            continue
        if probed is not None:
            paired.append((comm.max(sum(timings.values())), probed))
        wall_s.append(wall)
        step_s.append(sum(timings.values()))
        for phase in PHASES:
            phase_s[phase].append(timings.get(phase, 0.0))
        sent["reduce_scatter"].append(
            sum(traffic.get(op, {}).get("sent", 0) for op in ("reduce_scatter", "allreduce"))
        )
        sent["allgather"].append(traffic.get("allgather", {}).get("sent", 0))
    del probe
    local = params if stage == 0 else sum(opt.layout.shard_sizes.values())
    rule = opt.engine.rule
    arrays = update_arrays(rule.states, dtype, rule.rereads)
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
        "reduce_scatter": gbps(sent_bytes["reduce_scatter"], phase_ms["reduce_scatter"]),
        "allgather": gbps(sent_bytes["allgather"], phase_ms["allgather"]) if passes[1] else None,
        "reduce_scatter_algbw": gbps(
            nbytes * (1 if stage == 0 else passes[0]), phase_ms["reduce_scatter"]
        ),
        "allgather_algbw": gbps(nbytes * passes[1], phase_ms["allgather"]) if passes[1] else None,
        "adam": gbps(arrays * dtype.itemsize * busiest, phase_ms["adam"]),
    }
    return {
        "stage": stage,
        "optimizer": rule.name,
        # arrays the update reads or writes per element: param, grad, each state read,
        # param and each state written (Adam: 7)
        "update_arrays": arrays,
        "params": params,
        "dtype": args.dtype,  # the master copy's
        "param_dtype": precision[0] or args.dtype,
        "reduce_dtype": precision[1] or args.dtype,
        "world_size": comm.size,
        "tensors": len(sizes),
        "buckets": buckets,
        "shared_memory": shared,
        # one parameter copy per node (stages 1-2 with shared memory, and stage 3 on one
        # node): Adam writes it in place, no gather copy
        "node_shared": node_shared,
        "stats_fused": stats_fused,
        # how stages 2-3 handed the gradients over (--hand-over)
        "hand_over": getattr(args, "hand_over", "add") if stage >= 2 else None,
        "step_ms": slowest_median_ms(comm, step_s),
        "phase_ms": phase_ms,
        "wall_ms": slowest_median_ms(comm, wall_s),
        "comm_bytes": sent_bytes,
        "adam_elems": busiest,
        "adam_elems_per_s": busiest / (phase_ms["adam"] * 1e-3) if phase_ms["adam"] > 0 else None,
        "bandwidth_gbps": bandwidth,
        # --paired-floor: per timed step, (the slowest rank's step s, the bandwidth
        # probed right before it, GB/s)
        **({"paired": paired} if paired else {}),
    }


