"""Train the numpy MLP of :mod:`zerompi.mlp` with :class:`zerompi.ZeroOptimizer`.

Run as ``mpiexec -n W python -m zerompi.driver [options]`` (``--help`` lists them).
Every global batch is split into micro-batches with :func:`zerompi.shard_range`, and
each micro-batch's rows are split over the ranks the same way. Every stage (0-3) runs
the same code: the forward layer by layer inside ``opt.gathered(layer)``, the
backward in reverse inside ``opt.gathered(layer)`` and ``opt.gradients(layer)``
(stages 2-3 reduce-scatter a bucket as soon as its gradients are handed over), then
``opt.accumulate()`` after each micro-batch and ``opt.step()``. A rank's gradient is
that of its rows scaled by ``W / rows``, so that the optimizer's division by
``W * micro_batches`` yields the mean gradient of every micro-batch, averaged over
micro-batches. The model is built from :func:`zerompi.mlp.deferred_params`: rank 0
makes the initial values one bucket at a time inside the optimizer, so no rank ever
holds the whole initial model outside it. Rank 0 prints progress and a summary and,
with ``--json``, writes the figures to a file.

``--verify`` then copies the parameters out with ``opt.full_params()`` (collective),
retrains the same model unsharded in rank 0 alone, with
:class:`zerompi.reference.ReferenceAdam` on the same batches, and compares the
parameters: the exit status is 1 on every rank if they differ by more than a
tolerance for the dtype.

An exception on one rank prints ``zerompi.driver: rank R failed: ...`` with its
traceback and aborts the whole MPI job, so that ``mpiexec`` never hangs waiting for
the other ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

try:
    import resource
except ImportError:  # not a Unix: no getrusage, no RSS figures
    resource = None  # type: ignore[assignment]

from . import mlp
from .adam import KERNEL
from .mpi.collectives import Comm
from .mpi.launch import library_version
from .engine import DEFAULT_BUCKET_ELEMS, PHASES, ZeroOptimizer
from .partition import STAGES, shard_range
from .reference import ReferenceAdam, average

#: Largest accepted ``max_abs_diff / max|reference param|`` of ``--verify``.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}

#: The collectives whose traffic ``comm_bytes`` reports (``Comm.pop_traffic`` ops).
COMM_OPS = ("reduce_scatter", "allgather", "allreduce")

#: Per stage, how many times every parameter's bytes cross the network in one step
#: without accumulation, times (W-1)/W: an allreduce (= reduce-scatter + allgather)
#: or a reduce-scatter and an allgather; stage 3 gathers every layer twice (forward
#: and backward).
COMM_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}


class _Parser(argparse.ArgumentParser):
    """An argument parser that only prints on rank 0, so ``--help`` and usage
    errors appear once instead of once per rank (every rank still exits)."""

    def __init__(self, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank = rank

    def _print_message(self, message: str, file: Any = None) -> None:
        if self._rank == 0:
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if self._rank != 0:
            message = None
        super().exit(status, message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only for options that have a meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return number


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """The command line of ``python -m zerompi.driver``."""
    p = _Parser(
        prog="python -m zerompi.driver",
        rank=rank,
        description=(
            "Train an MLP classifier (numpy, hand-written backward) with zerompi's "
            "optimizer (plain data parallelism or ZeRO stage 1, 2 or 3) on a synthetic, "
            "learnable task. Run it under 'mpiexec -n W'. Rank 0 prints the loss and the "
            "step time every --log-every steps and a summary at the end."
        ),
        epilog=(
            "A run of >= 16 million parameters: --hidden 2048 --depth 4 --in-dim 2048 "
            "(16.8M; wide layers want a smaller rate, e.g. --lr 1e-4, and --dtype float32 "
            "halves the memory). Timings are the slowest rank's medians over the steps, "
            "the first (warm-up) step excluded; step_ms is accumulate() + step() only, while "
            "stages 2-3 reduce-scatter inside the backward and stage 3 gathers inside the "
            "forward and backward, so compare stages by train_step_ms. The JSON's "
            "comm_bytes is the bytes a rank sends per step and collective (mean over ranks, "
            "median over steps); comm_bytes_theory is k * P * itemsize * (W-1) / W with k = 2 "
            "for stages 0-2 and 3 for stage 3, for one micro-batch: with --micro-batches n, "
            "stages 2-3 reduce-scatter (and stage 3 gathers) once per micro-batch, so their "
            "measured traffic grows n-fold. rss_floor_bytes (after imports and MPI init, "
            "before the model) and rss_peak_bytes (end of training, before --verify) are the "
            "largest ru_maxrss over ranks. --verify tolerates a relative difference of "
            "1e-4 in float32 and 1e-10 in float64: the W-rank and one-process runs sum "
            "gradients in different orders, and the hidden activation is smooth (tanh) so "
            "that these rounding differences stay rounding differences."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--stage",
        type=int,
        choices=STAGES,
        default=2,
        help="0: plain data parallelism (Allreduce, replicated Adam); ZeRO stage 1 shards "
        "the Adam moments, 2 also the gradients (each bucket reduce-scattered during the "
        "backward as soon as all its gradients are in), 3 also the parameters (gathered "
        "one layer at a time when used)",
    )
    p.add_argument("--steps", type=_positive, default=200, help="optimizer steps to train")
    p.add_argument(
        "--seed",
        type=_non_negative,
        default=0,
        help="seed of the initial parameters and of the data",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="rank 0 writes the results (losses, timings, memory, ...) to PATH",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="afterwards retrain unsharded in rank 0 with the reference Adam and "
        "fail (exit 1) unless the parameters agree within "
        f"{TOLERANCE['float32']:g} (float32) / {TOLERANCE['float64']:g} "
        "(float64), relative to the largest parameter",
    )
    p.add_argument("--hidden", type=_positive, default=128, help="width of the hidden layers")
    p.add_argument(
        "--depth",
        type=_non_negative,
        default=2,
        help="number of hidden layers (0: a linear classifier)",
    )
    p.add_argument("--in-dim", type=_positive, default=32, help="input features")
    p.add_argument("--classes", type=_positive, default=10, help="output classes")
    p.add_argument(
        "--batch",
        type=_positive,
        default=256,
        help="rows of every global batch, over all ranks and micro-batches",
    )
    p.add_argument(
        "--micro-batches",
        type=_positive,
        default=1,
        help="split every global batch into this many micro-batches "
        "(gradient accumulation); each must get at least one row",
    )
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="Adam learning rate")
    p.add_argument(
        "--weight-decay",
        type=_non_negative_float,
        default=0.0,
        help="weight decay: an L2 term added to the gradient, or see --adamw",
    )
    p.add_argument(
        "--adamw", action="store_true", help="decoupled weight decay (AdamW) instead of L2"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="dtype of the parameters, gradients, optimizer state and data",
    )
    p.add_argument(
        "--bucket-elems",
        type=_positive,
        default=DEFAULT_BUCKET_ELEMS,
        help="target elements per bucket (the unit of every collective)",
    )
    p.add_argument(
        "--blas-threads",
        type=_positive,
        default=None,
        help="OpenBLAS threads per rank for the forward/backward matmuls (default: "
        "as OPENBLAS_NUM_THREADS/OMP_NUM_THREADS say if set, else cores // ranks "
        "when there is more than one rank)",
    )
    p.add_argument(
        "--log-every",
        type=_positive,
        default=20,
        help="rank 0 prints a progress line every this many steps "
        "(and for the first and the last step)",
    )
    p.add_argument(
        "--shared-memory",
        action="store_true",
        help="stages 2-3: reduce gradient buckets through an MPI-3 shared-memory window "
        "instead of messages, when every rank is on one node",
    )
    p.add_argument(
        "--max-norm",
        type=_positive_float,
        help="clip the averaged gradient to this global L2 norm (torch's clip_grad_norm_)",
    )
    p.add_argument(
        "--nonfinite",
        choices=("skip", "raise"),
        default="skip",
        help="a step whose gradient has a NaN or inf on any rank is skipped on every rank "
        "(counted in the progress line and the JSON), or raises",
    )
    p.add_argument(
        "--save",
        metavar="PREFIX",
        help="write checkpoints PREFIX.<step> (8 digits; one file each, MPI-IO, atomic) "
        "after the last step and every --save-every steps",
    )
    p.add_argument(
        "--save-every", type=_positive, metavar="K", help="also checkpoint every K steps"
    )
    p.add_argument(
        "--keep",
        type=_positive,
        default=3,
        help="keep the newest this many checkpoints of --save, delete older ones",
    )
    p.add_argument(
        "--resume",
        metavar="PATH",
        help="load this checkpoint (or the newest PATH.<step> if PATH is a --save "
        "prefix) and continue from its step up to --steps; any world size and stage",
    )
    return p


def parse_args(argv: Sequence[str] | None, rank: int = 0) -> argparse.Namespace:
    """Parse and cross-check the options (identically on every rank)."""
    parser = build_parser(rank)
    args = parser.parse_args(argv)
    rows = micro_batch_rows(args.batch, args.micro_batches)
    if 0 in rows:
        parser.error(
            f"--batch {args.batch} split into --micro-batches {args.micro_batches} with "
            f"shard_range gives micro-batches of {rows} rows; every micro-batch needs at "
            "least one row (use a larger --batch or fewer --micro-batches)"
        )
    if args.save_every and not args.save:
        parser.error("--save-every needs --save PREFIX")
    return args


def checkpoint_path(prefix: str, step: int) -> str:
    return f"{prefix}.{step:08d}"


def saved_checkpoints(prefix: str) -> list[str]:
    """The checkpoints PREFIX.<8 digits> that exist, oldest first."""
    folder = os.path.dirname(prefix) or "."
    base = os.path.basename(prefix) + "."
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    steps = sorted(
        n
        for n in names
        if n.startswith(base) and n[len(base) :].isdigit() and len(n) == len(base) + 8
    )
    return [os.path.join(folder, n) for n in steps]


def save_checkpoint(opt: ZeroOptimizer, args: argparse.Namespace) -> str:
    """Collective: checkpoint at the current step, then (rank 0) drop all but the
    newest --keep checkpoints of the prefix. Only complete files are ever deleted."""
    path = checkpoint_path(args.save, opt.step_count + opt.skipped_steps)  # batches seen
    opt.save(path)
    if opt.comm.rank == 0:
        for old in saved_checkpoints(args.save)[: -args.keep]:
            os.remove(old)
    opt.comm.barrier()
    return path


def resume_path(path: str, comm: Comm) -> str:
    """Rank 0's choice (every rank gets the same): the file itself, or the newest
    checkpoint of a --save prefix."""
    choice = path
    if comm.rank == 0 and not os.path.isfile(path):
        found = saved_checkpoints(path)
        choice = found[-1] if found else path
    return comm.allgather(choice)[0]


def micro_batch_rows(batch: int, micro_batches: int) -> list[int]:
    """Rows of each micro-batch of a global batch (split with ``shard_range``)."""
    ranges = (shard_range(batch, micro_batches, m) for m in range(micro_batches))
    return [hi - lo for lo, hi in ranges]


def openblas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """``(get, set)`` of the number of threads numpy's OpenBLAS uses, or ``None`` when
    no OpenBLAS is loaded (another BLAS, or not Linux). Works at run time, after
    numpy (and OpenBLAS's thread pool) has started, which environment variables
    cannot: ``python -m zerompi.driver`` imports numpy before this module runs.

    Why: every rank's OpenBLAS otherwise keeps one spinning thread per core, so W
    ranks on one node oversubscribe the cores and a small matmul can take tens of
    milliseconds instead of microseconds.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted(
                {ln.split()[-1] for ln in maps if "openblas" in ln.lower() and "/" in ln}
            )
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already loaded: this only looks it up
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                try:
                    setter = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                    getter = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                except AttributeError:
                    continue
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return getter, setter
    return None


def _auto_blas_threads(world: int) -> int | None:
    """Threads per rank when ``--blas-threads`` is not given: left alone (``None``)
    when the environment chooses (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``) or
    there is one rank, else the cores this process may use divided by the ranks
    (assumes that the ranks share one node: pass ``--blas-threads`` otherwise)."""
    if world == 1 or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world)


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.4g} {unit}"
        count /= 1024
    return f"{count:.4g} GiB"


