"""MPI-IO for checkpoints: collective file access at byte offsets, each rank moving
only its own shards. A mixin of :class:`zerompi.mpi.collectives.Comm`."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

#: Predefined MPI types by numpy dtype.
MPI_TYPES = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.uint16): MPI.UINT16_T,  # 16-bit floats, moved (never summed) as uint16
    np.dtype(np.uint8): MPI.UINT8_T,  # 8-bit optimizer states' codes, moved, never summed
}


class FileIO:
    """MPI-IO methods of :class:`zerompi.mpi.collectives.Comm` (``self.mpi`` is the
    communicator)."""

    mpi: MPI.Intracomm

    def _blocking(self, op: str, tag: int, call: Any) -> Any:  # provided by Comm
        raise NotImplementedError

    def open_file(self, path: str, mode: str) -> MPI.File:
        """Collective: open ``path`` with MPI-IO, ``"w"`` (create, write only) or
        ``"r"`` (read only)."""
        amode = {
            "w": MPI.MODE_CREATE | MPI.MODE_WRONLY,
            "r": MPI.MODE_RDONLY,
        }[mode]
        return self._blocking(
            "file I/O", -1, lambda: MPI.File.Open(self.mpi, str(path), amode, MPI.INFO_NULL)
        )

    def set_file_size(self, fh: MPI.File, nbytes: int) -> None:
        """Collective: truncate or extend the file to ``nbytes`` (holes read as zeros)."""
        self._blocking("file I/O", -1, lambda: fh.Set_size(int(nbytes)))

    @staticmethod
    def _file_buffer(array: np.ndarray) -> list[Any]:
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            raise ValueError("MPI-IO buffers must be contiguous")
        if array.dtype in MPI_TYPES:
            return [array, MPI_TYPES[array.dtype]]
        return [array.reshape(-1).view(np.uint8), MPI.BYTE]

    def write_at_all(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Collective: write ``array`` (native byte order, may be empty) at byte
        ``offset``; every rank of the communicator must call it."""
        buf = self._file_buffer(array)
        self._blocking("file I/O", -1, lambda: fh.Write_at_all(int(offset), buf))

    def write_at(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Independent write of ``array`` at byte ``offset`` (one rank)."""
        fh.Write_at(int(offset), self._file_buffer(array))

    def read_at_all(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Collective: fill ``array`` (may be empty) from byte ``offset``."""
        buf = self._file_buffer(array)
        self._blocking("file I/O", -1, lambda: fh.Read_at_all(int(offset), buf))

    def sync_file(self, fh: MPI.File) -> None:
        """Collective: flush this file's writes to storage."""
        self._blocking("file I/O", -1, fh.Sync)

    def close_file(self, fh: MPI.File) -> None:
        """Collective: close an MPI-IO file."""
        self._blocking("file I/O", -1, fh.Close)


