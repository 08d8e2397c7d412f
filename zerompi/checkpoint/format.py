"""Single-file, world-size independent checkpoints of a :class:`ZeroOptimizer`.

File format (all integers little-endian)::

    offset 0   8 bytes   magic b"ZEROMPI\\x01"
    offset 8   u64       n, length of the JSON header in bytes
    offset 16  u32       crc32 of the JSON header bytes
    offset 20  u32       zero
    offset 24  n bytes   UTF-8 JSON header
               zeros     up to the next multiple of 64
               sections  each 64-byte aligned, zero padding between them

For every dtype of the model (in layout order) there are three sections,
``params.<dtype>``, ``exp_avg.<dtype>`` and ``exp_avg_sq.<dtype>``, each the full
flat vector of that dtype (``sizes[dtype]`` elements, little-endian) in the
*global* flat order: parameters of that dtype packed in the mapping's order. The
order does not depend on the world size, the stage or the bucketing, so a
checkpoint saved by any world loads into any other.

The JSON header::

    {"format": "zerompi-checkpoint", "version": 1,
     "params": [{"name", "shape", "dtype", "offset"}, ...],   # mapping order
     "sizes": {dtype: n},
     "sections": [{"name", "dtype", "offset", "count", "checksum": [s1, s2]}, ...],
     "optimizer": {"lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "step"},
     "stage": ..., "world_size": ..., "max_bucket_elems": ...}

Section checksum: the section viewed as words ``w_i`` (``uint32`` for float32,
``uint64`` for float64), ``s1 = sum(w_i) mod 2**64`` and
``s2 = sum((i + 1) * w_i) mod 2**64`` with ``i`` the global word index. Both are
sums, so every rank checksums only its own shards and the parts are added up
(modulo 2**64) with one allreduce; :func:`read` recomputes them over whole sections.

This module is numpy-only: it imports neither mpi4py nor the rest of zerompi, so
checkpoints can be read (:func:`read`) and checked from the command line::

    python -m zerompi.checkpoint inspect PATH
    python -m zerompi.checkpoint verify PATH          # exit status 0 / 1
    python -m zerompi.checkpoint export PATH --npz OUT

(``python -m`` imports the ``zerompi`` package, which imports mpi4py; load this file
on its own, e.g. with ``runpy.run_path``, where mpi4py is unavailable.)

The collective parts (:func:`save`, :func:`load`, behind ``ZeroOptimizer.save`` /
``ZeroOptimizer.load``) make their MPI calls through the optimizer's
:class:`zerompi.mpi.collectives.Comm`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import struct
import sys
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

MAGIC = b"ZEROMPI\x01"
FORMAT = "zerompi-checkpoint"
VERSION = 1
ALIGN = 64
PREFIX = struct.Struct("<8sQII")  # magic, header length, header crc32, reserved
MASK = (1 << 64) - 1
#: Words per checksum block: bounds the temporaries to a few MiB whatever the model.
BLOCK = 1 << 18
#: Elements per block when reading a section in :func:`read`.
READ_BLOCK = 1 << 22

_WORD = {"float32": np.dtype("<u4"), "float64": np.dtype("<u8")}
_DTYPE = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
KINDS = ("params", "exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A file that is not a (valid, complete, intact) zerompi checkpoint."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # sections are written from native buffers
        raise NotImplementedError("zerompi checkpoints are written on little-endian hosts")


# -- checksums ----------------------------------------------------------------------------


def checksum(values: np.ndarray, start: int = 0) -> tuple[int, int]:
    """Partial checksum ``(s1, s2)`` of the words of ``values`` (float32 or float64,
    contiguous), whose first word has global index ``start`` in its section."""
    name = np.dtype(values.dtype).name
    if name not in _WORD:
        raise TypeError(f"no checksum for dtype {values.dtype}")
    words = np.ascontiguousarray(values).reshape(-1).view(_WORD[name])
    s1 = s2 = 0
    for lo in range(0, words.size, BLOCK):
        block = words[lo : lo + BLOCK].astype(np.uint64)
        s1 += int(block.sum(dtype=np.uint64))
        first = start + lo + 1
        index = np.arange(first, first + block.size, dtype=np.uint64)
        np.multiply(block, index, out=block)  # wraps modulo 2**64
        s2 += int(block.sum(dtype=np.uint64))
    return s1 & MASK, s2 & MASK


def _hex(pair: Sequence[int]) -> list[str]:
    return [f"{int(v) & MASK:016x}" for v in pair]


# -- header -------------------------------------------------------------------------------


def layout_entries(
    params: Sequence[tuple[str, tuple[int, ...], str, int]],
) -> list[dict[str, Any]]:
    """The header's ``params`` list from ``(name, shape, dtype name, offset)``."""
    return [
        {"name": n, "shape": [int(s) for s in shape], "dtype": d, "offset": int(o)}
        for n, shape, d, o in params
    ]


