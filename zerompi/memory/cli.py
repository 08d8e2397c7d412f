"""``python -m zerompi.memory``: the estimator of :mod:`zerompi.memory` on the
command line, as tables or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .. import mlp
from ..buffers import CATEGORIES
from ..partition import DEFAULT_BUCKET_ELEMS, STAGES
from ..precision import NAMES
from ..rules import RULES
from ..runtime import add_shared_memory_options, count
from . import Spec, estimate, estimate_max, estimate_node, flat_specs, mlp_specs


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
        type=count,
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
    p.add_argument("--world", type=count, metavar="W",
                   help="world size (default: --nodes x --ranks-per-node)")  # fmt: skip
    p.add_argument("--nodes", type=count, metavar="N",
                   help="nodes (default: W / --ranks-per-node, or 1)")  # fmt: skip
    p.add_argument("--ranks-per-node", type=count, metavar="L",
                   help="ranks per node, consecutive ones (default: W / N)")  # fmt: skip
    p.add_argument(
        "--stage", type=int, choices=STAGES, required=True, help="ZeRO stage (0: plain DP)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="parameter dtype"
    )
    p.add_argument(
        "--bucket-elems",
        type=count,
        default=DEFAULT_BUCKET_ELEMS,
        metavar="B",
        help="the optimizer's bucket_elems (target elements per bucket)",
    )
    p.add_argument(
        "--layer-elems",
        type=count,
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
    p.add_argument(
        "--param-dtype", default=None, choices=NAMES,
        help="the optimizer's param_dtype: the model's copy of the parameters and the gather",
    )  # fmt: skip
    p.add_argument(
        "--reduce-dtype", default=None, choices=NAMES,
        help="the optimizer's reduce_dtype: the gradients handed over and the reduction's wire",
    )  # fmt: skip
    add_shared_memory_options(p)  # (assuming /dev/shm has room)
    p.add_argument("--elastic", action="store_true",
                   help="the optimizer's elastic=True: its in-memory snapshots (this rank's "
                   "shard state once, its buddy's twice), and no node shared memory")
    p.add_argument("--snapshot-every", type=count, default=10, metavar="K",
                   help="with --elastic: a snapshot every K steps (its traffic per step)")
    p.add_argument("--optimizer", choices=tuple(RULES), default="adam",
                   help="the update rule, whose states are counted (zerompi.rules)")
    p.add_argument("--per-rank", action="store_true", help="also give the figures of every rank")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.3f}"


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


def _report(
    result: dict[str, Any], per_rank: list[dict[str, Any]] | None, model: str,
    node: dict[str, int], flat: dict[str, dict[str, int]],
) -> str:  # fmt: skip
    r = result
    lines = [
        f"zerompi.memory: {model}: {r['params']:,} params "
        f"({', '.join(r['params_by_dtype'])}) in {r['buckets']} bucket(s) "
        f"(largest {r['max_bucket_elems']:,} elements), world size {r['world_size']} "
        f"({r['nodes']} node(s) of {r['ranks_per_node']} rank(s)), stage {r['stage']}, "
        f"bucket_elems {r['bucket_elems']:,}, node shared memory "
        f"{'on' if r['shared_memory'] else 'off'}",
        "",
        "per rank (max over ranks) and per node (node 0: the most):",
        f"  {'category':<24}{'rank bytes':>16}{'MiB':>12}{'node bytes':>18}{'MiB':>12}",
    ]
    for category, nbytes in r["usage"].items():
        lines.append(f"  {category:<24}{nbytes:>16,}{_mib(nbytes):>12}"
                     f"{node[category]:>18,}{_mib(node[category]):>12}")  # fmt: skip
    node_total = sum(node.values())
    lines.append(f"  {'total':<24}{r['total_bytes']:>16,}{_mib(r['total_bytes']):>12}"
                 f"{node_total:>18,}{_mib(node_total):>12}")  # fmt: skip
    lines += _traffic_lines(r["traffic"], flat)
    same = all(p == (d, d) for d, p in r["precision"].items()) and not (
        r["shared_memory"] and r["stage"] in (1, 2)  # the parameters: one copy per node
    )
    formula = r["paper_bytes"] if same else r["formula_bytes"]
    label = "paper formula" if same else "formula"
    diff = r["exact_bytes"] - formula
    per_param = "; ".join(
        f"{d} as {p}/{g}: {a} B replicated + {b} B / W sharded per parameter"
        for (d, (a, b)), (p, g) in zip(
            r["bytes_per_param"].items(), r["precision"].values(), strict=True
        )
    )
    lines += [
        "",
        "model states (parameters, gradients, 2 Adam moments) vs "
        + ("the ZeRO paper:" if same else "the formula (master / param / reduce dtypes; "
           "stages 1-2 with shared memory: 1/L of the node's parameter copy):"),
        f"  {per_param}",
        f"  {'exact':<24}{r['exact_bytes']:>16,}{_mib(r['exact_bytes']):>14}",
        f"  {label:<24}{formula:>16,.1f}{_mib(formula):>14}",
        f"  {'exact - ' + label.split()[0]:<24}{diff:>16,.1f}",
        f"  {'buffers (not in paper)':<24}{r['buffers_bytes']:>16,}{_mib(r['buffers_bytes']):>14}",
        "",
        "named buffers:",
    ]
    for name, nbytes in r["buffers"].items():
        lines.append(f"  {name:<32}{nbytes:>16,}{_mib(nbytes):>14}")
    if per_rank is not None:
        short = dict(
            zip(CATEGORIES, ("opt_states", "grads", "params", "comm_bufs", "scratch", "snapshots"),
                strict=True)
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


def _world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int]:
    """``(world size, ranks per node)`` from ``--world``, ``--nodes``, ``--ranks-per-node``."""
    world, nodes, per = args.world, args.nodes, args.ranks_per_node
    if world is None:
        if nodes is None and per is None:
            parser.error("give --world W, or --nodes N and --ranks-per-node L")
        world = (nodes or 1) * (per or 1)
    if per is None:
        if world % (nodes or 1):
            parser.error(f"--world {world} is not a multiple of --nodes {nodes}")
        per = world // (nodes or 1)
    if nodes is not None and nodes * per != world:
        parser.error(f"--nodes {nodes} x --ranks-per-node {per} is not --world {world}")
    if per > world:
        parser.error(f"--ranks-per-node {per} is more than the world size {world}")
    return world, per


def _traffic_lines(books: dict[str, dict[str, int]], flat: dict[str, dict[str, int]]) -> list[str]:
    """The step's bytes per rank (rank 0's), within and between nodes."""
    lines = [
        "",
        "bytes per step, rank 0 (sent + received; one micro-batch, stage 3 gathering every "
        "layer twice, except on one node with shared memory):",
        f"  {'collective':<16}{'within node':>16}{'between nodes':>16}{'flat MPI between':>18}",
    ]
    for op, e in books.items():
        total, cross = e["sent"] + e["received"], e["sent_between"] + e["received_between"]
        f = flat.get(op, {})
        flat_cross = f.get("sent_between", 0) + f.get("received_between", 0)
        lines.append(f"  {op:<16}{total - cross:>16,}{cross:>16,}{flat_cross:>18,}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m zerompi.memory``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.layer_elems is not None and args.params is None:
        parser.error("--layer-elems only applies to --params")
    world, per_node = _world(parser, args)
    specs, model = _specs_from_args(args)
    options = {
        "bucket_elems": args.bucket_elems,
        "full_grads": args.full_grads,
        "overlap": not args.no_overlap,
        "param_dtype": args.param_dtype,
        "reduce_dtype": args.reduce_dtype,
        "shared_memory": args.shared_memory,
        "ranks_per_node": per_node,
        "elastic": args.elastic,
        "snapshot_every": args.snapshot_every,
        "optimizer": args.optimizer,
    }
    result = estimate_max(specs, world, args.stage, **options)
    node = estimate_node(specs, world, 0, args.stage, **options)
    flat = estimate(specs, world, 0, args.stage, **{**options, "shared_memory": False})
    per_rank = None
    if args.per_rank:
        per_rank = [estimate(specs, world, r, args.stage, **options) for r in range(world)]
    if args.json:
        out = {"model": model, "max_over_ranks": result, "node": node,
               "flat_traffic": flat["traffic"]}  # fmt: skip
        if per_rank is not None:
            out["per_rank"] = per_rank
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_report(result, per_rank, model, node, flat["traffic"]))
    return 0
