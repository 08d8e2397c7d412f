"""Collective save and load of a zerompi optimizer's state with MPI-IO.

Every rank writes (and reads) only its own shards, at their offsets in the single
file of :mod:`zerompi.checkpoint.format`; the MPI calls go through the engine's
:class:`zerompi.mpi.collectives.Comm` (``open_file``, ``write_at_all``,
``read_at_all``, ``sum_uint64``, ``verdict``, ...), so this module imports no MPI
itself.

The optimizer is reached through its :class:`zerompi.engine.Engine` and the state
functions of :mod:`zerompi.state` only (``param_entries``, ``state_sections``,
``state_shards``, ``publish_state``, ``set_counters``, ``hyperparameters``,
``precision_settings``, ``set_loss_scale``), never through private attributes.

Errors are agreed on (:class:`zerompi.mpi.agreement.Verdict`): when anything fails
on any rank, every rank raises, and a failed save leaves the previous file at
``path`` untouched, a failed load leaves the optimizer untouched.
"""

from __future__ import annotations

import bisect
import os
import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import state
from ..mpi.agreement import CollectiveError
from ..mpi.launch import mark_raised_on_every_rank
from . import safetensors
from .format import (
    MASK,
    CheckpointError,
    build_header,
    checksum,
    file_size,
    hex_checksum,
    layout_entries,
    read_header,
    require_little_endian,
    rule_name,
    sections_by_name,
    state_names,
)

if TYPE_CHECKING:
    from ..blockwise import Entry
    from ..engine import Engine

Shards = list[tuple[str, int, np.ndarray]]


def _layout_params(engine: Engine) -> list[dict[str, Any]]:
    """The header's ``params`` list of the engine's model."""
    return layout_entries(
        [
            (name, tuple(shape), np.dtype(dtype).name, offset)
            for name, shape, dtype, offset in state.param_entries(engine)
        ]
    )


def _sizes(engine: Engine) -> dict[str, int]:
    return {np.dtype(d).name: int(n) for d, n in engine.layout.sizes.items()}


def _checksums(comm: Any, names: list[str], parts: Shards) -> dict[str, tuple[int, int]]:
    """Collective: every section's checksum, from each rank's shards."""
    partial = {n: [0, 0] for n in names}
    for name, first, shard in parts:
        a, b = checksum(shard, first)
        partial[name][0] += a
        partial[name][1] += b
    local = np.array([v & MASK for n in names for v in partial[n]], dtype=np.uint64)
    sums = comm.sum_uint64(local)
    return {n: (int(sums[2 * i]), int(sums[2 * i + 1])) for i, n in enumerate(names)}


def _owned(units: list[tuple[str, Entry]], held: list[np.ndarray] | None = None) -> Shards:
    """The entries of the states held per unit that this rank writes and checksums, as
    shards ``(section, first entry, entries)``: of ``held`` (one array shaped as each
    entry's, a load's scratch) or of the entries themselves."""
    arrays = held if held is not None else [e.held for _, e in units]
    return [(name, e.first + e.own.start, a[e.own])
            for (name, e), a in zip(units, arrays, strict=True)]  # fmt: skip


def _optimizer_entry(engine: Engine) -> dict[str, Any]:
    """The header's ``optimizer`` entry: the hyperparameters and the counters."""
    return {
        **state.hyperparameters(engine),
        **state.precision_settings(engine),
        "step": int(engine.step_count),
        "skipped_steps": int(engine.skipped_steps),
    }


def _save(engine: Engine, path: str | os.PathLike) -> None:
    """Collective: write the engine's full state to ``path`` (see ``ZeroOptimizer.save``)."""
    comm = engine.comm
    path = os.fspath(path)
    names = state.state_sections(engine)
    parts = state.state_shards(engine)
    units = state.unit_shards(engine)
    sums = _checksums(comm, names, parts + _owned(units))
    token = comm.allgather(f"{os.getpid()}-{secrets.token_hex(6)}" if comm.rank == 0 else None)[0]
    tmp = f"{path}.tmp-{token}"
    verdict = comm.verdict()
    with verdict:
        require_little_endian()
        head, header = build_header(
            _layout_params(engine),
            _sizes(engine),
            sums,
            _optimizer_entry(engine),
            engine.stage,
            comm.size,
            max(b.size for b in engine.layout.buckets),
            engine.rule.state_labels(),
            state.section_layouts(engine),
        )
    offsets = {s["name"]: s["offset"] for s in header["sections"]}
    fh = None
    with verdict:
        fh = comm.open_file(tmp, "w")
    try:
        with verdict.catch():
            comm.set_file_size(fh, 0)
        for name, first, shard in parts + _owned(units):
            itemsize = shard.dtype.itemsize
            data = shard if verdict.ok else shard[:0]  # keep the collective sequence
            with verdict.catch():
                comm.write_at_all(fh, offsets[name] + first * itemsize, data)
        if comm.rank == 0 and verdict.ok:
            with verdict.catch():
                comm.write_at(fh, 0, np.frombuffer(head, dtype=np.uint8))
        with verdict.catch():
            comm.set_file_size(fh, file_size(header))  # trailing padding, exact length
            comm.sync_file(fh)
    finally:
        comm.close_file(fh)
    try:
        verdict.agree()  # the write phase
        if comm.rank == 0:
            with verdict.catch():
                _commit(tmp, path)
        verdict.agree()
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


