"""The safetensors format, written and read with numpy alone.

`safetensors <https://github.com/huggingface/safetensors>`_ is the weights format of
Hugging Face and of torch's distributed checkpoint readers. A file is::

    u64 (little-endian)   n, the length of the JSON header in bytes
    n bytes               {"NAME": {"dtype": "F32", "shape": [...], "data_offsets":
                          [begin, end]}, ..., "__metadata__": {str: str}}, padded
                          with spaces to a multiple of 8 bytes
    the data              every tensor's bytes, little-endian, row-major, at
                          [begin, end) from the start of the data; no holes

A model larger than one file is split into ``model-00001-of-0000N.safetensors``
files with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``) beside them, as ``transformers`` writes and reads it;
a model that fits is one ``model.safetensors``.

This module is the format only: :func:`export` writes a zerompi checkpoint's
parameters as safetensors (``python -m zerompi.checkpoint export PATH --safetensors
DIR``), :func:`write_file` writes arrays, :func:`entries` finds where each tensor
of a file or a directory lies, and :func:`read_range` reads any part of one, so a
rank reads only its own shard (:func:`zerompi.checkpoint.collective.load_safetensors`,
behind ``ZeroOptimizer.load_safetensors``). It imports neither mpi4py nor the
``safetensors`` package (the tests read its files with that package).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .format import CheckpointError, read_header, require_little_endian, verify

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: The numbered files of a sharded export.
_NUMBERED = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: The largest file :func:`export` writes before it starts another (transformers'
#: default ``max_shard_size``).
MAX_SHARD_BYTES = 5 * 10**9
#: The ``__metadata__`` written: ``transformers`` refuses a file whose ``format`` is
#: not a framework it knows; the tensors are laid out as torch's own writer does.
METADATA = {"format": "pt"}

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
#: The dtype codes zerompi reads (into a float32 or float64 master).
READABLE = frozenset(_ITEMSIZE)


def _numpy_dtype(code: str, where: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (``BF16`` needs ml_dtypes)."""
    if code == "BF16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
            raise CheckpointError(
                f"{where} is BF16: reading it needs ml_dtypes (pip install ml_dtypes)"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    names = {v: k for k, v in _CODES.items()}
    if code not in names:
        raise CheckpointError(
            f"{where} has dtype {code}; zerompi reads floating-point tensors only "
            f"({', '.join(_CODES.values())})"
        )
    return np.dtype(names[code]).newbyteorder("<")


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype code, shape and first byte in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def header_bytes(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The length prefix and header of a file holding ``(name, dtype code, shape)``
    in that order, packed with no gaps; and the length of its data."""
    header: dict[str, Any] = {"__metadata__": METADATA}
    end = 0
    for name, code, shape in tensors:
        begin, end = end, end + int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[code]
        header[name] = {"dtype": code, "shape": [int(s) for s in shape],
                        "data_offsets": [begin, end]}  # fmt: skip
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, end


def code_of(dtype: np.dtype) -> str:
    """The safetensors dtype code of a numpy dtype."""
    name = np.dtype(dtype).name
    if name not in _CODES:
        raise TypeError(f"safetensors export: dtype {dtype} is not a float type zerompi writes")
    return _CODES[name]


def write_file(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> int:
    """Write ``arrays`` (name -> array, in that order) to the safetensors file
    ``path``; returns its size in bytes."""
    require_little_endian()
    head, length = header_bytes((n, code_of(a.dtype), a.shape) for n, a in arrays.items())
    with open(path, "wb") as f:
        f.write(head)
        for array in arrays.values():
            f.write(np.ascontiguousarray(array).tobytes())
    return len(head) + length


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def plan_files(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into files in order, a new file whenever the next tensor would
    take the current one past ``max_bytes`` (a larger tensor gets a file of its own),
    as ``transformers`` shards a model."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    files: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if files[-1] and used + nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += nbytes
    return files


def export(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, max_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write the parameters of the zerompi checkpoint ``checkpoint`` (every checksum
    verified first) into ``out_dir`` as safetensors: ``model.safetensors``, or
    numbered files and ``model.safetensors.index.json`` past ``max_bytes`` per file.
    One tensor is in memory at a time. The files of an earlier export there (of
    another file count) are removed, so that the index read is this one's, as
    ``transformers`` does. Returns the files written."""
    require_little_endian()
    checkpoint = os.fspath(checkpoint)
    problems = verify(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint}: " + "; ".join(problems))
    header = read_header(checkpoint)
    sections = {s["name"]: s for s in header["sections"]}
    params = {p["name"]: p for p in header["params"]}

    def nbytes(p: dict[str, Any]) -> int:
        return int(np.prod(p["shape"], dtype=np.int64)) * np.dtype(p["dtype"]).itemsize

    groups = plan_files(((n, nbytes(p)) for n, p in params.items()), max_bytes)
    files = _shard_names(len(groups))
    os.makedirs(out_dir, exist_ok=True)
    total = 0
    for file, names in zip(files, groups, strict=True):
        head, length = header_bytes(
            (n, _CODES[params[n]["dtype"]], tuple(params[n]["shape"])) for n in names
        )
        with open(os.path.join(out_dir, file), "wb") as f:
            f.write(head)
            for name in names:
                p = params[name]
                dtype = np.dtype(p["dtype"]).newbyteorder("<")
                section = sections[f"params.{p['dtype']}"]
                n = int(np.prod(p["shape"], dtype=np.int64))
                at = section["offset"] + p["offset"] * dtype.itemsize
                values = np.fromfile(checkpoint, dtype=dtype, count=n, offset=at)
                f.write(values.tobytes())
        total += length
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in zip(files, groups, strict=True)
                                for n in names}}  # fmt: skip
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump(index, f, indent=2)
        files = [*files, INDEX]
    for stale in sorted(set(os.listdir(out_dir)) - set(files)):  # an earlier export's
        if stale in (SINGLE, INDEX) or _NUMBERED.fullmatch(stale):
            os.remove(os.path.join(out_dir, stale))
    return [os.path.join(out_dir, f) for f in files]


