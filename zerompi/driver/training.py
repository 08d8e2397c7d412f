"""The driver's training loop: the MLP's forward and backward through the optimizer,
micro-batches, per-step records, checkpoints.

A rank's gradient is that of its rows scaled by ``W / rows``, so that the optimizer's
division by ``W * micro_batches`` yields the mean gradient of every micro-batch,
averaged over micro-batches. The model is built from :func:`zerompi.mlp.deferred_params`:
rank 0 makes the initial values one bucket at a time inside the optimizer, so no rank
ever holds the whole initial model outside it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import mlp
from ..adam import KERNEL
from ..elastic import RankLost
from ..mpi.collectives import Comm
from ..mpi.launch import library_version
from ..partition import shard_range
from ..precision import LossScale
from ..runtime import clock, current_rss_bytes
from ..timings import PHASES
from .checkpoints import resume_path, save_checkpoint, survived

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer

#: The collectives whose traffic ``comm_bytes`` reports (``Comm.pop_traffic`` ops), and
#: an elastic run's snapshots (a mean over steps: they are sent every K steps).
COMM_OPS = ("reduce_scatter", "allgather", "allreduce", "snapshot")

#: Per stage, how many times every parameter's bytes cross the network in one step
#: without accumulation, times (W-1)/W: an allreduce (= reduce-scatter + allgather)
#: or a reduce-scatter and an allgather; stage 3 gathers every layer twice (forward
#: and backward).
COMM_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}


def comm_theory(args: argparse.Namespace, params: int, world: int, layers: bool = True) -> float:
    """Bytes every rank sends per step without accumulation: every parameter's bytes
    on each wire, times (W-1)/W (:data:`COMM_FACTOR` in one dtype; with
    ``--param-dtype``/``--reduce-dtype``, the reduction in the reduce dtype and the
    gathers in the parameter dtype; stage 0's 16-bit reduction gathers the reduced
    shards in the master dtype). ``layers``: stage 3 gathers every layer twice (else,
    on one node with shared memory, it publishes the node's copy once, as stage 2)."""
    m = np.dtype(args.dtype).itemsize
    p = 2 if args.param_dtype else m
    r = 2 if args.reduce_dtype else m
    per = {0: r + (m if args.reduce_dtype else r), 1: r + p, 2: r + p,
           3: r + 2 * p if layers else r + p}  # fmt: skip
    return per[args.stage] * params * (world - 1) / world


# -- one micro-batch ---------------------------------------------------------------


def rule_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The update rule's settings from the command line (``--optimizer`` and the
    settings that rule reads; another rule's are left at their defaults)."""
    out: dict[str, Any] = {"optimizer": args.optimizer, "lr": args.lr,
                           "weight_decay": args.weight_decay,
                           "decoupled_weight_decay": args.adamw}  # fmt: skip
    if args.optimizer == "sgd":
        out.update(momentum=args.momentum, nesterov=args.nesterov)
    return out


def micro_batch_rows(batch: int, micro_batches: int) -> list[int]:
    """Rows of each micro-batch of a global batch (split with ``shard_range``)."""
    ranges = (shard_range(batch, micro_batches, m) for m in range(micro_batches))
    return [hi - lo for lo, hi in ranges]


def micro_batch(
    opt: ZeroOptimizer, names: Sequence[str], x: np.ndarray, y: np.ndarray, scale: float
) -> float:
    """Forward and backward of this rank's rows ``(x, y)`` of one micro-batch, layer
    by layer through the optimizer, in every stage. Collective: every rank takes the
    same ``opt.gathered`` / ``opt.gradients`` steps, even with no rows. Adds
    ``scale * d loss / d param`` and returns the summed loss of the rows."""
    last = len(names) - 1
    acts = [x]  # the input of every layer
    for i, name in enumerate(names):
        with opt.gathered(name) as p:
            acts.append(mlp.layer_forward(upcast(p, x.dtype), i, acts[-1], last=i == last))
    loss, delta = mlp.loss_grad(acts.pop(), y, scale)
    # A scaled gradient may overflow its 16-bit dtype: step() skips it and lowers the
    # loss scale, which is the point; numpy need not warn about it.
    scaled = opt.engine.scaler is not None
    quiet = np.errstate(over="ignore", invalid="ignore") if scaled else contextlib.nullcontext()
    with quiet:
        for i in range(last, -1, -1):
            with opt.gathered(names[i]) as p, opt.gradients(names[i]) as g:
                delta = mlp.layer_backward(
                    upcast(p, x.dtype), g, i, acts.pop(), delta, first=i == 0
                )
    return loss


def upcast(p: dict[str, np.ndarray], dtype: np.dtype) -> dict[str, np.ndarray]:
    """A layer's parameters in the compute dtype: 16-bit ones (``--param-dtype``)
    upcast, one layer at a time, as CPUs without 16-bit matmuls compute; gradients
    are rounded to ``--reduce-dtype`` where they are added into the optimizer's."""
    if all(a.dtype == dtype for a in p.values()):
        return p
    return {name: a.astype(dtype) for name, a in p.items()}


def warm_up(comm: Comm, args: argparse.Namespace) -> None:
    """Touch what every process pays for once, outside the model and the optimizer:
    MPI's first-use allocations, and the BLAS library's working buffers, which grow
    with the matrix shapes it has seen (so one forward and one weight-gradient product
    of the widest layer, on throwaway arrays). The RSS floor is taken after this, so
    that peak - floor is what the model and the optimizer hold."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    fan_in, fan_out = max(itertools.pairwise(sizes), key=lambda io: io[0] * io[1])
    rows = -(-args.batch // args.micro_batches // comm.size) or 1
    x = np.ones((rows, fan_in), dtype)
    w = np.ones((fan_in, fan_out), dtype)
    d = x @ w
    w = x.T @ d
    d @ w.T
    del x, w, d
    for kind in (np.float32, np.float64):
        buf = np.zeros(1 << 16, kind)
        comm.bcast_inplace(buf)
        comm.allreduce_inplace(buf)
    comm.pop_traffic()
    comm.barrier()


def _median(values: np.ndarray) -> float:
    """Median without the first (warm-up) value when there are more."""
    return float(np.median(values[1:] if len(values) > 1 else values))


# -- the run -----------------------------------------------------------------------


def make_optimizer(args: argparse.Namespace, comm: Comm) -> ZeroOptimizer:
    """Collective: the optimizer over the MLP of ``args`` (not yet resumed)."""
    from ..optimizer import ZeroOptimizer

    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    return ZeroOptimizer(
        mlp.deferred_params(sizes, args.seed, dtype),
        comm=comm.mpi,
        stage=args.stage,
        **rule_keywords(args),
        bucket_elems=args.bucket_elems,
        max_norm=args.max_norm,
        nonfinite=args.nonfinite,
        shared_memory=args.shared_memory,
        overlap=not args.no_overlap,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        loss_scale=loss_scale_arg(args.loss_scale),
        elastic=args.elastic,
        snapshot_every=args.snapshot_every,
    )


def loss_scale_arg(value: str | None) -> str | float | LossScale | None:
    """``--loss-scale``: ``dynamic``, ``dynamic:INIT`` (dynamic from INIT instead of
    2**16), a number (static), or none given."""
    if value is None or value == "dynamic":
        return value
    try:
        if value.startswith("dynamic:"):
            return LossScale(init=float(value.partition(":")[2]))
        return float(value)
    except ValueError:
        raise ValueError(
            f"--loss-scale must be 'dynamic', 'dynamic:INIT' or a number, got {value!r}"
        ) from None


def resume(opt: ZeroOptimizer, args: argparse.Namespace) -> int:
    """Collective: load ``--resume`` (if given); the step to start from, which is the
    number of batches the checkpoint has seen (0 without ``--resume``)."""
    if not args.resume:
        return 0
    path = resume_path(args.resume, opt.comm)
    opt.load(path)
    first_step = opt.step_count + opt.skipped_steps  # the batches already seen
    if first_step >= args.steps:
        raise ValueError(f"{path} is at step {first_step}: nothing to do for --steps {args.steps}")
    if opt.comm.rank == 0:
        print(f"zerompi.driver: resumed from {path} at step {first_step}", flush=True)
    return first_step


class Records:
    """Per-step records of a run of ``n`` steps, allocated up front so that a long
    run's memory stays flat; a step redone after a lost rank overwrites its row."""

    def __init__(self, n: int) -> None:
        self.losses, self.step_s, self.train_s = np.zeros(n), np.zeros(n), np.zeros(n)
        self.norms = np.zeros(n)
        self.scales = np.zeros(n)  # the loss scale each step used
        self.phase_s = {phase: np.zeros(n) for phase in PHASES}
        self.sent = {op: np.zeros(n, np.int64) for op in COMM_OPS}
        self.between = {op: np.zeros(n, np.int64) for op in COMM_OPS}  # of it, across nodes
        self.rss_trace: list[list[int]] = []  # [step, max current RSS over ranks] when logging


def train_step(
    opt: ZeroOptimizer, args: argparse.Namespace, names: Sequence[str], rows: Sequence[int],
    step: int, i: int, rec: Records,
) -> float:  # fmt: skip
    """Collective: batch ``step``'s micro-batches (each split over the ranks with
    ``shard_range``), ``accumulate()`` after each and ``step()``; its records into
    row ``i`` of ``rec``. Returns the batch's mean loss."""
    comm, dtype = opt.comm, np.dtype(args.dtype)
    world, rank = comm.size, comm.rank
    start = clock()
    local_loss = 0.0
    optimizer = 0.0
    for micro, micro_rows in enumerate(rows):
        x, y = mlp.make_batch(args.seed, step, micro, micro_rows, args.in_dim, args.classes, dtype)
        lo, hi = shard_range(micro_rows, world, rank)
        scale = world / micro_rows * opt.loss_scale
        local_loss += micro_batch(opt, names, x[lo:hi], y[lo:hi], scale)
        t0 = clock()
        opt.accumulate()
        optimizer += clock() - t0
    rec.scales[i] = opt.loss_scale  # what this step's gradients were scaled by
    t0 = clock()
    opt.step()
    end = clock()
    rec.step_s[i] = optimizer + end - t0
    rec.train_s[i] = end - start
    rec.norms[i] = opt.last_grad_norm
    for phase, seconds in opt.pop_timings().items():
        rec.phase_s[phase][i] = seconds
    traffic = comm.pop_traffic()
    for op in COMM_OPS:
        rec.sent[op][i] = traffic.get(op, {}).get("sent", 0)
        rec.between[op][i] = traffic.get(op, {}).get("sent_between", 0)
    return comm.sum(local_loss) / args.batch


def train(args: argparse.Namespace, comm: Comm) -> tuple[ZeroOptimizer, dict[str, Any]]:
    """The sharded training run, steps ``first_step .. --steps - 1`` (``first_step``
    is the resumed checkpoint's step, else 0). Returns the optimizer and the (global)
    figures, the same on every rank."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    names = mlp.layer_names(sizes)
    opt = make_optimizer(args, comm)
    comm = opt.comm  # every collective below goes through the optimizer's Comm
    world, rank = comm.size, comm.rank
    first_step = resume(opt, args)
    rows = micro_batch_rows(args.batch, args.micro_batches)
    params = sum(spec.size for spec in opt.layout.params)
    n = args.steps - first_step  # the steps this process runs
    if rank == 0:
        print(
            f"zerompi.driver: MLP {'-'.join(map(str, sizes))}, {params:,} params "
            f"({args.dtype}), world size {world}, stage {args.stage}, "
            f"{len(opt.layout.buckets)} bucket(s), batch {args.batch} in "
            f"{args.micro_batches} micro-batch(es), "
            + (f"steps {first_step + 1}-{args.steps} ({n})" if first_step else f"{n} steps"),
            flush=True,
        )
    rec = Records(n)
    losses, step_s, train_s = rec.losses, rec.step_s, rec.train_s
    comm.pop_traffic()  # count training traffic only
    comm.barrier()  # start the clocks together
    step = first_step
    while step < args.steps:
        i = step - first_step  # a step redone after a lost rank overwrites its records
        try:
            with opt.survive():  # a lost rank seen anywhere in the step: RankLost
                losses[i] = train_step(opt, args, names, rows, step, i, rec)
                logged = step % args.log_every == 0 or step == args.steps - 1
                if logged:  # the same steps on every rank: this is a collective
                    rec.rss_trace.append([step + 1, int(opt.comm.max(current_rss_bytes()))])
                if opt.comm.rank == 0 and logged:
                    print(
                        f"step {step + 1:>{len(str(args.steps))}}/{args.steps}  "
                        f"loss {losses[i]:.4f}  step {1e3 * step_s[i]:.2f} ms  "
                        f"train step {1e3 * train_s[i]:.2f} ms  grad norm "
                        f"{opt.last_grad_norm:.3g}"
                        + (f"  skipped {opt.skipped_steps}" if opt.skipped_steps else ""),
                        flush=True,
                    )
                every = args.save_every
                if args.save and (step == args.steps - 1 or (every and (step + 1) % every == 0)):
                    saved = save_checkpoint(opt, args)
                    opt.comm.pop_traffic()  # not training traffic
                    if opt.comm.rank == 0:
                        print(f"zerompi.driver: saved {saved}", flush=True)
            step += 1
        except RankLost as lost:
            step = survived(opt, args, lost)
    norms, scales, phase_s, sent, between = (
        rec.norms, rec.scales, rec.phase_s, rec.sent, rec.between)  # fmt: skip
    rss_trace = rec.rss_trace
    comm = opt.comm
    world, rank = comm.size, comm.rank
    memory = {k: int(comm.max(v)) for k, v in opt.memory_usage().items()}
    buffers: dict[str, int] = {}
    for rank_buffers in comm.allgather(opt.memory_buffers()):
        for name, nbytes in rank_buffers.items():
            buffers[name] = max(buffers.get(name, 0), nbytes)
    # Snapshots go every K steps: their mean per step, not the median.
    step_sent = {op: float(np.mean(sent[op])) if op == "snapshot" else _median(sent[op])
                 for op in COMM_OPS}  # fmt: skip
    step_between = {op: _median(between[op]) for op in COMM_OPS}
    itemsize = dtype.itemsize
    results: dict[str, Any] = {
        "world_size": world,
        # --elastic: every lost rank survived (step gone back to, world sizes, seconds)
        "recoveries": opt.recoveries,
        "stage": args.stage,
        "params": params,
        # The step reached (--steps); this process ran steps_run of them, from
        # first_step (the resumed checkpoint's step, else 0).
        "steps": args.steps,
        "first_step": first_step,
        "steps_run": n,
        "dtype": args.dtype,
        "batch": args.batch,
        # Stages 2-3 reduce-scatter (and stage 3 gathers) once per micro-batch: their
        # comm_bytes are micro_batches times what comm_bytes_theory counts.
        "micro_batches": args.micro_batches,
        "buckets": len(opt.layout.buckets),
        "layer_sizes": sizes,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "adamw": args.adamw,
        "optimizer": args.optimizer,
        "seed": args.seed,
        "bucket_elems": args.bucket_elems,
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
        # The slowest rank's medians: the step is only as fast as the last rank.
        "step_ms": comm.max(1e3 * _median(step_s)),
        "train_step_ms": comm.max(1e3 * _median(train_s)),
        "phase_ms": {phase: comm.max(1e3 * _median(phase_s[phase])) for phase in PHASES},
        # Bytes sent per step and collective: mean over ranks, and the busiest rank.
        "comm_bytes": {op: comm.sum(v) / world for op, v in step_sent.items()},
        "comm_bytes_max": {op: int(comm.max(v)) for op, v in step_sent.items()},
        "comm_bytes_between_nodes": {op: comm.sum(v) / world for op, v in step_between.items()},
        "nodes": [opt.nodes.count, opt.nodes.size],
        "comm_bytes_theory": comm_theory(args, params, world, not opt.engine.plan.full_params),
        "param_dtype": args.param_dtype or args.dtype,
        "reduce_dtype": args.reduce_dtype or args.dtype,
        "loss_scales": scales.tolist(),
        "memory_bytes": memory,
        "memory_buffers": buffers,
        # What the model keeps for backward on the busiest rank: its rows of the largest
        # micro-batch at the input and at every layer's output (not the optimizer's).
        "activation_bytes": max(hi - lo for lo, hi in (shard_range(r, world, 0) for r in rows))
        * sum(sizes)
        * itemsize,
        "mpi_library": library_version(),
        "adam_kernel": KERNEL,
        "skipped_steps": opt.skipped_steps,
        "grad_norm_last": opt.last_grad_norm,
        "max_norm": args.max_norm,
        "losses": losses.tolist(),
        # opt.last_grad_norm of every step run: the global L2 norm of the averaged
        # gradient before clipping (what --verify compares with the reference's).
        "grad_norms": norms.tolist(),
        "rss_trace": rss_trace,
    }
    return opt, results