def max_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (``ru_maxrss`` is in
    KiB on Linux and in bytes on macOS; 0 where there is no ``getrusage``)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``; elsewhere the
    peak so far). The floor is taken with this, not the peak, so that the warm-up's
    own temporaries do not raise it."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def _warm_up(comm: Comm, args: argparse.Namespace) -> None:
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
            acts.append(mlp.layer_forward(p, i, acts[-1], last=i == last))
    loss, delta = mlp.loss_grad(acts.pop(), y, scale)
    for i in range(last, -1, -1):
        with opt.gathered(names[i]) as p, opt.gradients(names[i]) as g:
            delta = mlp.layer_backward(p, g, i, acts.pop(), delta, first=i == 0)
    return loss


def _median(values: np.ndarray) -> float:
    """Median without the first (warm-up) value when there are more."""
    return float(np.median(values[1:] if len(values) > 1 else values))


def train(args: argparse.Namespace, comm: Comm) -> tuple[ZeroOptimizer, dict[str, Any]]:
    """The sharded training run. Returns the optimizer and the (global) figures."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    names = mlp.layer_names(sizes)
    opt = ZeroOptimizer(
        mlp.deferred_params(sizes, args.seed, dtype),
        comm=comm.mpi,
        stage=args.stage,
        lr=args.lr,
        weight_decay=args.weight_decay,
        decoupled_weight_decay=args.adamw,
        bucket_elems=args.bucket_elems,
        max_norm=args.max_norm,
        nonfinite=args.nonfinite,
        shared_memory=args.shared_memory,
    )
    comm = opt.comm  # every collective below goes through the optimizer's Comm
    world, rank = comm.size, comm.rank
    first_step = 0
    if args.resume:
        path = resume_path(args.resume, comm)
        opt.load(path)
        first_step = opt.step_count + opt.skipped_steps  # the batches already seen
        if first_step >= args.steps:
            raise ValueError(
                f"{path} is at step {first_step}: nothing to do for --steps {args.steps}"
            )
        if rank == 0:
            print(f"zerompi.driver: resumed from {path} at step {first_step}", flush=True)
    rows = micro_batch_rows(args.batch, args.micro_batches)
    params = sum(spec.size for spec in opt.layout.params)
    if rank == 0:
        print(
            f"zerompi.driver: MLP {'-'.join(map(str, sizes))}, {params:,} params "
            f"({args.dtype}), world size {world}, stage {args.stage}, "
            f"{len(opt.layout.buckets)} bucket(s), batch {args.batch} in "
            f"{args.micro_batches} micro-batch(es), {args.steps} steps",
            flush=True,
        )
    # Per-step records, allocated up front so that a long run's memory stays flat.
    n = args.steps - first_step
    losses, step_s, train_s = np.zeros(n), np.zeros(n), np.zeros(n)
    phase_s = {phase: np.zeros(n) for phase in PHASES}
    sent = {op: np.zeros(n, np.int64) for op in COMM_OPS}
    rss_trace: list[list[int]] = []  # [step, current RSS, max over ranks] when logging
    clock = time.perf_counter
    comm.pop_traffic()  # count training traffic only
    comm.barrier()  # start the clocks together
    for i, step in enumerate(range(first_step, args.steps)):
        start = clock()
        local_loss = 0.0
        optimizer = 0.0
        for micro, micro_rows in enumerate(rows):
            x, y = mlp.make_batch(
                args.seed, step, micro, micro_rows, args.in_dim, args.classes, dtype
            )
            lo, hi = shard_range(micro_rows, world, rank)
            local_loss += micro_batch(opt, names, x[lo:hi], y[lo:hi], world / micro_rows)
            t0 = clock()
            opt.accumulate()
            optimizer += clock() - t0
        t0 = clock()
        opt.step()
        end = clock()
        step_s[i] = optimizer + end - t0
        train_s[i] = end - start
        for phase, seconds in opt.pop_timings().items():
            phase_s[phase][i] = seconds
        traffic = comm.pop_traffic()
        for op in COMM_OPS:
            sent[op][i] = traffic.get(op, {}).get("sent", 0)
        losses[i] = comm.sum(local_loss) / args.batch
        logged = step % args.log_every == 0 or step == args.steps - 1
        if logged:  # the same steps on every rank: this is a collective
            rss_trace.append([step + 1, int(comm.max(current_rss_bytes()))])
        if rank == 0 and logged:
            print(
                f"step {step + 1:>{len(str(args.steps))}}/{args.steps}  "
                f"loss {losses[i]:.4f}  step {1e3 * step_s[i]:.2f} ms  "
                f"train step {1e3 * train_s[i]:.2f} ms  grad norm {opt.last_grad_norm:.3g}"
                + (f"  skipped {opt.skipped_steps}" if opt.skipped_steps else ""),
                flush=True,
            )
        if args.save and (
            step == args.steps - 1 or (args.save_every and (step + 1) % args.save_every == 0)
        ):
            saved = save_checkpoint(opt, args)
            comm.pop_traffic()  # not training traffic
            if rank == 0:
                print(f"zerompi.driver: saved {saved}", flush=True)
    memory = {k: int(comm.max(v)) for k, v in opt.memory_usage().items()}
    buffers: dict[str, int] = {}
    for rank_buffers in comm.allgather(opt.memory_buffers()):
        for name, nbytes in rank_buffers.items():
            buffers[name] = max(buffers.get(name, 0), nbytes)
    step_sent = {op: _median(sent[op]) for op in COMM_OPS}
    itemsize = dtype.itemsize
    results: dict[str, Any] = {
        "world_size": world,
        "stage": args.stage,
        "params": params,
        "steps": args.steps,
        "first_step": first_step,
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
        "comm_bytes_theory": COMM_FACTOR[args.stage] * params * itemsize * (world - 1) / world,
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
        "rss_trace": rss_trace,
    }
    return opt, results


def reference_params(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Train the same model unsharded, in this process alone, on the same batches:
    the gradient of a micro-batch is the mean over its rows, and a step's gradient
    the average of its micro-batches' (``zerompi.reference.average``)."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    ref = ReferenceAdam(
        mlp.init_params(sizes, args.seed, dtype),
        lr=args.lr,
        weight_decay=args.weight_decay,
        decoupled_weight_decay=args.adamw,
    )
    rows = micro_batch_rows(args.batch, args.micro_batches)
    for step in range(args.steps):
        micro_grads = []
        for micro, micro_rows in enumerate(rows):
            x, y = mlp.make_batch(
                args.seed, step, micro, micro_rows, args.in_dim, args.classes, dtype
            )
            grads = {name: np.zeros_like(p) for name, p in ref.params.items()}
            mlp.loss_and_grad(ref.params, x, y, grads, 1.0 / micro_rows)
            micro_grads.append(grads)
        grads = {name: average(g[name] for g in micro_grads) for name in ref.params}
        if args.max_norm is not None:  # torch's clip_grad_norm_ on the averaged gradient
            norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values())))
            if norm > args.max_norm:
                grads = {n: g * (args.max_norm / (norm + 1e-6)) for n, g in grads.items()}
        ref.step(grads)
    return ref.params


def verify(args: argparse.Namespace, opt: ZeroOptimizer) -> dict[str, float]:
    """Collective: compare the sharded model (copied out with ``opt.full_params()``,
    any stage) with the reference, trained by rank 0 while the other ranks wait in
    the final allgather. Every rank gets the result."""
    full = opt.full_params()
    result = None
    if opt.comm.rank == 0:
        start = time.perf_counter()
        ref = reference_params(args)
        max_abs = max(float(np.max(np.abs(full[n] - ref[n]))) for n in ref)
        scale = max(float(np.max(np.abs(p))) for p in ref.values())
        result = {
            "max_abs_diff": max_abs,
            "max_rel_diff": max_abs / scale if scale else max_abs,
            "tolerance": TOLERANCE[args.dtype],
            "reference_s": time.perf_counter() - start,
        }
    del full
    return opt.comm.allgather(result)[0]


def run(args: argparse.Namespace, comm: Comm, rss_floor: int | None = None) -> int:
    """Train, summarise, optionally verify and write JSON. Returns the exit status.
    ``rss_floor``: this rank's peak RSS before the model was built (default: now)."""
    blas = openblas_threads()
    previous = blas[0]() if blas else None
    threads = args.blas_threads or _auto_blas_threads(comm.size)
    try:
        if blas and threads:
            blas[1](threads)
        _warm_up(comm, args)
        if rss_floor is None:
            rss_floor = current_rss_bytes()
        wall = time.perf_counter()
        opt, results = train(args, comm)
        results["shared_memory"] = opt.shared_memory
        results["train_wall_s"] = comm.max(time.perf_counter() - wall)
        results["rss_floor_bytes"] = int(comm.max(rss_floor))
        results["rss_peak_bytes"] = int(comm.max(max_rss_bytes()))  # before --verify
        results["blas_threads"] = blas[0]() if blas else None
        return _finish(args, opt, results)
    finally:
        if blas and previous:
            blas[1](previous)  # leave the process as we found it (main() may be imported)