def _file_entries(path: str) -> dict[str, Entry]:
    """The tensors of one safetensors file, checked: a complete header, offsets that
    cover the data without holes or overlaps, a file long enough."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise CheckpointError(f"{path}: not a safetensors file (a header of {n} "
                                      f"bytes in a file of {size})")  # fmt: skip
            text = f.read(n)
        header = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (the header is not an object)")
    header.pop("__metadata__", None)
    start = 8 + n
    found = {}
    spans = []
    for name, t in header.items():
        try:
            code, (begin, end) = t["dtype"], t["data_offsets"]
            shape = tuple(int(s) for s in t["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry {t!r}") from None
        entry = Entry(path, code, shape, start + int(begin))
        if code in _ITEMSIZE and end - begin != entry.size * _ITEMSIZE[code]:
            raise CheckpointError(f"{path}: tensor {name!r} of shape {list(shape)} {code} "
                                  f"has {end - begin} bytes")  # fmt: skip
        found[name] = entry
        spans.append((int(begin), int(end)))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{path}: the tensors' data has a hole or an overlap at "
                                  f"byte {min(begin, position)}")  # fmt: skip
        position = end
    if start + position > size:
        raise CheckpointError(f"{path}: truncated ({size} bytes, the header says "
                              f"{start + position})")  # fmt: skip
    return found


def entries(path: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of the safetensors file ``path``, or of the directory ``path``
    (``model.safetensors.index.json`` and its files, else ``model.safetensors``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return _file_entries(path)
    index = os.path.join(path, INDEX)
    if not os.path.exists(index):
        if os.path.exists(os.path.join(path, SINGLE)):
            return _file_entries(os.path.join(path, SINGLE))
        raise CheckpointError(f"{path}: a directory with neither {INDEX} nor {SINGLE}")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
    found: dict[str, Entry] = {}
    for file in sorted(set(weight_map.values())):
        for name, entry in _file_entries(os.path.join(path, file)).items():
            if weight_map.get(name) == file:
                found[name] = entry
    missing = sorted(set(weight_map) - set(found))
    if missing:
        raise CheckpointError(f"{index}: tensors listed but not in their file: {missing[:5]}")
    return found


def read_range(entry: Entry, lo: int, hi: int, name: str = "tensor") -> np.ndarray:
    """Elements ``[lo, hi)`` of a tensor (row-major), in its own dtype."""
    dtype = _numpy_dtype(entry.dtype, f"{entry.file}: {name}")
    raw = np.fromfile(entry.file, dtype=np.uint8, count=(hi - lo) * dtype.itemsize,
                      offset=entry.offset + lo * dtype.itemsize)  # fmt: skip
    if raw.size != (hi - lo) * dtype.itemsize:
        raise CheckpointError(f"{entry.file}: {name} is truncated")
    return raw.view(dtype)
