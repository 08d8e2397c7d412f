"""The command line of ``python -m zerompi.bench`` and :func:`main`, which checks
that the output files can be written before measuring anything, and aborts the whole
MPI job when one rank fails."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from ..mpi.collectives import Comm
from ..mpi.launch import install_abort_hook
from ..partition import DEFAULT_BUCKET_ELEMS, STAGES
from ..rules import RULES
from ..runtime import (
    HelpFormatter,
    Parser,
    count,
    non_negative,
    positive,
    prepare_outputs,
    write_json,
)
from .floor import STREAM_ELEMS
from .report import plot, table
from .run import run
from .timing import HAND_OVERS

DEFAULT_SIZES = (1_000_000, 16_000_000, 64_000_000)
#: The default many-tensor row: 1000 one-tensor layers of 256 elements (seconds).
DEFAULT_TENSORS = 1000
DEFAULT_TENSOR_SIZE = 256


def _size_list(text: str) -> list[int]:
    """Comma-separated counts (``1e6,1.6e7``)."""
    return [count(part) for part in text.split(",") if part.strip()] or _empty(text)


def _stage_list(text: str) -> list[int]:
    """Comma-separated stages, sorted, without repeats."""
    stages = []
    for part in text.split(","):
        if not part.strip():
            continue
        if part.strip() not in {str(s) for s in STAGES}:
            raise argparse.ArgumentTypeError(f"stages are {STAGES}, got {part!r}")
        stages.append(int(part))
    return sorted(set(stages)) or _empty(text)


def _empty(text: str) -> list[int]:
    """Reject an empty list."""
    raise argparse.ArgumentTypeError(f"an empty list: {text!r}")


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """The command line of ``python -m zerompi.bench``."""
    p = Parser(
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
            "The many-tensor row (--tensors) reports us_per_tensor = wall_ms / tensors "
            "and overhead_us_per_tensor = (wall_ms - bare_ms) / tensors, bare_ms being the "
            "same stage's bare collectives over the optimizer's buckets plus the kernel. "
            "floor_ms is the bytes the step's data flow must read and write at minimum "
            "(floor_bytes_per_elem, per shard element) over the memory bandwidth all "
            "ranks reach streaming together (stream_gbps, measured right before each stage); "
            "step/floor = step_ms / floor_ms. "
            "Targets (stage 2 ratios; stage 3 many-tensor overhead <= 30 us) are printed, "
            "not asserted. The folders of --json and --plot are made before measuring."
        ),
        formatter_class=HelpFormatter,
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
    p.add_argument("--steps", type=positive, default=10, help="timed steps per measurement")
    p.add_argument(
        "--warmup", type=non_negative, default=2, help="untimed steps before the timed ones"
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
        "--param-dtype", choices=("bfloat16", "float16"),
        help="also time every stage with this param_dtype (rows next to the --dtype ones)",
    )  # fmt: skip
    p.add_argument(
        "--reduce-dtype", choices=("bfloat16", "float16"),
        help="also time every stage with this reduce_dtype (with --param-dtype, both)",
    )  # fmt: skip
    p.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="shared_memory=False: MPI collectives only (by default the optimizer's "
        "shared_memory=True: stages 1-2 keep one parameter copy per node, stages 2-3 "
        "reduce within a node through shared memory)",
    )
    p.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="dtype of everything"
    )
    p.add_argument(
        "--optimizer", choices=tuple(RULES), default="adam",
        help="the update rule the stages run (zerompi.rules; SGD with momentum 0.9); its "
        "floor counts its states",
    )  # fmt: skip
    p.add_argument(
        "--hand-over", choices=HAND_OVERS, default="add",
        help="how stages 2-3 hand each gradient over: opt.add_gradients (what "
        "zerompi.torch.shard calls; a parameter's first gradient is copied over its stale "
        "staging, which needs no zeroing) or opt.gradients blocks copied into (blocks hand "
        "out zeros to add into); stages 0-1 copy into opt.grads either way",
    )  # fmt: skip
    p.add_argument(
        "--paired-floor", action="store_true",
        help="also probe the bandwidth right before every timed step (one pass of the "
        "stream probe), so that each step has its own floor: JSON step_per_floor_paired "
        "(the median over steps of a step over its floor) and stream_gbps_steps; on a "
        "machine whose bandwidth drifts within seconds",
    )  # fmt: skip
    p.add_argument(
        "--bucket-elems",
        type=positive,
        default=DEFAULT_BUCKET_ELEMS,
        help="target elements per bucket of the optimizer",
    )
    p.add_argument(
        "--tensor-elems",
        type=positive,
        default=1 << 22,
        help="largest parameter tensor in elements (the model is P split into such tensors)",
    )
    p.add_argument(
        "--matrix-cols",
        type=non_negative,
        default=0,
        help="shape each tensor of the model as a matrix of this many columns where it "
        "divides (what Adafactor factors); 0: vectors",
    )
    p.add_argument(
        "--tensors",
        type=non_negative,
        default=DEFAULT_TENSORS,
        help="also time a model of this many one-tensor layers of --tensor-size elements "
        "(stages of --stages), reporting the microseconds per tensor per step above the "
        "bare collectives; 0: no such row",
    )
    p.add_argument(
        "--tensor-size",
        type=positive,
        default=DEFAULT_TENSOR_SIZE,
        help="elements of each tensor of the --tensors row",
    )
    p.add_argument(
        "--stream-elems",
        type=positive,
        default=STREAM_ELEMS,
        help="float32 elements of each of the two arrays of the memory-bandwidth probe "
        "(every rank at once streams np.add(a, b, out=a)), whose bandwidth divides "
        "floor_ms; far larger than the cache, or the floor is not one",
    )
    p.add_argument(
        "--seed", type=non_negative, default=0, help="seed of the parameters and gradients"
    )
    p.add_argument(
        "--blas-threads",
        type=positive,
        default=None,
        help="OpenBLAS threads per rank (default: as the driver, cores // ranks when "
        "the environment does not say)",
    )
    return p


def parse_args(argv: Sequence[str] | None, rank: int = 0) -> argparse.Namespace:
    """Parse the options (identically on every rank); ``--plot`` defaults to the
    ``--json`` path with ``.png``."""
    args = build_parser(rank).parse_args(argv)
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    return args



def _gpt_argv(argv: list[str]) -> list[str] | None:
    """``argv`` without ``--model gpt`` when it is there (the side-by-side GPT
    benchmark, :mod:`zerompi.bench.gpt`), else ``None``."""
    for i, arg in enumerate(argv):
        if arg == "--model" and argv[i + 1 : i + 2] == ["gpt"]:
            return argv[:i] + argv[i + 2 :]
        if arg == "--model=gpt":
            return argv[:i] + argv[i + 1 :]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 on every rank). A usage error, or an
    output path (``--json``, ``--plot``) that cannot be written, exits with status 2
    on every rank before anything is measured; a missing folder is made."""
    argv = list(sys.argv[1:] if argv is None else argv)
    gpt = _gpt_argv(argv)
    if gpt is not None:  # launched without mpiexec; see zerompi.bench.gpt
        from .gpt import main as gpt_main

        return gpt_main(gpt)
    install_abort_hook()  # any exception on any rank ends the whole job
    comm = Comm()
    try:
        args = parse_args(argv, comm.rank)
        problem = prepare_outputs(comm, [args.json, args.plot])
        if problem:
            build_parser(comm.rank).error(problem)
        results = run(args, comm, argv)
        if comm.rank == 0:
            print(table(results), flush=True)
            if args.json:
                write_json(args.json, results)
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