def build_header(
    params: list[dict[str, Any]],
    sizes: dict[str, int],
    checksums: dict[str, Sequence[int]],
    optimizer: dict[str, Any],
    stage: int,
    world_size: int,
    max_bucket_elems: int,
) -> tuple[bytes, dict[str, Any]]:
    """The file's first bytes (prefix, JSON, padding) and the header dict, with every
    section's absolute offset. ``checksums`` maps section name -> (s1, s2)."""
    sections = [
        {"name": f"{kind}.{dtype}", "dtype": dtype, "count": int(n)}
        for dtype, n in sizes.items()
        for kind in KINDS
    ]
    header = {
        "format": FORMAT,
        "version": VERSION,
        "params": params,
        "sizes": {d: int(n) for d, n in sizes.items()},
        "sections": sections,
        "optimizer": optimizer,
        "stage": int(stage),
        "world_size": int(world_size),
        "max_bucket_elems": int(max_bucket_elems),
    }
    data_start = _align(PREFIX.size + 1)
    while True:  # offsets are in the header: iterate until its length settles
        offset = data_start
        for section in sections:
            section["offset"] = offset
            section["checksum"] = _hex(checksums[section["name"]])
            offset = _align(offset + section["count"] * _DTYPE[section["dtype"]].itemsize)
        body = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
        needed = _align(PREFIX.size + len(body))
        if needed <= data_start:
            break
        data_start = needed
    prefix = PREFIX.pack(MAGIC, len(body), zlib.crc32(body), 0)
    head = prefix + body
    return head + b"\0" * (data_start - len(head)), header


def section_end(section: dict[str, Any]) -> int:
    return int(section["offset"]) + int(section["count"]) * _DTYPE[section["dtype"]].itemsize


def file_size(header: dict[str, Any]) -> int:
    """Bytes a complete checkpoint with this header has."""
    return max((section_end(s) for s in header["sections"]), default=0)


def parse_header(data: bytes, path: str = "<bytes>", size: int | None = None) -> dict[str, Any]:
    """Validate and decode the header at the start of ``data`` (at least the prefix and
    the JSON). ``size``: the file's size, checked against the sections' extent."""
    if len(data) < PREFIX.size or data[:8] != MAGIC:
        if data[:7] == MAGIC[:7]:
            raise CheckpointError(f"{path}: unsupported zerompi checkpoint magic {data[:8]!r}")
        raise CheckpointError(f"{path} is not a zerompi checkpoint (bad magic {data[:8]!r})")
    _, length, crc, _ = PREFIX.unpack_from(data)
    if size is not None and PREFIX.size + length > size:
        raise CheckpointError(
            f"{path} is truncated: the header needs {PREFIX.size + length} bytes, "
            f"the file has {size}"
        )
    body = data[PREFIX.size : PREFIX.size + length]
    if len(body) != length:
        raise CheckpointError(f"{path}: header truncated ({len(body)} of {length} bytes)")
    if zlib.crc32(body) != crc:
        raise CheckpointError(f"{path}: the header is corrupted (crc32 mismatch)")
    try:
        header = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} header")
    if header.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {header.get('version')!r} is not supported "
            f"(this zerompi reads version {VERSION})"
        )
    try:
        for section in header["sections"]:
            if section["dtype"] not in _DTYPE or section["offset"] % ALIGN:
                raise CheckpointError(f"{path}: bad section {section!r}")
        for key in ("params", "sizes", "optimizer", "stage", "world_size"):
            header[key]
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: malformed header ({exc!r})") from None
    if size is not None and size < file_size(header):
        raise CheckpointError(
            f"{path} is truncated: {size} bytes, the sections end at {file_size(header)}"
        )
    return header


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate the header of the checkpoint at ``path`` (also its size)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) == PREFIX.size and prefix[:8] == MAGIC:
                length = PREFIX.unpack(prefix)[1]
                prefix += f.read(min(length, max(size - PREFIX.size, 0)))
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    return parse_header(prefix, path, size)