def check_compatible(engine: Engine, header: dict[str, Any], path: str) -> None:
    """Raise unless the checkpoint holds exactly the engine's parameters (names,
    shapes, dtypes, order). Deterministic, no communication: every rank decides alike."""
    mine = _layout_params(engine)
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
    saved, mine_rule = rule_name(header), engine.rule.name
    if saved != mine_rule:
        raise CheckpointError(
            f"{path} was saved with optimizer={saved!r} (states "
            f"{', '.join(state_names(header))}); this optimizer is optimizer={mine_rule!r} "
            f"(states {', '.join(engine.rule.state_labels())}): its state cannot be loaded"
        )
    sizes = _sizes(engine)
    sections = sections_by_name(header)
    if header["sizes"] != sizes:
        raise CheckpointError(f"{path}: sizes {header['sizes']} differ from this model's {sizes}")
    layouts = state.section_layouts(engine)
    for name in state.state_sections(engine):
        section = sections.get(name)
        label, _, dtype = name.rpartition(".")
        spec = layouts.get(label, {})
        count = spec["counts"][dtype] if "counts" in spec else sizes[dtype]
        if (section is None or section["count"] != count
                or section["dtype"] != spec.get("dtype", dtype)):  # fmt: skip
            raise CheckpointError(f"{path}: section {name} is missing or has the wrong size")


