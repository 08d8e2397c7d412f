"""Every MPI call zerompi makes lives in this module.

The data path is two collectives with exact variable counts and no padding:
``Reduce_scatter`` (explicit ``recvcounts``, so mpi4py does not run an extra
Allgather to discover them) and ``Allgatherv``, both in place on a bucket of the
flat buffer. Ranks that own an empty shard pass a count of zero and take part like
any other. Around it, small collectives make validation collective: an error found
on one rank is raised on every rank, instead of leaving the others waiting forever
in their next collective.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI


class CollectiveError(ValueError):
    """Raised identically on every rank when validation failed on any rank."""


#: Predefined MPI types: reductions (MPI_SUM) are defined on these, not on user types.
_MPI_TYPES = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}


def _mpi_type(array: np.ndarray) -> MPI.Datatype:
    return _MPI_TYPES[array.dtype]


class Comm:
    """The communicator zerompi runs on, with the collectives it needs."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        self.mpi = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        #: Bytes this rank sent and received per data-path collective since the last
        #: :meth:`pop_traffic`, counted as the algorithm-independent volume: what must
        #: leave and reach this rank. Averaged over ranks it is exactly the textbook
        #: (W-1)/W of the buffer per reduce-scatter or allgather.
        self.traffic: dict[str, list[int]] = {}

    def _count(self, op: str, sent: int, received: int) -> None:
        entry = self.traffic.setdefault(op, [0, 0])
        entry[0] += sent
        entry[1] += received

    def pop_traffic(self) -> dict[str, dict[str, int]]:
        """``{op: {"sent": bytes, "received": bytes}}`` since the last call, and reset."""
        out = {op: {"sent": s, "received": r} for op, (s, r) in self.traffic.items()}
        self.traffic = {}
        return out

    # -- data path -------------------------------------------------------------

    def _check_fits(self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int]) -> None:
        # MPI does not check in-place bounds: a wrong count would write past the buffer.
        if len(counts) != self.size or any(
            c < 0 or d < 0 or d + c > buf.shape[0] for c, d in zip(counts, displs, strict=True)
        ):
            raise ValueError(
                f"counts {list(counts)} / displs {list(displs)} do not fit a buffer of "
                f"{buf.shape[0]} elements on {self.size} ranks"
            )

    def reduce_scatter_inplace(self, buf: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """Sum ``buf`` over ranks and scatter it: rank r receives elements
        ``[displs[r], displs[r] + counts[r])`` of the sum, written to the *top* of
        its own ``buf`` (MPI_IN_PLACE). Returns that view, ``buf[:counts[rank]]``."""
        if sum(counts) != buf.shape[0]:
            raise ValueError(f"counts {list(counts)} do not sum to the {buf.shape[0]} elements")
        self.mpi.Reduce_scatter(
            MPI.IN_PLACE, [buf, _mpi_type(buf)], recvcounts=list(counts), op=MPI.SUM
        )
        mine = counts[self.rank]
        size = buf.itemsize
        self._count("reduce_scatter", (buf.shape[0] - mine) * size, (self.size - 1) * mine * size)
        return buf[:mine]

    def allgatherv_inplace(
        self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int]
    ) -> None:
        """Every rank contributes ``buf[displs[r]:displs[r]+counts[r]]`` and receives
        everyone's slice into the same buffer (MPI_IN_PLACE)."""
        self._check_fits(buf, counts, displs)
        self.mpi.Allgatherv(MPI.IN_PLACE, [buf, list(counts), list(displs), _mpi_type(buf)])
        mine = counts[self.rank]
        size = buf.itemsize
        self._count("allgather", (self.size - 1) * mine * size, (sum(counts) - mine) * size)

    def allreduce_inplace(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over ranks, in place, on every rank (plain data parallelism).
        Counted as a reduce-scatter plus an allgather of equal shards."""
        self.mpi.Allreduce(MPI.IN_PLACE, [buf, _mpi_type(buf)], op=MPI.SUM)
        volume = 2 * buf.nbytes * (self.size - 1) // self.size if self.size > 1 else 0
        self._count("allreduce", volume, volume)

    def bcast_inplace(self, buf: np.ndarray, root: int = 0) -> None:
        """Overwrite ``buf`` on every rank with root's contents."""
        self.mpi.Bcast([buf, _mpi_type(buf)], root=root)

    # -- small collectives -----------------------------------------------------

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's (small, picklable) ``obj``, in rank order."""
        return self.mpi.allgather(obj)

    def max(self, value: float) -> float:
        """Maximum of a scalar over ranks."""
        return self.mpi.allreduce(value, op=MPI.MAX)

    def sum(self, value: float) -> float:
        """Sum of a scalar over ranks."""
        return self.mpi.allreduce(value, op=MPI.SUM)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every process of the job (all of COMM_WORLD), not just this
        communicator: the only safe exit when this rank cannot continue."""
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)  # let the launcher forward what this rank printed before the kill
        MPI.COMM_WORLD.Abort(code)

    def agree(self, error: BaseException | None) -> None:
        """Collective: raise on every rank if ``error`` is set on any rank.

        The raised exception keeps the type of the first failing rank's error when it
        is a ``TypeError`` or ``ValueError`` and names the ranks it was found on.
        """
        errors = self.allgather(None if error is None else (type(error).__name__, str(error)))
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        _, (kind, message) = failed[0]
        ranks = [r for r, e in failed if e == (kind, message)]
        where = (
            f"on all {self.size} ranks"
            if len(ranks) == self.size > 1
            else f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"of {self.size}"
        )
        others = len(failed) - len(ranks)
        if others:
            where += f"; {others} other rank(s) failed differently"
        exc_type = {"TypeError": TypeError}.get(kind, CollectiveError)
        raise exc_type(f"{message} ({where})")

    def check_same(self, value: Any, what: str) -> None:
        """Collective: raise on every rank unless ``value`` is equal on all ranks.

        For sequences the message names the first item that differs."""
        values = self.allgather(value)
        for r, other in enumerate(values):
            if other != values[0]:
                raise CollectiveError(
                    f"{what} differs between ranks: {_difference(values[0], other, r)}"
                )

    # -- MPI-IO (checkpoints) ----------------------------------------------------

    def sum_uint64(self, values: np.ndarray) -> np.ndarray:
        """Collective: elementwise sum of a small ``uint64`` array over ranks, modulo
        2**64 (unsigned overflow wraps), returned as a new array on every rank."""
        send = np.ascontiguousarray(values, dtype=np.uint64)
        out = np.empty_like(send)
        self.mpi.Allreduce([send, MPI.UINT64_T], [out, MPI.UINT64_T], op=MPI.SUM)
        return out

    def open_file(self, path: str, mode: str) -> MPI.File:
        """Collective: open ``path`` with MPI-IO, ``"w"`` (create, write only) or
        ``"r"`` (read only)."""
        amode = {
            "w": MPI.MODE_CREATE | MPI.MODE_WRONLY,
            "r": MPI.MODE_RDONLY,
        }[mode]
        return MPI.File.Open(self.mpi, str(path), amode, MPI.INFO_NULL)

    @staticmethod
    def set_file_size(fh: MPI.File, nbytes: int) -> None:
        """Collective: truncate or extend the file to ``nbytes`` (holes read as zeros)."""
        fh.Set_size(int(nbytes))

    @staticmethod
    def _file_buffer(array: np.ndarray) -> list[Any]:
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            raise ValueError("MPI-IO buffers must be contiguous")
        if array.dtype in _MPI_TYPES:
            return [array, _MPI_TYPES[array.dtype]]
        return [array.reshape(-1).view(np.uint8), MPI.BYTE]

    def write_at_all(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Collective: write ``array`` (native byte order, may be empty) at byte
        ``offset``; every rank of the communicator must call it."""
        fh.Write_at_all(int(offset), self._file_buffer(array))

    def write_at(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Independent write of ``array`` at byte ``offset`` (one rank)."""
        fh.Write_at(int(offset), self._file_buffer(array))

    def read_at_all(self, fh: MPI.File, offset: int, array: np.ndarray) -> None:
        """Collective: fill ``array`` (may be empty) from byte ``offset``."""
        fh.Read_at_all(int(offset), self._file_buffer(array))

    @staticmethod
    def sync_file(fh: MPI.File) -> None:
        """Collective: flush this file's writes to storage."""
        fh.Sync()

    @staticmethod
    def close_file(fh: MPI.File) -> None:
        """Collective: close an MPI-IO file."""
        fh.Close()


def library_version() -> str:
    """First line of the MPI library's version string (e.g. "MPICH Version: 5.0.2")."""
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def _difference(ref: Any, other: Any, rank: int) -> str:
    if isinstance(ref, (list, tuple)) and isinstance(other, (list, tuple)):
        for i, (a, b) in enumerate(zip(ref, other, strict=False)):
            if a != b:
                return f"item {i} is {_short(a)} on rank 0 but {_short(b)} on rank {rank}"
        return f"rank 0 has {len(ref)} items, rank {rank} has {len(other)} items"
    return f"rank 0 has {_short(ref)}, rank {rank} has {_short(other)}"


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