# -- numpy-only reader --------------------------------------------------------------------


def _read_section(path: str, section: dict[str, Any]) -> np.ndarray:
    dtype = _DTYPE[section["dtype"]]
    out = np.fromfile(path, dtype=dtype, count=int(section["count"]), offset=section["offset"])
    if out.size != section["count"]:
        raise CheckpointError(f"{path}: section {section['name']} is truncated")
    return out.astype(dtype.newbyteorder("="), copy=False)


def _check_section(path: str, section: dict[str, Any], values: np.ndarray) -> None:
    got = _hex(checksum(values))
    if got != section["checksum"]:
        raise CheckpointError(
            f"{path}: checksum mismatch in section {section['name']} "
            f"(stored {section['checksum']}, computed {got}): the file is corrupted"
        )


def _sections(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in header["sections"]}


def read(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Everything in a checkpoint, as numpy arrays (no MPI): ``{"params": {name:
    array}, "exp_avg": {...}, "exp_avg_sq": {...}, "optimizer": {...}, "world_size",
    "stage", "header"}``. Verifies every checksum unless ``verify`` is false; raises
    :class:`CheckpointError` (a ``ValueError``) for a truncated, corrupted or foreign
    file."""
    path = os.fspath(path)
    header = read_header(path)
    sections = _sections(header)
    out: dict[str, Any] = {kind: {} for kind in KINDS}
    for kind in KINDS:
        for dtype in header["sizes"]:
            section = sections.get(f"{kind}.{dtype}")
            if section is None:
                raise CheckpointError(f"{path}: section {kind}.{dtype} is missing")
            flat = _read_section(path, section)
            if verify:
                _check_section(path, section, flat)
            for p in header["params"]:
                if p["dtype"] == dtype:
                    n = int(np.prod(p["shape"], dtype=np.int64))
                    out[kind][p["name"]] = flat[p["offset"] : p["offset"] + n].reshape(p["shape"])
    out["params"] = {p["name"]: out["params"][p["name"]] for p in header["params"]}
    for kind in ("exp_avg", "exp_avg_sq"):
        out[kind] = {p["name"]: out[kind][p["name"]] for p in header["params"]}
    out["optimizer"] = header["optimizer"]
    out["world_size"] = header["world_size"]
    out["stage"] = header["stage"]
    out["header"] = header
    return out


def verify(path: str | os.PathLike) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty if it is intact), reading one
    block at a time."""
    path = os.fspath(path)
    try:
        header = read_header(path)
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    for section in header["sections"]:
        dtype = _DTYPE[section["dtype"]]
        s1 = s2 = 0
        count = int(section["count"])
        for lo in range(0, count, READ_BLOCK):
            n = min(READ_BLOCK, count - lo)
            block = np.fromfile(
                path, dtype=dtype, count=n, offset=section["offset"] + lo * dtype.itemsize
            )
            if block.size != n:
                problems.append(f"section {section['name']} is truncated")
                break
            a, b = checksum(block, lo)
            s1, s2 = s1 + a, s2 + b
        else:
            got = _hex((s1, s2))
            if got != section["checksum"]:
                problems.append(
                    f"checksum mismatch in section {section['name']} "
                    f"(stored {section['checksum']}, computed {got})"
                )
    return problems


# -- collective save / load (MPI through the optimizer's Comm) ----------------------------


def _layout_params(opt: Any) -> list[dict[str, Any]]:
    specs = opt._specs
    return layout_entries(
        [(n, specs[n].shape, specs[n].dtype.name, specs[n].offset) for n in opt._order]
    )


def _shards(opt: Any) -> list[tuple[str, int, np.ndarray]]:
    """``(section name, first global element, this rank's shard)`` of every bucket of
    every kind of state, in one fixed order (every rank's collective I/O follows it)."""
    rank, stage = opt.comm.rank, opt.stage
    out = []
    for kind in KINDS:
        store = {"params": opt._flat, "exp_avg": opt._exp_avg, "exp_avg_sq": opt._exp_avg_sq}
        full = stage == 0 or (kind == "params" and stage < 3)
        for index, bucket in enumerate(opt.layout.buckets):
            lo, hi = bucket.local(rank)
            if full:
                shard = store[kind][bucket.dtype][bucket.start + lo : bucket.start + hi]
            else:
                shard = opt._shard_of(store[kind], index)
            out.append((f"{kind}.{bucket.dtype.name}", bucket.start + lo, shard))
    return out


def _section_names(opt: Any) -> list[str]:
    return [f"{kind}.{d.name}" for d in opt.layout.sizes for kind in KINDS]


def _checksums(comm: Any, names: list[str], parts: list[tuple[str, int, np.ndarray]]) -> dict:
    """Collective: every section's checksum, from each rank's shards."""
    partial = {n: [0, 0] for n in names}
    for name, first, shard in parts:
        a, b = checksum(shard, first)
        partial[name][0] += a
        partial[name][1] += b
    local = np.array([v & MASK for n in names for v in partial[n]], dtype=np.uint64)
    sums = comm.sum_uint64(local)
    return {n: (int(sums[2 * i]), int(sums[2 * i + 1])) for i, n in enumerate(names)}


def _optimizer_entry(opt: Any) -> dict[str, Any]:
    cfg = opt.config
    return {
        "lr": cfg.lr,
        "beta1": cfg.beta1,
        "beta2": cfg.beta2,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "decoupled": cfg.decoupled,
        "step": int(opt.step_count),
        "skipped_steps": int(opt.skipped_steps),
    }


def save(opt: Any, path: str | os.PathLike) -> None:
    """Collective: write ``opt``'s full state to ``path`` (see ``ZeroOptimizer.save``)."""
    comm = opt.comm
    path = os.fspath(path)
    error: BaseException | None = None
    head = b""
    header: dict[str, Any] = {}
    names = _section_names(opt)
    parts = _shards(opt)
    sums = _checksums(comm, names, parts)
    token = comm.allgather(f"{os.getpid()}-{secrets.token_hex(6)}" if comm.rank == 0 else None)[0]
    tmp = f"{path}.tmp-{token}"
    try:
        _require_little_endian()
        head, header = build_header(
            _layout_params(opt),
            {d.name: int(n) for d, n in opt.layout.sizes.items()},
            sums,
            _optimizer_entry(opt),
            opt.stage,
            comm.size,
            max(b.size for b in opt.layout.buckets),
        )
    except Exception as exc:
        error = exc
    comm.agree(error)
    offsets = {s["name"]: s["offset"] for s in header["sections"]}
    fh = None
    try:
        fh = comm.open_file(tmp, "w")
    except Exception as exc:
        error = exc
    comm.agree(error)
    try:
        try:
            comm.set_file_size(fh, 0)
        except Exception as exc:
            error = exc
        for name, first, shard in parts:
            itemsize = shard.dtype.itemsize
            data = shard if error is None else shard[:0]  # keep the collective sequence
            try:
                comm.write_at_all(fh, offsets[name] + first * itemsize, data)
            except Exception as exc:
                error = error or exc
        if comm.rank == 0 and error is None:
            try:
                comm.write_at(fh, 0, np.frombuffer(head, dtype=np.uint8))
            except Exception as exc:
                error = exc
        try:
            comm.set_file_size(fh, file_size(header))  # trailing padding, exact length
            comm.sync_file(fh)
        except Exception as exc:
            error = error or exc
    finally:
        comm.close_file(fh)
    try:
        comm.agree(error)  # the write phase
        if comm.rank == 0:
            try:
                _commit(tmp, path)
            except Exception as exc:
                error = exc
        comm.agree(error)
    except Exception:
        if comm.rank == 0:  # never leave the temporary behind; ``path`` is untouched
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        comm.barrier()
        raise
    comm.barrier()


def _commit(tmp: str, path: str) -> None:
    """fsync ``tmp``, atomically rename it to ``path`` and fsync the directory."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # no directory handles on this platform: the rename is done anyway
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def check_compatible(opt: Any, header: dict[str, Any], path: str) -> None:
    """Raise unless the checkpoint holds exactly ``opt``'s parameters (names, shapes,
    dtypes, order)."""
    mine = _layout_params(opt)
    theirs = header["params"]
    if mine != theirs:
        for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a != b:
                raise CheckpointError(
                    f"{path} holds a different model: parameter {i} is "
                    f"{b['name']!r} {b['dtype']}{tuple(b['shape'])} in the checkpoint but "
                    f"{a['name']!r} {a['dtype']}{tuple(a['shape'])} in this optimizer"
                )
        raise CheckpointError(
            f"{path} holds a different model: {len(theirs)} parameters in the checkpoint, "
            f"{len(mine)} in this optimizer"
        )
    sizes = {d.name: int(n) for d, n in opt.layout.sizes.items()}
    sections = _sections(header)
    if header["sizes"] != sizes:
        raise CheckpointError(f"{path}: sizes {header['sizes']} differ from this model's {sizes}")
    for name in _section_names(opt):
        section = sections.get(name)
        if section is None or section["count"] != sizes[name.rpartition(".")[2]]:
            raise CheckpointError(f"{path}: section {name} is missing or has the wrong size")


def load(opt: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore ``opt``'s state from ``path`` (see ``ZeroOptimizer.load``)."""
    comm = opt.comm
    path = os.fspath(path)
    error: BaseException | None = None
    header: Any = None
    if comm.rank == 0:
        try:
            _require_little_endian()
            header = read_header(path)
        except Exception as exc:
            header = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    header = comm.allgather(header if comm.rank == 0 else None)[0]
    if isinstance(header, Exception):  # identical on every rank
        raise CheckpointError(f"cannot load checkpoint: {header}")
    check_compatible(opt, header, path)  # deterministic: same verdict everywhere
    sections = _sections(header)
    names = _section_names(opt)
    targets = _shards(opt)
    # Read this rank's shards into scratch copies: nothing is touched until every
    # checksum has been verified.
    scratch = [(name, first, np.empty_like(shard)) for name, first, shard in targets]
    fh = None
    try:
        fh = comm.open_file(path, "r")
    except Exception as exc:
        error = exc
    comm.agree(error)
    try:
        for name, first, buf in scratch:
            target = buf if error is None else buf[:0]  # keep the collective sequence
            try:
                comm.read_at_all(fh, sections[name]["offset"] + first * buf.itemsize, target)
            except Exception as exc:
                error = error or exc
    finally:
        comm.close_file(fh)
    comm.agree(error)
    sums = _checksums(comm, names, scratch)
    bad = [n for n in names if _hex(sums[n]) != sections[n]["checksum"]]
    if bad:  # the sums are allreduced: every rank sees the same list
        raise CheckpointError(
            f"{path}: checksum mismatch in section(s) {', '.join(bad)}: the file is "
            "corrupted; nothing was loaded"
        )
    for (_, _, shard), (_, _, buf) in zip(targets, scratch, strict=True):
        np.copyto(shard, buf)
    del scratch
    stores = {"params": opt._flat, "exp_avg": opt._exp_avg, "exp_avg_sq": opt._exp_avg_sq}
    full_kinds = KINDS if opt.stage == 0 else ("params",) if opt.stage < 3 else ()
    traffic, comm.traffic = comm.traffic, {}  # not training traffic
    try:
        for kind in full_kinds:  # full copies everywhere: gather the shards just read
            for bucket in opt.layout.buckets:
                comm.allgatherv_inplace(
                    stores[kind][bucket.dtype][bucket.start : bucket.stop],
                    bucket.counts,
                    bucket.displs,
                )
    finally:
        comm.traffic = traffic
    opt.step_count = int(header["optimizer"]["step"])
    opt.skipped_steps = int(header["optimizer"].get("skipped_steps", 0))
    opt.zero_grad()
    return header


# -- command line -------------------------------------------------------------------------


def _summary(header: dict[str, Any], path: str) -> str:
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
        print(_summary(header, args.path))
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
        state = read(args.path)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    arrays = dict(state["params"])
    for kind in ("exp_avg", "exp_avg_sq"):
        arrays.update({f"{kind}/{n}": a for n, a in state[kind].items()})
    np.savez(args.npz, **arrays)
    print(f"wrote {len(arrays)} arrays to {args.npz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
