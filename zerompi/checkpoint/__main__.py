"""The command line: ``python -m zerompi.checkpoint {inspect,verify,export} PATH``.

Numpy only (through :mod:`zerompi.checkpoint.format`): it runs where MPI does not::

    python -m zerompi.checkpoint inspect PATH
    python -m zerompi.checkpoint verify PATH          # exit status 0 / 1
    python -m zerompi.checkpoint export PATH --npz OUT
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m zerompi.checkpoint", description="Inspect zerompi checkpoints."
    )
    parser.add_argument("command", choices=["inspect", "verify", "export"])
    parser.add_argument("path")
    parser.add_argument("--npz", help="export: the .npz file to write")
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
    if not args.npz:
        parser.error("export needs --npz OUT")
    try:
        count = export_npz(args.path, args.npz)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {count} arrays to {args.npz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
