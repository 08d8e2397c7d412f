"""Single-file, world-size independent checkpoints of a zerompi optimizer.

* :mod:`.format`: the file format (header, checksums) and the numpy-only reader
  (:func:`read`, :func:`verify`, :func:`read_header`, export to ``.npz``);
* :mod:`.safetensors`: the safetensors format, numpy only (export of a checkpoint's
  parameters, and reading any part of a tensor, for :func:`load_safetensors`);
* :mod:`.collective`: :func:`save` and :func:`load` (behind ``ZeroOptimizer.save`` /
  ``ZeroOptimizer.load``), collective MPI-IO through the engine's communicator and
  the state functions of :mod:`zerompi.state`;
* :mod:`.__main__`: the command line, ``python -m zerompi.checkpoint
  {inspect,verify,export} PATH`` (``export --npz`` or ``--safetensors``).

Importing this package imports neither mpi4py nor the engine: :mod:`.collective`
is imported on the first call of :func:`save`, :func:`load` or
:func:`check_compatible`, so checkpoints can be read and checked without MPI.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .format import (
    ALIGN,
    FORMAT,
    KINDS,
    MAGIC,
    MASK,
    PREFIX,
    VERSION,
    CheckpointError,
    build_header,
    checksum,
    export_arrays,
    export_npz,
    file_size,
    layout_entries,
    parse_header,
    read,
    read_header,
    section_end,
    verify,
)

__all__ = [
    "ALIGN",
    "FORMAT",
    "KINDS",
    "MAGIC",
    "MASK",
    "PREFIX",
    "VERSION",
    "CheckpointError",
    "build_header",
    "check_compatible",
    "checksum",
    "export_arrays",
    "export_npz",
    "file_size",
    "layout_entries",
    "load",
    "load_safetensors",
    "main",
    "parse_header",
    "read",
    "read_header",
    "save",
    "section_end",
    "verify",
]


def save(engine: Any, path: str | os.PathLike) -> None:
    """Collective: write the state of ``engine`` (an optimizer's
    :class:`zerompi.engine.Engine`, ``opt.engine``) to ``path`` (see
    ``ZeroOptimizer.save`` and :func:`zerompi.checkpoint.collective.save`)."""
    from . import collective

    collective.save(engine, path)


def load(engine: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: restore the state of ``engine`` from ``path`` and return the
    header (see ``ZeroOptimizer.load`` and :func:`zerompi.checkpoint.collective.load`)."""
    from . import collective

    return collective.load(engine, path)


def load_safetensors(engine: Any, path: str | os.PathLike, strict: bool = True) -> None:
    """Collective: the parameters of ``engine`` from a safetensors file or directory
    (see ``ZeroOptimizer.load_safetensors`` and
    :func:`zerompi.checkpoint.collective.load_safetensors`)."""
    from . import collective

    collective.load_safetensors(engine, path, strict)


def check_compatible(engine: Any, header: dict[str, Any], path: str) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint holds exactly the
    engine's parameters (names, shapes, dtypes, order)."""
    from . import collective

    collective.check_compatible(engine, header, path)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see :mod:`zerompi.checkpoint.__main__`); the exit status."""
    from .__main__ import main as cli

    return cli(argv)
