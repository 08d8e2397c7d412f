"""The command line: ``python -m zerompi.checkpoint {inspect,verify,export} PATH``.

Numpy only (through :mod:`zerompi.checkpoint.format`): it runs where MPI does not::

    python -m zerompi.checkpoint inspect PATH
    python -m zerompi.checkpoint verify PATH          # exit status 0 / 1
    python -m zerompi.checkpoint export PATH --npz OUT
    python -m zerompi.checkpoint export PATH --safetensors DIR [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import safetensors
from .format import FORMAT, CheckpointError, export_npz, read_header, verify


def summary(header: dict[str, Any], path: str) -> str:
    """What ``inspect`` prints: the run, the optimizer, the parameters, the sections."""
    opt = header["optimizer"]
    lines = [
        f"{path}: {FORMAT} version {header['version']}",
        f"  saved by stage {header['stage']} on {header['world_size']} rank(s), step {opt['step']}",
        "  optimizer: " + ", ".join(f"{k}={v}" for k, v in opt.items() if k != "step"),
        f"  {len(header['params'])} parameters, "
        + ", ".join(f"{n} {d}" for d, n in header["sizes"].items()),
    ]
    for p in header["params"]:
        lines.append(f"    {p['name']:30s} {p['dtype']:8s} {tuple(p['shape'])}")
    lines.append("  sections:")
    for s in header["sections"]:
        lines.append(
            f"    {s['name']:20s} offset {s['offset']:>12d} count {s['count']:>12d} "
            f"checksum {'/'.join(s['checksum'])}"
        )
    return "\n".join(lines)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}  # fmt: skip


def byte_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes, as an int."""
    number = text.strip().rstrip("bBiI").rstrip("kKmMgG") or "x"
    unit = text.strip()[len(number):].upper()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m zerompi.checkpoint", description="Inspect zerompi checkpoints."
    )
    parser.add_argument("command", choices=["inspect", "verify", "export"])
    parser.add_argument("path")
    parser.add_argument("--npz", help="export: the .npz file to write (parameters and moments)")
    parser.add_argument(
        "--safetensors", metavar="DIR",
        help="export: the directory to write the parameters to as safetensors "
        "(model.safetensors, or numbered files and model.safetensors.index.json)")
    parser.add_argument(
        "--max-shard-size", type=byte_size, default=safetensors.MAX_SHARD_BYTES, metavar="SIZE",
        help="export --safetensors: the largest file before another starts, in bytes "
        "or with a unit (500MB, 5GB, 2GiB; default 5GB)")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        try:
            header = read_header(args.path)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(summary(header, args.path))
        return 0
    if args.command == "verify":
        problems = verify(args.path)
        for problem in problems:
            print(f"{args.path}: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.path}: OK")
        return 1 if problems else 0
    if bool(args.npz) == bool(args.safetensors):
        parser.error("export needs one of --npz OUT and --safetensors DIR")
    try:
        if args.npz:
            count = export_npz(args.path, args.npz)
            print(f"wrote {count} arrays to {args.npz}")
        else:
            files = safetensors.export(args.path, args.safetensors, args.max_shard_size)
            print(f"wrote {len(read_header(args.path)['params'])} parameters to "
                  + ", ".join(files))  # fmt: skip
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