def _finish(args: argparse.Namespace, opt: ZeroOptimizer, results: dict[str, Any]) -> int:
    """Verify (optionally), print the summary, write the JSON; the exit status."""
    comm = opt.comm
    status = 0
    check = None
    if args.verify:
        check = verify(args, opt)
        results["max_abs_diff"] = check["max_abs_diff"]
        results["max_rel_diff"] = check["max_rel_diff"]
        results["verify_tolerance"] = check["tolerance"]
        results["verify_ok"] = check["max_rel_diff"] <= check["tolerance"]
        status = 0 if results["verify_ok"] else 1
    opt.close()  # collective: frees the shared-memory window, if any
    if comm.rank == 0:
        _summary(results, check)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
                f.write("\n")
    return status


def _summary(r: dict[str, Any], check: dict[str, float] | None) -> None:
    phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phase_ms"].items())
    memory = ", ".join(f"{k} {_format_bytes(v)}" for k, v in r["memory_bytes"].items())
    total = _format_bytes(sum(r["memory_bytes"].values()))
    traffic = ", ".join(f"{k} {_format_bytes(v)}" for k, v in r["comm_bytes"].items() if v)
    lines = [
        f"summary: {r['params']:,} params ({r['dtype']}), world size {r['world_size']}, "
        f"stage {r['stage']}, {r['buckets']} bucket(s), batch {r['batch']} in "
        f"{r['micro_batches']} micro-batch(es)",
        f"  loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} over {r['steps']} steps "
        f"({r['train_wall_s']:.2f} s)",
        f"  median step {r['step_ms']:.3f} ms (accumulate + step), train step "
        f"{r['train_step_ms']:.3f} ms (with forward/backward)",
        f"  median phase ms: {phases}",
        f"  sent per step and rank (mean over ranks): "
        f"{_format_bytes(sum(r['comm_bytes'].values()))} ({traffic or 'nothing'}); "
        f"textbook {_format_bytes(r['comm_bytes_theory'])} for one micro-batch",
        f"  optimizer memory per rank (max over ranks): {total}: {memory}",
        f"  peak RSS per rank (max over ranks): {_format_bytes(r['rss_peak_bytes'])}, of "
        f"which {_format_bytes(r['rss_floor_bytes'])} before the model was built",
        f"  MPI: {r['mpi_library']}; Adam kernel: {r['adam_kernel']}",
    ]
    if check is not None:
        verdict = "OK" if r["verify_ok"] else "FAILED"
        lines.append(
            f"  verify {verdict}: max_abs_diff {check['max_abs_diff']:.3e}, max_rel_diff "
            f"{check['max_rel_diff']:.3e} (tolerance {check['tolerance']:g}; reference "
            f"{check['reference_s']:.2f} s)"
        )
    print("\n".join(lines), flush=True)
    if check is not None and not r["verify_ok"]:
        print(
            f"zerompi.driver: verification FAILED: the sharded parameters differ from the "
            f"unsharded reference by {check['max_rel_diff']:.3e} relative to the largest "
            f"parameter, more than the {r['dtype']} tolerance {check['tolerance']:g}",
            file=sys.stderr,
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (the same on every rank)."""
    comm = Comm()
    try:
        return run(parse_args(argv, comm.rank), comm)
    except Exception as exc:
        if comm.size == 1:
            raise
        trace = traceback.format_exc()
        print(
            f"zerompi.driver: rank {comm.rank} failed: {type(exc).__name__}: {exc}\n{trace}",
            file=sys.stderr,
            flush=True,
        )
        comm.abort(1)
        raise  # not reached


if __name__ == "__main__":
    sys.exit(main())
