"""A Lightning checkpoint as a directory: Lightning's dictionary plus zerompi's file.

``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) under
:class:`zerompi.lightning.ZeroMPIStrategy` makes ``path`` a directory holding

* ``lightning.ckpt``: Lightning's checkpoint dictionary (loops, callbacks, LR
  schedulers, hyperparameters, the *full* ``state_dict``), written by rank 0 with the
  strategy's ``CheckpointIO``; ``optimizer_states`` holds each group's settings only,
  and ``"zerompi"`` names the file below;
* ``zerompi.zmpi``: zerompi's single-file checkpoint (parameters, Adam moments, step
  count), written collectively with MPI-IO by every rank, and loadable at any world
  size and stage (:mod:`zerompi.checkpoint`).

``LightningModule.load_from_checkpoint("path/lightning.ckpt")`` reads the weights
without zerompi. Every step is collective and every error is raised on every rank.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..mpi.collectives import Comm

#: Lightning's dictionary inside a checkpoint directory.
META_FILE = "lightning.ckpt"
#: zerompi's checkpoint inside a checkpoint directory.
ZERO_FILE = "zerompi.zmpi"
#: The checkpoint dictionary's key for zerompi's part.
KEY = "zerompi"


def prepare_directory(comm: Comm, path: Path, keep_zero_file: bool) -> None:
    """Collective: ``path`` is a directory (rank 0 replaces a file or link there and
    creates it); a stale zerompi file is removed where none will be written."""
    comm.check_same(str(path), "the checkpoint path")
    with comm.verdict():
        if comm.rank == 0:
            if path.is_symlink() or path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            if not keep_zero_file:
                (path / ZERO_FILE).unlink(missing_ok=True)


def write_meta(
    comm: Comm, checkpoint: dict[str, Any], path: Path, save: Callable[[dict, Path], None]
) -> None:
    """Collective: rank 0 writes Lightning's dictionary with ``save``; an error there
    is raised on every rank."""
    with comm.verdict():
        if comm.rank == 0:
            save(checkpoint, path / META_FILE)


def read_meta(comm: Comm, path: Path, load: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Collective: the checkpoint dictionary of the directory ``path`` (every rank reads
    it), with ``checkpoint["zerompi"]["path"]`` set to its zerompi file when it has one."""
    checkpoint: dict[str, Any] = {}
    with comm.verdict():
        meta = path / META_FILE
        if not meta.is_file():
            raise FileNotFoundError(f"zerompi.lightning: {path} is a directory without "
                                    f"{META_FILE}: not a checkpoint of this strategy")  # fmt: skip
        checkpoint = load(meta)
        info = checkpoint.get(KEY)
        if info is not None:
            info["path"] = str(path / info["file"])
    return checkpoint


def remove(comm: Comm, path: Path) -> None:
    """Collective: rank 0 removes the checkpoint ``path`` (a directory or a file)."""
    with comm.verdict():
        if comm.rank == 0:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
