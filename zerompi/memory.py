"""What a :class:`zerompi.ZeroOptimizer` will hold, per rank, without building one.

:func:`estimate` builds the same :class:`zerompi.partition.Layout` the optimizer
builds (same buckets, same ``shard_range`` counts) and reads the same buffer plan
(:func:`zerompi.buffers.buffer_plan`, which ``ZeroOptimizer._allocate`` iterates
over to allocate), so its figures are the optimizer's ``memory_usage()`` and
``memory_buffers()`` to the byte, for any world size and rank, in one process and
without allocating or communicating anything.

It also gives the ZeRO paper's model-state formula (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, Sec. 5.1
and Fig. 1) for comparison. zerompi keeps no mixed-precision copies, so with ``P``
parameters of itemsize ``s`` and ``W`` ranks, Adam's model states (parameters,
gradients, two moments) per rank are, in bytes:

======  =====================  ==============  ===================================
stage   formula                float32         what is sharded
======  =====================  ==============  ===================================
0       ``4sP``                ``16P``         nothing (plain data parallelism)
1       ``2sP + 2sP/W``        ``8P + 8P/W``   the two Adam moments
2       ``sP + 3sP/W``         ``4P + 12P/W``  moments and gradients
3       ``4sP/W``              ``16P/W``       moments, gradients and parameters
======  =====================  ==============  ===================================

The exact figure differs from the formula only by the ceil-division of every bucket
over the ranks (less than one element per bucket and sharded array), plus what the
formula leaves out: the per-bucket staging buffers of stages 2-3 and the Adam
kernel's scratch block (``buffers_bytes``).

Command line: ``python -m zerompi.memory --params N --world W --stage S`` (or
``--mlp IN,HIDDEN,DEPTH,CLASSES`` for the driver's model); ``--help`` for the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from . import mlp
from .buffers import CATEGORIES, buffer_plan, full_grads_plan
from .partition import (
    DEFAULT_BUCKET_ELEMS,
    STAGES,
    SUPPORTED_DTYPES,
    default_group,
    optimizer_layout,
)

#: (name, shape, dtype) of one parameter, in the model's order.
Spec = tuple[str, tuple[int, ...], np.dtype]

#: Kinds of planned buffer that are the ZeRO paper's model states; every other
#: buffer (staging, gather, scratch) is counted in ``buffers_bytes``.
MODEL_STATES = ("params", "grads", "exp_avg", "exp_avg_sq")

#: Per stage, (unsharded, sharded) arrays of the four model states: the paper's
#: formula is ``itemsize * P * (unsharded + sharded / W)``.
PAPER_ARRAYS = {0: (4, 0), 1: (2, 2), 2: (1, 3), 3: (0, 4)}


def check_specs(specs: Sequence[tuple[str, Sequence[int], Any]]) -> list[Spec]:
    """Validate ``(name, shape, dtype)`` triples as ``ZeroOptimizer`` validates its
    parameters, and normalise them (tuple shapes of ints, ``np.dtype``)."""
    out: list[Spec] = []
    seen: set[str] = set()
    for item in specs:
        try:
            name, shape, dtype = item
        except (TypeError, ValueError):
            raise TypeError(f"a spec is (name, shape, dtype), got {item!r}") from None
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice")
        seen.add(name)
        dtype = np.dtype(dtype)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {dtype}; zerompi optimizes float32 or float64 arrays"
            )
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"parameter {name!r} has a negative dimension: {shape}")
        if int(np.prod(shape, dtype=np.int64)) == 0:
            raise ValueError(f"parameter {name!r} has no elements (shape {shape})")
        out.append((name, shape, dtype))
    if not out:
        raise ValueError("specs is empty: there is nothing to optimize")
    return out


def paper_bytes(params: Mapping[np.dtype, int], world_size: int, stage: int) -> float:
    """The ZeRO paper's model-state bytes per rank (real-valued: ``P/W`` unrounded)
    for ``params[dtype]`` parameters of each dtype (see the module docstring)."""
    unsharded, sharded = PAPER_ARRAYS[stage]
    return float(
        sum(
            np.dtype(dtype).itemsize * count * (unsharded + sharded / world_size)
            for dtype, count in params.items()
        )
    )


def estimate(
    specs: Sequence[tuple[str, Sequence[int], Any]],
    world_size: int,
    rank: int,
    stage: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    group_of: Callable[[str], str] = default_group,
    *,
    full_grads: bool = False,
    overlap: bool = True,
) -> dict[str, Any]:
    """The memory of ``ZeroOptimizer`` on ``rank`` of ``world_size``, without MPI.

    ``specs`` are the parameters' ``(name, shape, dtype)`` in the mapping's order;
    ``stage``, ``bucket_elems``, ``group_of`` and ``overlap`` are the optimizer's
    arguments.
    ``full_grads`` adds the stage-2 full gradient buffer that ``opt.grads``
    allocates on first use (ignored in other stages, which allocate nothing there).

    Returns a dict:

    * ``usage``: bytes per category, equal to ``opt.memory_usage()``;
    * ``buffers``: bytes per named buffer, equal to ``opt.memory_buffers()``;
    * ``exact_bytes``: bytes of the four model-state arrays (parameters,
      gradients, ``exp_avg``, ``exp_avg_sq``) as laid out;
    * ``buffers_bytes``: everything else (staging / gather buckets, scratch);
    * ``total_bytes``: ``exact_bytes + buffers_bytes``, the sum of ``usage``;
    * ``paper_bytes``: the ZeRO paper's formula for the same model states (float);
    * and ``world_size``, ``rank``, ``stage``, ``bucket_elems``, ``params``
      (elements), ``params_by_dtype``, ``buckets``, ``max_bucket_elems``.
    """
    checked = check_specs(specs)
    layout = optimizer_layout(checked, world_size, rank, stage, bucket_elems, group_of)
    plan = buffer_plan(layout, stage, overlap)
    if full_grads and stage == 2:
        plan += full_grads_plan(layout)
    usage = dict.fromkeys(CATEGORIES, 0)
    buffers: dict[str, int] = {}
    for buf in plan:
        usage[buf.category] += buf.nbytes
        buffers[buf.name] = buf.nbytes
    exact = sum(buf.nbytes for buf in plan if buf.kind in MODEL_STATES)
    total = sum(usage.values())
    return {
        "world_size": world_size,
        "rank": rank,
        "stage": stage,
        "bucket_elems": int(bucket_elems),
        "params": sum(layout.sizes.values()),
        "params_by_dtype": {dtype.name: size for dtype, size in layout.sizes.items()},
        "buckets": len(layout.buckets),
        "max_bucket_elems": max(b.size for b in layout.buckets),
        "usage": usage,
        "buffers": buffers,
        "exact_bytes": exact,
        "buffers_bytes": total - exact,
        "total_bytes": total,
        "paper_bytes": paper_bytes(layout.sizes, world_size, stage),
    }


def estimate_max(
    specs: Sequence[tuple[str, Sequence[int], Any]],
    world_size: int,
    stage: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    group_of: Callable[[str], str] = default_group,
    *,
    full_grads: bool = False,
    overlap: bool = True,
) -> dict[str, Any]:
    """The maximum over ranks of every figure of :func:`estimate`: rank 0's.

    ``shard_range`` gives rank 0 ``min(ceil(n/W), n)`` elements of every bucket of
    ``n``, at least as many as any other rank, and every planned buffer's size is
    either the same on all ranks or non-decreasing in the rank's shard sizes. So
    rank 0 holds the most in every category and every buffer at once (this is what
    the driver's per-category ``max`` over ranks reports).
    """
    return estimate(
        specs, world_size, 0, stage, bucket_elems, group_of, full_grads=full_grads, overlap=overlap
    )


def flat_specs(params: int, layer_elems: int, dtype: Any = np.float32) -> list[Spec]:
    """``params`` elements as ``ceil(params / layer_elems)`` 1-D parameters ``p0``,
    ``p1``, ... of ``layer_elems`` elements (the last one smaller), each its own
    group."""
    if params < 1 or layer_elems < 1:
        raise ValueError(f"params and layer_elems must be >= 1, got {params}, {layer_elems}")
    dtype = np.dtype(dtype)
    count = -(-params // layer_elems)
    last = params - (count - 1) * layer_elems
    return [(f"p{i}", (layer_elems if i < count - 1 else last,), dtype) for i in range(count)]


def mlp_specs(
    in_dim: int, hidden: int, depth: int, classes: int, dtype: Any = np.float32
) -> list[Spec]:
    """The parameters of the driver's MLP (:func:`zerompi.mlp.init_params`):
    ``layer{i}.weight`` of shape ``(fan_in, fan_out)`` and ``layer{i}.bias`` of shape
    ``(fan_out,)``, in layer order."""
    dtype = np.dtype(dtype)
    sizes = mlp.layer_sizes(in_dim, hidden, depth, classes)
    specs: list[Spec] = []
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        specs.append((f"layer{i}.weight", (fan_in, fan_out), dtype))
        specs.append((f"layer{i}.bias", (fan_out,), dtype))
    return specs


# -- command line -----------------------------------------------------------------


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _mlp_arg(value: str) -> tuple[int, int, int, int]:
    try:
        in_dim, hidden, depth, classes = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected IN,HIDDEN,DEPTH,CLASSES (four integers), got {value!r}"
        ) from None
    try:
        mlp.layer_sizes(in_dim, hidden, depth, classes)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return in_dim, hidden, depth, classes


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only for options that have a meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m zerompi.memory``."""
    p = argparse.ArgumentParser(
        prog="python -m zerompi.memory",
        description=(
            "Per-rank memory of zerompi's ZeroOptimizer for a model, world size and ZeRO "
            "stage, computed from the optimizer's own layout and buffer plan without "
            "allocating anything (equal to opt.memory_usage() to the byte), next to the "
            "ZeRO paper's formula for Adam's model states."
        ),
        epilog=(
            "Figures are per rank; without --per-rank, the maximum over ranks (rank 0's: "
            "it owns the largest shard of every bucket). 'exact' is the four model-state "
            "arrays (parameters, gradients, exp_avg, exp_avg_sq) as laid out, 'paper' "
            "the formula 4sP / 2sP+2sP/W / sP+3sP/W / 4sP/W for stages 0-3 (s: bytes per "
            "element), and 'buffers' what the formula leaves out (bucket staging and "
            "gather buffers, the Adam kernel's scratch). Example: python -m zerompi.memory "
            "--mlp 1024,1024,16,10 --world 4 --stage 3"
        ),
        formatter_class=_HelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--params",
        type=_positive,
        metavar="N",
        help="a model of N parameters (elements), as ceil(N/L) 1-D parameters of L "
        "elements (see --layer-elems), each its own group",
    )
    model.add_argument(
        "--mlp",
        type=_mlp_arg,
        metavar="IN,HIDDEN,DEPTH,CLASSES",
        help="exactly the MLP of 'python -m zerompi.driver --in-dim IN --hidden HIDDEN "
        "--depth DEPTH --classes CLASSES'",
    )
    p.add_argument("--world", type=_positive, required=True, metavar="W", help="world size")
    p.add_argument(
        "--stage", type=int, choices=STAGES, required=True, help="ZeRO stage (0: plain DP)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="parameter dtype"
    )
    p.add_argument(
        "--bucket-elems",
        type=_positive,
        default=DEFAULT_BUCKET_ELEMS,
        metavar="B",
        help="the optimizer's bucket_elems (target elements per bucket)",
    )
    p.add_argument(
        "--layer-elems",
        type=_positive,
        default=None,
        metavar="L",
        help="with --params: elements per parameter (default: --bucket-elems)",
    )
    p.add_argument(
        "--full-grads",
        action="store_true",
        help="stage 2: include the full gradient buffer that opt.grads allocates on first "
        "use (a model that hands gradients over with opt.gradients() never has it)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="the optimizer's overlap=False: one staging bucket instead of two (stages 2-3)",
    )
    p.add_argument("--per-rank", action="store_true", help="also give the figures of every rank")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _mib(count: float) -> str:
    return f"{count / 2**20:,.3f}"


def _specs_from_args(args: argparse.Namespace) -> tuple[list[Spec], str]:
    if args.mlp is not None:
        in_dim, hidden, depth, classes = args.mlp
        sizes = mlp.layer_sizes(in_dim, hidden, depth, classes)
        return mlp_specs(in_dim, hidden, depth, classes, args.dtype), "MLP " + "-".join(
            map(str, sizes)
        )
    layer = args.layer_elems or args.bucket_elems
    specs = flat_specs(args.params, layer, args.dtype)
    return specs, f"{len(specs)} parameter(s) of <= {layer:,} elements"


def _report(result: dict[str, Any], per_rank: list[dict[str, Any]] | None, model: str) -> str:
    r = result
    lines = [
        f"zerompi.memory: {model}: {r['params']:,} params "
        f"({', '.join(r['params_by_dtype'])}) in {r['buckets']} bucket(s) "
        f"(largest {r['max_bucket_elems']:,} elements), world size {r['world_size']}, "
        f"stage {r['stage']}, bucket_elems {r['bucket_elems']:,}",
        "",
        "per rank, max over ranks:",
        f"  {'category':<24}{'bytes':>16}{'MiB':>14}",
    ]
    for category, count in r["usage"].items():
        lines.append(f"  {category:<24}{count:>16,}{_mib(count):>14}")
    lines.append(f"  {'total':<24}{r['total_bytes']:>16,}{_mib(r['total_bytes']):>14}")
    diff = r["exact_bytes"] - r["paper_bytes"]
    lines += [
        "",
        "model states (parameters, gradients, 2 Adam moments) vs the ZeRO paper:",
        f"  {'exact':<24}{r['exact_bytes']:>16,}{_mib(r['exact_bytes']):>14}",
        f"  {'paper formula':<24}{r['paper_bytes']:>16,.1f}{_mib(r['paper_bytes']):>14}",
        f"  {'exact - paper':<24}{diff:>16,.1f}",
        f"  {'buffers (not in paper)':<24}{r['buffers_bytes']:>16,}{_mib(r['buffers_bytes']):>14}",
        "",
        "named buffers:",
    ]
    for name, count in r["buffers"].items():
        lines.append(f"  {name:<24}{count:>16,}{_mib(count):>14}")
    if per_rank is not None:
        short = dict(
            zip(CATEGORIES, ("opt_states", "grads", "params", "comm_bufs", "scratch"), strict=True)
        )
        lines += ["", "per rank (bytes):"]
        lines.append(
            "  "
            + f"{'rank':>6}"
            + "".join(f"{short[c]:>16}" for c in CATEGORIES)
            + f"{'total':>16}"
        )
        for e in per_rank:
            lines.append(
                "  "
                + f"{e['rank']:>6}"
                + "".join(f"{e['usage'][c]:>16,}" for c in CATEGORIES)
                + f"{e['total_bytes']:>16,}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m zerompi.memory``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.layer_elems is not None and args.params is None:
        parser.error("--layer-elems only applies to --params")
    specs, model = _specs_from_args(args)
    options = {
        "bucket_elems": args.bucket_elems,
        "full_grads": args.full_grads,
        "overlap": not args.no_overlap,
    }
    result = estimate_max(specs, args.world, args.stage, **options)
    per_rank = None
    if args.per_rank:
        per_rank = [
            estimate(specs, args.world, r, args.stage, **options) for r in range(args.world)
        ]
    if args.json:
        out = {"model": model, "max_over_ranks": result}
        if per_rank is not None:
            out["per_rank"] = per_rank
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_report(result, per_rank, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
