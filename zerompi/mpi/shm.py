"""Node-local shared memory: file-backed segments every rank of a node maps.

A segment is one file in ``/dev/shm`` (``ZEROMPI_SHM_DIR``), created by the node's
first rank with ``O_EXCL`` under an unguessable name and mode 0600 (another user of
the node can neither read it nor swap it), sized with ``posix_fallocate`` (a full
``/dev/shm`` is a clear error at construction, not a SIGBUS mid-step), mapped by
every rank, and unlinked as soon as every rank has mapped it. From then on the name
is gone: nothing is left behind after a normal exit, an abort or a SIGKILL, and the
memory lives exactly as long as some mapping of it. numpy views keep their mapping
alive, so an array handed out before ``close()`` stays valid afterwards (with MPI-3
windows it would have pointed at freed memory).

Ordering: a rank's writes before :meth:`zerompi.mpi.collectives.Comm.fence` (an
``MPI_Barrier``) are visible to every rank after it; MPI's barrier synchronises
through atomic operations that order memory on the platforms MPI runs on.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .collectives import Comm

#: Where segments are created (a tmpfs on Linux).
SHM_DIR_ENV = "ZEROMPI_SHM_DIR"
#: Every rank's part starts on a page boundary.
_PAGE = mmap.PAGESIZE


def shm_dir() -> str:
    return os.environ.get(SHM_DIR_ENV, "/dev/shm")


def shm_free_bytes() -> int | None:
    """Bytes free for an unprivileged user in :func:`shm_dir` (``None``: no such
    directory)."""
    try:
        st = os.statvfs(shm_dir())
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def segment_bytes(count: int, dtype: np.dtype, parts: int) -> int:
    """What a :class:`SharedSegment` of ``parts`` parts of ``count`` elements takes."""
    return _part_bytes(count, np.dtype(dtype)) * parts


def _part_bytes(count: int, dtype: np.dtype) -> int:
    return -(-max(count * dtype.itemsize, 1) // _PAGE) * _PAGE


class SharedSegment:
    """``count`` elements of ``dtype`` per rank of ``comm`` (every rank on one node):
    ``local`` is this rank's part, ``peers[r]`` rank r's, all directly addressable;
    with ``per_rank=False``, one array of ``count`` elements that every rank of
    ``comm`` maps (``local`` is it, ``peers`` is ``[local]``): the node's one copy.
    Collective to create; :meth:`release` drops this object's references (the
    memory goes when the last view of it does)."""

    def __init__(
        self, comm: Comm, count: int, dtype: np.dtype, label: str = "buf", per_rank: bool = True
    ) -> None:
        dtype = np.dtype(dtype)
        part = _part_bytes(count, dtype)
        parts = comm.size if per_rank else 1
        total = part * parts
        verdict = comm.verdict()
        path = ""
        if comm.rank == 0:
            path = os.path.join(shm_dir(), f"zerompi-{os.getpid()}-{secrets.token_hex(12)}")
            with verdict.catch():
                _create(path, total, label)
        path = comm.allgather(path if comm.rank == 0 else None)[0]
        verdict.agree()
        mapping = None
        with verdict.catch():
            fd = os.open(path, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, total, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        comm.fence()  # every rank has mapped it (or failed to): the name can go
        if comm.rank == 0:
            _unlink(path)
        verdict.agree()
        assert mapping is not None
        self.nbytes = total
        self.peers = [
            np.frombuffer(mapping, dtype=dtype, count=count, offset=r * part)
            for r in range(parts)
        ]
        self.local = self.peers[comm.rank if per_rank else 0]

    def release(self) -> None:
        """Drop this object's views; arrays handed out earlier stay valid."""
        self.peers = []


def _create(path: str, nbytes: int, label: str) -> None:
    """Create the segment's file exclusively, mode 0600, with ``nbytes`` reserved."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as exc:
        _unlink(path)
        raise OSError(
            f"cannot create {nbytes} bytes of shared memory for {label} in "
            f"{shm_dir()} ({exc.strerror}): make room there (containers often "
            f"cap /dev/shm at 64 MiB), point {SHM_DIR_ENV} at a tmpfs with room, "
            "or pass shared_memory=False"
        ) from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: Heartbeat columns: last collective call number, its operation, the step, whether
#: the rank is waiting in it now, and when it entered or left it (CLOCK_MONOTONIC,
#: the same clock for every process of a node). The rank's watchdog thread writes
#: them, to one poll, so that a wait costs the main thread no shared-memory writes.
_SEQ, _OP, _STEP, _WAITING, _TIME = range(5)


class Heartbeat:
    """Where each rank of this node is in its collective calls, in shared memory, so
    a rank whose wait timed out can tell which ranks have not arrived without their
    help (:mod:`.watchdog`). ``ranks`` are the communicator ranks of this node."""

    def __init__(self, segment: SharedSegment, ranks: list[int], ops: tuple[str, ...]) -> None:
        self._segment = segment
        self.ranks = ranks
        self.ops = ops
        self._rows = {rank: segment.peers[i] for i, rank in enumerate(ranks)}
        self._mine = memoryview(segment.local).cast("B").cast("q")  # fast item writes
        self._codes = {op: i for i, op in enumerate(ops)}

    def mark(self, seq: int, op: str, step: int, waiting: bool, since_ns: int) -> None:
        """This rank's state as its watchdog thread saw it: last collective call
        ``seq`` (``op``, at ``step``), waiting in it or not, since ``since_ns``
        (``time.monotonic_ns()``, to one watchdog poll)."""
        row = self._mine
        row[_SEQ] = seq
        row[_OP] = self._codes.get(op, -1)
        row[_STEP] = step
        row[_TIME] = since_ns
        row[_WAITING] = int(waiting)

    def report(self, me: int, seq: int) -> list[str]:
        """Lines naming the ranks of this node that have not reached call ``seq``."""
        now = time.monotonic_ns()
        late, there = [], []
        for rank, row in self._rows.items():
            if rank == me:
                continue
            their_seq, code, step, waiting, t = (int(x) for x in row[:5])
            op = self.ops[code] if 0 <= code < len(self.ops) else "?"
            ago = (now - t) / 1e9 if t else float("nan")
            if their_seq < seq or (their_seq == seq and not waiting):
                state = f"waiting in it for {ago:.1f} s" if waiting else f"left it {ago:.1f} s ago"
                late.append(
                    f"zerompi watchdog:   rank {rank} has not arrived: its last collective "
                    f"call is #{their_seq} ({op}, step {step}), {state}"
                    if their_seq
                    else f"zerompi watchdog:   rank {rank} has not arrived: no collective "
                    "call yet"
                )
            else:
                there.append(f"{rank} (call #{their_seq}, {op})")
        lines = [
            "zerompi watchdog: node heartbeat: "
            + (f"{len(late)} rank(s) of this node have not arrived" if late else
               "every other rank of this node has arrived")
            + (f"; arrived: {', '.join(there)}" if there else "")
        ]
        lines += late
        return lines
