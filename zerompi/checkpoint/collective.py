"""Collective save and load of a :class:`zerompi.ZeroOptimizer` with MPI-IO.

Every rank writes (and reads) only its own shards, at their offsets in the single
file of :mod:`zerompi.checkpoint.format`; the MPI calls go through the optimizer's
:class:`zerompi.mpi.collectives.Comm` (``open_file``, ``write_at_all``,
``read_at_all``, ``sum_uint64``, ``agree``, ...), so this module imports no MPI itself.

The optimizer is used through its public state interface only, never through its
private attributes:

* ``opt.param_entries()``: ``(name, shape, dtype, offset)`` of every parameter;
* ``opt.state_sections()``: the section names, in file order;
* ``opt.state_shards()``: ``(section, first global element, writable shard view)``
  in one fixed order that every rank's collective I/O follows;
* ``opt.publish_state()``: collective, after the shards were overwritten;
* ``opt.set_counters(step, skipped_steps)``, ``opt.hyperparameters()``,
  ``opt.precision_settings()`` and ``opt.set_loss_scale(settings)``;
* the attributes ``comm``, ``layout`` (``sizes``, ``buckets``), ``stage``,
  ``step_count`` and ``skipped_steps``.

Errors are agreed on (``comm.agree``): when anything fails on any rank, every rank
raises, and a failed save leaves the previous file at ``path`` untouched, a failed
load leaves the optimizer untouched.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import numpy as np

from ..mpi.launch import mark_raised_on_every_rank
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
    sections_by_name,
)

Shards = list[tuple[str, int, np.ndarray]]


def _layout_params(opt: Any) -> list[dict[str, Any]]:
    """The header's ``params`` list of ``opt``'s model."""
    return layout_entries(
        [
            (name, tuple(shape), np.dtype(dtype).name, offset)
            for name, shape, dtype, offset in opt.param_entries()
        ]
    )


def _sizes(opt: Any) -> dict[str, int]:
    return {np.dtype(d).name: int(n) for d, n in opt.layout.sizes.items()}


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


def _optimizer_entry(opt: Any) -> dict[str, Any]:
    """The header's ``optimizer`` entry: the hyperparameters and the counters."""
    return {
        **opt.hyperparameters(),
        **opt.precision_settings(),
        "step": int(opt.step_count),
        "skipped_steps": int(opt.skipped_steps),
    }


def _save(opt: Any, path: str | os.PathLike) -> None:
    """Collective: write ``opt``'s full state to ``path`` (see ``ZeroOptimizer.save``)."""
    comm = opt.comm
    path = os.fspath(path)
    error: BaseException | None = None
    head = b""
    header: dict[str, Any] = {}
    names = opt.state_sections()
    parts = opt.state_shards()
    sums = _checksums(comm, names, parts)
    token = comm.allgather(f"{os.getpid()}-{secrets.token_hex(6)}" if comm.rank == 0 else None)[0]
    tmp = f"{path}.tmp-{token}"
    try:
        require_little_endian()
        head, header = build_header(
            _layout_params(opt),
            _sizes(opt),
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
    dtypes, order). Deterministic, no communication: every rank decides alike."""
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
    sizes = _sizes(opt)
    sections = sections_by_name(header)
    if header["sizes"] != sizes:
        raise CheckpointError(f"{path}: sizes {header['sizes']} differ from this model's {sizes}")
    for name in opt.state_sections():
        section = sections.get(name)
        if section is None or section["count"] != sizes[name.rpartition(".")[2]]:
            raise CheckpointError(f"{path}: section {name} is missing or has the wrong size")


def _load(opt: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore ``opt``'s state from ``path`` (see ``ZeroOptimizer.load``)."""
    comm = opt.comm
    path = os.fspath(path)
    error: BaseException | None = None
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
    check_compatible(opt, header, path)  # deterministic: same verdict everywhere
    sections = sections_by_name(header)
    names = opt.state_sections()
    targets = opt.state_shards()
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
    bad = [n for n in names if hex_checksum(sums[n]) != sections[n]["checksum"]]
    if bad:  # the sums are allreduced: every rank sees the same list
        raise CheckpointError(
            f"{path}: checksum mismatch in section(s) {', '.join(bad)}: the file is "
            "corrupted; nothing was loaded"
        )
    for (_, _, shard), (_, _, buf) in zip(targets, scratch, strict=True):
        np.copyto(shard, buf)
    del scratch
    opt.publish_state()  # full copies consistent again; gradients discarded
    optimizer = header["optimizer"]
    opt.set_counters(int(optimizer["step"]), int(optimizer.get("skipped_steps", 0)))
    opt.set_loss_scale(optimizer)
    return header


def save(opt: Any, path: str | os.PathLike) -> None:
    """Collective: write ``opt``'s full state to ``path`` (see ``ZeroOptimizer.save``).
    A :class:`CheckpointError` is a collective verdict, raised alike on every rank:
    marked so, the abort hook prints it once."""
    try:
        _save(opt, path)
    except CheckpointError as exc:
        raise mark_raised_on_every_rank(exc) from None


def load(opt: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore ``opt``'s state from ``path`` (see ``ZeroOptimizer.load``);
    errors as :func:`save`."""
    try:
        return _load(opt, path)
    except CheckpointError as exc:
        raise mark_raised_on_every_rank(exc) from None
