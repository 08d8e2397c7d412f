"""The command line of ``python -m zerompi.driver``: options, their cross-checks,
and :func:`main`, which aborts the whole MPI job when one rank fails."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..mpi.collectives import Comm
from ..partition import DEFAULT_BUCKET_ELEMS, STAGES
from ..rules import RULES
from ..runtime import (
    HelpFormatter,
    Parser,
    add_shared_memory_options,
    non_negative,
    non_negative_float,
    positive,
    positive_float,
    prepare_outputs,
)
from .training import micro_batch_rows
from .verify import EIGHT_BIT_TOLERANCE, NORM_TOLERANCE, TOLERANCE


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """The command line of ``python -m zerompi.driver`` (prints on ``rank`` 0 only)."""
    p = Parser(
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
            "largest ru_maxrss over ranks. --verify compares the parameters (relative to the "
            f"largest) within {TOLERANCE['float32']:g} in float32 and "
            f"{TOLERANCE['float64']:g} in float64, and every step's gradient norm "
            f"(relative) within {NORM_TOLERANCE['float32']:g} / "
            f"{NORM_TOLERANCE['float64']:g}: the W-rank and one-process runs sum gradients "
            "in different orders, and the hidden activation is smooth (tanh) so that these "
            "rounding differences stay rounding differences. The norm check is what catches "
            "a wrongly averaged gradient, which Adam's m/sqrt(v) would otherwise hide. "
            f"With --optimizer adam8bit on more than one rank: {EIGHT_BIT_TOLERANCE[0]:g} "
            f"and {EIGHT_BIT_TOLERANCE[1]:g} (a gradient summed in another order flips an "
            "8-bit code now and then). "
            "After --resume, the summary and the JSON's steps_run count the steps this run "
            "made, from first_step to steps."
        ),
        formatter_class=HelpFormatter,
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
    p.add_argument("--steps", type=positive, default=200, help="optimizer steps to train")
    p.add_argument(
        "--seed",
        type=non_negative,
        default=0,
        help="seed of the initial parameters and of the data",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="rank 0 writes the results (losses, timings, memory, ...) to PATH (its "
        "folder is made first if missing)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="afterwards retrain unsharded in rank 0 with the reference Adam and "
        "fail (exit 1) unless the parameters agree within "
        f"{TOLERANCE['float32']:g} (float32) / {TOLERANCE['float64']:g} "
        "(float64), relative to the largest parameter, and every step's gradient norm "
        f"within {NORM_TOLERANCE['float32']:g} / {NORM_TOLERANCE['float64']:g} (relative)",
    )
    p.add_argument("--hidden", type=positive, default=128, help="width of the hidden layers")
    p.add_argument(
        "--depth",
        type=non_negative,
        default=2,
        help="number of hidden layers (0: a linear classifier)",
    )
    p.add_argument("--in-dim", type=positive, default=32, help="input features")
    p.add_argument("--classes", type=positive, default=10, help="output classes")
    p.add_argument(
        "--batch",
        type=positive,
        default=256,
        help="rows of every global batch, over all ranks and micro-batches",
    )
    p.add_argument(
        "--micro-batches",
        type=positive,
        default=1,
        help="split every global batch into this many micro-batches "
        "(gradient accumulation); each must get at least one row",
    )
    p.add_argument(
        "--optimizer", choices=tuple(RULES), default="adam",
        help="the update rule (zerompi.rules): Adam/AdamW, SGD with momentum, Lion, "
        "Adam/AdamW with 8-bit states, Adafactor, Muon (AdamW for the vectors)",
    )  # fmt: skip
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate")
    p.add_argument(
        "--momentum", type=non_negative_float, default=0.0,
        help="SGD's momentum (--optimizer sgd only)",
    )  # fmt: skip
    p.add_argument(
        "--nesterov", action="store_true", help="SGD's Nesterov momentum (--optimizer sgd only)"
    )
    p.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.0,
        help="weight decay: an L2 term added to the gradient, or see --adamw",
    )
    p.add_argument(
        "--adamw", action="store_true",
        help="decoupled weight decay (AdamW, SGDW) instead of L2 (Lion's always is)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="dtype of the parameters, gradients, optimizer state and data",
    )
    p.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float16"),
        help="mixed precision: the parameters the model computes from (upcast to --dtype "
        "per layer) and the gather's wire; the master copy and Adam stay in --dtype",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("bfloat16", "float16"),
        help="mixed precision: the gradients handed over and the reduction's wire "
        "(summed in --dtype, never in 16 bits)",
    )
    p.add_argument(
        "--loss-scale",
        metavar="dynamic|dynamic:INIT|N",
        help="multiply the loss gradient by a scale that step() divides out: 'dynamic' "
        "(torch's GradScaler, from 2**16; the default with --reduce-dtype float16), "
        "dynamic from INIT, or a static number",
    )
    p.add_argument(
        "--bucket-elems",
        type=positive,
        default=DEFAULT_BUCKET_ELEMS,
        help="target elements per bucket (the unit of every collective)",
    )
    p.add_argument(
        "--blas-threads",
        type=positive,
        default=None,
        help="OpenBLAS threads per rank for the forward/backward matmuls (default: "
        "as OPENBLAS_NUM_THREADS/OMP_NUM_THREADS say if set, else cores // ranks "
        "when there is more than one rank)",
    )
    p.add_argument(
        "--log-every",
        type=positive,
        default=20,
        help="rank 0 prints a progress line every this many steps "
        "(and for the first and the last step)",
    )
    add_shared_memory_options(p)
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="the optimizer's overlap=False: one staging bucket, each reduction waited "
        "at once, and in stage 3 blocking gathers with no prefetch",
    )
    p.add_argument(
        "--max-norm",
        type=positive_float,
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
        "--save-every", type=positive, metavar="K", help="also checkpoint every K steps"
    )
    p.add_argument(
        "--keep",
        type=positive,
        default=3,
        help="keep the newest this many checkpoints of --save, delete older ones",
    )
    p.add_argument(
        "--resume",
        metavar="PATH",
        help="load this checkpoint (or the newest PATH.<step> if PATH is a --save "
        "prefix) and continue from its step up to --steps; any world size and stage",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="survive a lost rank (Open MPI launched with `mpiexec --with-ft ulfm`): "
        "in-memory snapshots every --snapshot-every steps, kept by a buddy rank; the "
        "survivors shrink the world, go back to the snapshot and continue (the JSON's "
        "recoveries lists each); with --save, a rank lost together with its buddy falls "
        "back to the newest checkpoint",
    )
    p.add_argument(
        "--snapshot-every",
        type=positive,
        default=10,
        metavar="K",
        help="with --elastic: snapshot every K steps (what a lost rank costs: up to K "
        "steps redone)",
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
    if args.optimizer != "sgd" and (args.momentum or args.nesterov):
        parser.error(f"--momentum and --nesterov are SGD's (--optimizer sgd), not "
                     f"{args.optimizer}'s")  # fmt: skip
    if args.nesterov and not args.momentum:
        parser.error("--nesterov needs --momentum > 0")
    if args.save_every and not args.save:
        parser.error("--save-every needs --save PREFIX")
    if args.elastic and args.shared_memory:
        parser.error("--elastic cannot use --shared-memory (a lost rank's node shared "
                     "memory cannot be recovered)")  # fmt: skip
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (the same on every rank). A usage error,
    or a ``--json`` path that cannot be written, exits with status 2 on every rank
    before any training."""
    from .run import run

    comm = Comm()
    args = parse_args(argv, comm.rank)
    problem = prepare_outputs(comm, [args.json])
    if problem:
        build_parser(comm.rank).error(f"--json: {problem}")
    # An exception from here on reaches zerompi's abort hook (installed at import):
    # one report (from rank 0 alone when every rank raised it), then MPI_Abort.
    return run(args, comm)
