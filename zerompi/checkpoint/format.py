"""The zerompi checkpoint file format and its numpy-only reader.

File format (all integers little-endian)::

    offset 0   8 bytes   magic b"ZEROMPI\\x01"
    offset 8   u64       n, length of the JSON header in bytes
    offset 16  u32       crc32 of the JSON header bytes
    offset 20  u32       zero
    offset 24  n bytes   UTF-8 JSON header
               zeros     up to the next multiple of 64
               sections  each 64-byte aligned, zero padding between them

For every dtype of the model (in layout order) there is a section ``params.<dtype>``
and one per state of the update rule (Adam: ``exp_avg.<dtype>`` and
``exp_avg_sq.<dtype>``; SGD: ``momentum_buffer.<dtype>``; Lion: ``exp_avg.<dtype>``),
each the full flat vector of that dtype (``sizes[dtype]`` elements, little-endian) in the
*global* flat order: parameters of that dtype packed in the mapping's order. A state
may be stored in another dtype (8-bit Adam's codes: ``exp_avg_codes.float32`` holds
one ``uint8`` per element) or per unit of the flat vector (its scales:
``exp_avg_scales.float32``, ``"per": "block", "block": 256`` in the section,
``ceil(n / 256)`` entries; Adafactor's ``"per": "row"`` and ``"column"``: each matrix's
rows, then columns, in the parameters' order; ``"vector"``: the elements of the
parameters with fewer than two dimensions); the section's ``dtype``, ``count`` and
``per`` say so. The
order does not depend on the world size, the stage or the bucketing, so a
checkpoint saved by any world loads into any other.

The JSON header::

    {"format": "zerompi-checkpoint", "version": 1,
     "params": [{"name", "shape", "dtype", "offset"}, ...],   # mapping order
     "sizes": {dtype: n},
     "sections": [{"name", "dtype", "offset", "count", "checksum": [s1, s2]}, ...],
     "optimizer": {"rule", "states", <the rule's hyperparameters: Adam's "lr",
                   "beta1", "beta2", "eps", "weight_decay", "decoupled">, "step",
                   "skipped_steps"},          # no "rule"/"states" (older files): Adam
     "stage": ..., "world_size": ..., "max_bucket_elems": ...}

Section checksum: the section viewed as words ``w_i`` (``uint32`` for float32,
``uint64`` for float64, the bytes for uint8), ``s1 = sum(w_i) mod 2**64`` and
``s2 = sum((i + 1) * w_i) mod 2**64`` with ``i`` the global word index. Both are
sums, so every rank checksums only its own shards and the parts are added up
(modulo 2**64) with one allreduce; :func:`read` recomputes them over whole sections.

This module is numpy-only: it imports neither mpi4py nor the rest of zerompi (it can
even be loaded on its own with ``runpy.run_path``). The collective writer and loader
are in :mod:`zerompi.checkpoint.collective`, the command line in
:mod:`zerompi.checkpoint.__main__`.
"""

from __future__ import annotations

import json
import os
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
#: Elements per block when :func:`verify` reads a section.
READ_BLOCK = 1 << 22

_WORD = {"float32": np.dtype("<u4"), "float64": np.dtype("<u8"), "uint8": np.dtype("u1")}
_DTYPE = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "uint8": np.dtype("u1")}
#: The sections of a file of the Adam rule (and of every file written before rules).
KINDS = ("params", "exp_avg", "exp_avg_sq")


def state_names(header: dict[str, Any]) -> list[str]:
    """The update rule's states a checkpoint holds (Adam's where it does not say)."""
    return list(header["optimizer"].get("states", KINDS[1:]))


def rule_name(header: dict[str, Any]) -> str:
    """The update rule a checkpoint was saved with (``"adam"`` where it does not say)."""
    return str(header["optimizer"].get("rule", "adam"))