def _load(engine: Engine, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore the engine's state from ``path`` (see ``ZeroOptimizer.load``)."""
    comm = engine.comm
    path = os.fspath(path)
    header: Any = None
    if comm.rank == 0:
        try:
            require_little_endian()
            header = read_header(path)
        except Exception as exc:
            header = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    header = comm.allgather(header if comm.rank == 0 else None)[0]
    if isinstance(header, Exception):  # identical on every rank
        raise CheckpointError(f"cannot load checkpoint: {header}")
    check_compatible(engine, header, path)  # deterministic: same verdict everywhere
    sections = sections_by_name(header)
    names = state.state_sections(engine)
    targets = state.state_shards(engine)
    units = state.unit_shards(engine)
    targets += [(name, e.first, e.held) for name, e in units]  # (every unit it touches)
    # Read this rank's shards into scratch copies: nothing is touched until every
    # checksum has been verified.
    scratch = [(name, first, np.empty_like(shard)) for name, first, shard in targets]
    verdict = comm.verdict()
    fh = None
    with verdict:
        fh = comm.open_file(path, "r")
    try:
        for name, first, buf in scratch:
            target = buf if verdict.ok else buf[:0]  # keep the collective sequence
            with verdict.catch():
                comm.read_at_all(fh, sections[name]["offset"] + first * buf.itemsize, target)
    finally:
        comm.close_file(fh)
    verdict.agree()
    elements = len(scratch) - len(units)  # of the units, what it would write is summed
    sums = _checksums(comm, names, scratch[:elements] + _owned(
        units, [buf for _, _, buf in scratch[elements:]]))  # fmt: skip
    bad = [n for n in names if hex_checksum(sums[n]) != sections[n]["checksum"]]
    if bad:  # the sums are allreduced: every rank sees the same list
        raise CheckpointError(
            f"{path}: checksum mismatch in section(s) {', '.join(bad)}: the file is "
            "corrupted; nothing was loaded"
        )
    for (_, _, shard), (_, _, buf) in zip(targets, scratch, strict=True):
        np.copyto(shard, buf)
    del scratch
    state.publish_state(engine)  # full copies consistent again; gradients discarded
    optimizer = header["optimizer"]
    state.set_counters(engine, int(optimizer["step"]), int(optimizer.get("skipped_steps", 0)))
    state.set_loss_scale(engine, optimizer)
    return header


def save(engine: Engine, path: str | os.PathLike) -> None:
    """Collective: write the engine's full state to ``path`` (see
    ``ZeroOptimizer.save``). A :class:`CheckpointError` is a collective verdict,
    raised alike on every rank: marked so, the abort hook prints it once."""
    try:
        _save(engine, path)
    except CheckpointError as exc:
        raise mark_raised_on_every_rank(exc) from None


def load(engine: Engine, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore the engine's state from ``path`` (see
    ``ZeroOptimizer.load``); errors as :func:`save`."""
    try:
        return _load(engine, path)
    except CheckpointError as exc:
        raise mark_raised_on_every_rank(exc) from None


def _load_safetensors(engine: Engine, path: str, strict: bool) -> None:
    """Collective: see :func:`load_safetensors`."""
    comm = engine.comm
    found: Any = None
    if comm.rank == 0:
        try:
            require_little_endian()
            found = safetensors.entries(path)
        except Exception as exc:
            found = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    found = comm.allgather(found if comm.rank == 0 else None)[0]
    if isinstance(found, Exception):  # identical on every rank
        raise CheckpointError(f"cannot load {path}: {found}")
    entries = state.param_entries(engine)
    names = {name for name, *_ in entries}
    missing = [n for n in names if n not in found]
    shapes = [f"{n}: {list(found[n].shape)} in the file, {list(s)} here"
              for n, s, *_ in entries
              if n in found and tuple(found[n].shape) != tuple(s)]  # fmt: skip
    dtypes = [f"{n}: {found[n].dtype}" for n, *_ in entries
              if n in found and found[n].dtype not in safetensors.READABLE]  # fmt: skip
    unexpected = sorted(set(found) - names) if strict else []
    if missing or shapes or dtypes or unexpected:  # deterministic: the same everywhere
        problems = ([f"missing {sorted(missing)}"] if missing else []) + (
            [f"shapes differ ({'; '.join(shapes)})"] if shapes else []) + (
            [f"not floating-point ({'; '.join(dtypes)})"] if dtypes else []) + (
            [f"not parameters of this optimizer {unexpected} (strict=False ignores them)"]
            if unexpected else [])  # fmt: skip
        raise CheckpointError(f"cannot load {path}: " + ", ".join(problems))
    # Each rank reads only the parts of the tensors that fall in its own shards, into
    # scratch copies: nothing is touched until every rank has read everything.
    by_dtype: dict[str, list[tuple[int, int, str]]] = {}
    for name, shape, dtype, offset in entries:
        size = int(np.prod(shape, dtype=np.int64))
        by_dtype.setdefault(f"params.{np.dtype(dtype).name}", []).append(
            (offset, offset + size, name))
    for spans in by_dtype.values():
        spans.sort()
    targets = [(s, first, shard) for s, first, shard in state.state_shards(engine)
               if s in by_dtype]  # fmt: skip
    scratch = [np.empty_like(shard) for _, _, shard in targets]
    try:
        with comm.verdict():
            _read_shards(targets, scratch, by_dtype, found)
    except CollectiveError as exc:  # a read that failed on some rank, raised on every rank
        raise CheckpointError(f"cannot load {path}: {exc}") from None
    for (_, _, shard), buf in zip(targets, scratch, strict=True):
        np.copyto(shard, buf)
    del scratch
    state.publish_state(engine)  # full copies consistent again; gradients discarded
    state.set_counters(engine, engine.step_count, engine.skipped_steps)  # elastic: keep it


def _read_shards(
    targets: Shards, scratch: list[np.ndarray], by_dtype: dict[str, list[tuple[int, int, str]]],
    found: dict[str, safetensors.Entry],
) -> None:  # fmt: skip
    """Each shard's elements from the tensors that overlap it (in offset order), into
    its scratch copy: only this rank's bytes of each tensor are read."""
    ends = {section: [end for _, end, _ in spans] for section, spans in by_dtype.items()}
    for (section, first, shard), buf in zip(targets, scratch, strict=True):
        spans, last = by_dtype[section], first + shard.size
        k = bisect.bisect_right(ends[section], first)  # the first tensor ending past first
        while k < len(spans) and spans[k][0] < last:
            begin, end, name = spans[k]
            lo, hi = max(begin, first), min(end, last)
            if lo < hi:
                piece = safetensors.read_range(found[name], lo - begin, hi - begin, name)
                np.copyto(buf[lo - first : hi - first], piece, casting="same_kind")
            k += 1


def load_safetensors(engine: Engine, path: str | os.PathLike, strict: bool = True) -> None:
    """Collective: the engine's parameters from the safetensors file or directory
    ``path`` (see ``ZeroOptimizer.load_safetensors``); errors as :func:`save`."""
    try:
        _load_safetensors(engine, os.fspath(path), strict)
    except CheckpointError as exc:
        raise mark_raised_on_every_rank(exc) from None