class CheckpointError(ValueError):
    """A file that is not a (valid, complete, intact) zerompi checkpoint."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def require_little_endian() -> None:
    """Raise on a big-endian host: sections are written from native buffers."""
    if sys.byteorder != "little":
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


def hex_checksum(pair: Sequence[int]) -> list[str]:
    """A checksum ``(s1, s2)`` as the header stores it: two 16-digit hex strings."""
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
    states: Sequence[str] = KINDS[1:],
    layouts: dict[str, dict[str, Any]] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """The file's first bytes (prefix, JSON, padding) and the header dict, with every
    section's absolute offset. ``checksums`` maps section name -> (s1, s2);
    ``states``: the update rule's (Adam's by default); ``layouts``: per state whose
    sections are not one element of the parameters' dtype per element, what they
    are: ``{"dtype": "uint8"}`` for 8-bit codes; for a state held per unit (one scale
    per block of 256 elements, a matrix's rows or columns), ``"per"`` (``"block"``,
    ``"row"``, ``"column"``, ``"vector"``), ``"block"`` where it is one, and its
    ``"counts"`` by dtype."""
    layouts = layouts or {}
    sections = []
    for dtype, n in sizes.items():
        for kind in ("params", *states):
            spec = layouts.get(kind, {})
            section = {"name": f"{kind}.{dtype}", "dtype": spec.get("dtype", dtype),
                       "count": int(spec["counts"][dtype]) if "counts" in spec else int(n)}
            for key in ("per", "block"):
                if key in spec:
                    section[key] = spec[key]
            sections.append(section)
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
            section["checksum"] = hex_checksum(checksums[section["name"]])
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
    """Byte offset just past a section's data."""
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
    got = hex_checksum(checksum(values))
    if got != section["checksum"]:
        raise CheckpointError(
            f"{path}: checksum mismatch in section {section['name']} "
            f"(stored {section['checksum']}, computed {got}): the file is corrupted"
        )


def sections_by_name(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The header's sections by name."""
    return {s["name"]: s for s in header["sections"]}


def read(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Everything in a checkpoint, as numpy arrays (no MPI): ``{"params": {name:
    array}, <each state of the rule>: {...} (Adam: "exp_avg", "exp_avg_sq"; a state
    held per unit, 8-bit Adam's scales or Adafactor's rows: ``{dtype: its entries}``),
    "optimizer": {...}, "world_size", "stage", "header"}``. Verifies every checksum
    unless ``verify`` is false; raises :class:`CheckpointError` (a ``ValueError``)
    for a truncated, corrupted or foreign file."""
    path = os.fspath(path)
    header = read_header(path)
    sections = sections_by_name(header)
    kinds = ("params", *state_names(header))
    out: dict[str, Any] = {kind: {} for kind in kinds}
    per_unit: set[str] = set()
    for kind in kinds:
        for dtype in header["sizes"]:
            section = sections.get(f"{kind}.{dtype}")
            if section is None:
                raise CheckpointError(f"{path}: section {kind}.{dtype} is missing")
            flat = _read_section(path, section)
            if verify:
                _check_section(path, section, flat)
            if section.get("per", "element") != "element":  # entries per unit
                out[kind][dtype] = flat
                per_unit.add(kind)
                continue
            for p in header["params"]:
                if p["dtype"] == dtype:
                    n = int(np.prod(p["shape"], dtype=np.int64))
                    out[kind][p["name"]] = flat[p["offset"] : p["offset"] + n].reshape(p["shape"])
    for kind in kinds:
        if kind in per_unit:
            continue
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
            got = hex_checksum((s1, s2))
            if got != section["checksum"]:
                problems.append(
                    f"checksum mismatch in section {section['name']} "
                    f"(stored {section['checksum']}, computed {got})"
                )
    return problems


# -- export -------------------------------------------------------------------------------


def export_arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a :func:`read` result under flat names: the parameters by their
    names, the rule's states as ``<state>/<name>`` (Adam: ``exp_avg/<name>`` and
    ``exp_avg_sq/<name>``)."""
    arrays = dict(state["params"])
    for kind in state_names(state["header"]):
        arrays.update({f"{kind}/{n}": a for n, a in state[kind].items()})
    return arrays


def export_npz(path: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write every array of the checkpoint at ``path`` (checksums verified) to the
    ``.npz`` file ``out`` (see :func:`export_arrays`); returns how many."""
    arrays = export_arrays(read(path))
    np.savez(out, **arrays)
    return len(arrays)
