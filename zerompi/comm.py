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

import os
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


class Pending:
    """A started nonblocking collective and the array it delivers. MPI owns the
    buffers until :meth:`wait` (or :meth:`Comm.wait_all`) returns."""

    __slots__ = ("request", "result")

    def __init__(self, request: MPI.Request, result: np.ndarray) -> None:
        self.request = request
        self.result = result

    @classmethod
    def done(cls, result: np.ndarray) -> Pending:
        """An already completed collective (one that was run blocking)."""
        return cls(MPI.REQUEST_NULL, result)

    def wait(self) -> np.ndarray:
        """Complete the collective (a no-op once complete) and return its array."""
        self.request.Wait()
        return self.result

    def test(self) -> bool:
        """Whether it has completed; advances MPI progress."""
        return bool(self.request.Test())


class SharedWindow:
    """An MPI-3 shared-memory window over a communicator whose ranks share one node:
    ``local`` is this rank's ``count`` elements, ``peers[r]`` rank r's, all directly
    addressable. Collective to create (:meth:`Comm.shared_window`) and to
    :meth:`free`."""

    def __init__(self, comm: Comm, count: int, dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        self.comm = comm
        self.win = MPI.Win.Allocate_shared(count * dtype.itemsize, dtype.itemsize, comm=comm.mpi)
        self.peers = [
            np.frombuffer(self.win.Shared_query(r)[0], dtype=dtype, count=count)
            for r in range(comm.size)
        ]
        self.local = self.peers[comm.rank]
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch: Sync orders memory

    def fence(self) -> None:
        """Collective: every rank's writes to its segment before the call are visible
        to every rank after it, and every rank's reads before it are done."""
        self.win.Sync()
        self.comm.mpi.Barrier()
        self.win.Sync()

    def free(self) -> None:
        """Collective: release the window; the arrays must not be used afterwards."""
        if self.win != MPI.WIN_NULL:
            self.peers = []
            self.local = np.empty(0, self.local.dtype)
            self.win.Unlock_all()
            self.win.Free()


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

    # -- nonblocking data path: the same collectives, started now, completed later --

    def ireduce_scatter(
        self, buf: np.ndarray, counts: Sequence[int], out: np.ndarray | None = None
    ) -> Pending:
        """Start :meth:`reduce_scatter_inplace` of ``buf``; with ``out`` (this rank's
        ``counts[rank]`` elements, not overlapping ``buf``) the shard lands there
        instead, which saves a copy. ``Pending.wait()`` returns the shard. Neither
        buffer may be touched until then."""
        if sum(counts) != buf.shape[0]:
            raise ValueError(f"counts {list(counts)} do not sum to the {buf.shape[0]} elements")
        mine = counts[self.rank]
        if out is None:
            out = buf[:mine]
            request = self.mpi.Ireduce_scatter(
                MPI.IN_PLACE, [buf, _mpi_type(buf)], recvcounts=list(counts), op=MPI.SUM
            )
        else:
            if out.shape != (mine,) or out.dtype != buf.dtype:
                raise ValueError(
                    f"out must be {mine} elements of {buf.dtype}, got {out.shape} {out.dtype}"
                )
            request = self.mpi.Ireduce_scatter(
                [buf, _mpi_type(buf)], [out, _mpi_type(out)], recvcounts=list(counts), op=MPI.SUM
            )
        size = buf.itemsize
        self._count("reduce_scatter", (buf.shape[0] - mine) * size, (self.size - 1) * mine * size)
        return Pending(request, out)

    def iallgatherv(self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int]) -> Pending:
        """Start :meth:`allgatherv_inplace`; ``buf`` is complete after ``wait()``."""
        self._check_fits(buf, counts, displs)
        request = self.mpi.Iallgatherv(
            MPI.IN_PLACE, [buf, list(counts), list(displs), _mpi_type(buf)]
        )
        mine = counts[self.rank]
        size = buf.itemsize
        self._count("allgather", (self.size - 1) * mine * size, (sum(counts) - mine) * size)
        return Pending(request, buf)

    def iallreduce(self, buf: np.ndarray) -> Pending:
        """Start :meth:`allreduce_inplace`; ``buf`` holds the sum after ``wait()``."""
        request = self.mpi.Iallreduce(MPI.IN_PLACE, [buf, _mpi_type(buf)], op=MPI.SUM)
        volume = 2 * buf.nbytes * (self.size - 1) // self.size if self.size > 1 else 0
        self._count("allreduce", volume, volume)
        return Pending(request, buf)

    # -- one node: shared memory instead of messages ---------------------------------

    def single_node(self) -> bool:
        """Collective: whether every rank of this communicator shares one node's
        memory (MPI_COMM_TYPE_SHARED), so :class:`SharedWindow` can span it."""
        node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            together = node.Get_size() == self.size
        finally:
            node.Free()
        return bool(self.mpi.allreduce(int(together), op=MPI.MIN))

    def shared_window(self, count: int, dtype: np.dtype) -> SharedWindow:
        """Collective: ``count`` elements of ``dtype`` per rank, every rank's segment
        addressable by all (call only when :meth:`single_node`)."""
        return SharedWindow(self, count, dtype)

    def shared_reduce_scatter(
        self,
        window: SharedWindow,
        offset: int,
        counts: Sequence[int],
        displs: Sequence[int],
        out: np.ndarray,
        add: bool,
        reuse: bool,
    ) -> None:
        """Collective, blocking: the reduce-scatter of the bucket every rank wrote at
        ``window.local[offset : offset + sum(counts)]``, without messages: this rank
        sums its part of every rank's segment, in rank order, into ``out``
        (``out += sum`` with ``add``). ``reuse``: a rank may overwrite its bucket as
        soon as this returns (one more fence); otherwise only after the next fence.
        Counted as the reduce-scatter it replaces."""
        window.fence()  # every rank's bucket is written
        mine, lo = counts[self.rank], offset + displs[self.rank]
        if out.shape != (mine,):
            raise ValueError(f"out must be {mine} elements, got {out.shape}")
        parts = [peer[lo : lo + mine] for peer in window.peers]
        if add:
            for part in parts:
                np.add(out, part, out=out)
        elif len(parts) == 1:
            np.copyto(out, parts[0])
        else:
            np.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                np.add(out, part, out=out)
        if reuse:
            window.fence()  # every rank has read this bucket
        size = out.itemsize
        self._count("reduce_scatter", (sum(counts) - mine) * size, (self.size - 1) * mine * size)

    def shared_allgatherv(
        self, window: SharedWindow, pieces: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> None:
        """Collective, blocking: :meth:`allgatherv_inplace` of every bucket
        ``(start, counts, displs)`` of ``window`` without messages: after one fence
        this rank copies every other rank's part of each bucket from that rank's
        segment into its own. The caller must not let any rank write its part again
        before every rank has copied it (the next collective of the step orders it).
        Counted as the allgathers it replaces."""
        window.fence()  # every rank's part is written
        size = window.local.itemsize
        for start, counts, displs in pieces:
            for r, peer in enumerate(window.peers):
                if r != self.rank and counts[r]:
                    lo = start + displs[r]
                    np.copyto(window.local[lo : lo + counts[r]], peer[lo : lo + counts[r]])
            mine = counts[self.rank]
            self._count("allgather", (self.size - 1) * mine * size, (sum(counts) - mine) * size)

    @staticmethod
    def progress(pending: Sequence[Pending]) -> None:
        """Let the MPI library advance started collectives without waiting for them.
        Without an asynchronous progress thread, MPI moves data only inside MPI calls:
        the engine calls this between blocks of other work."""
        if pending:
            MPI.Request.Testall([p.request for p in pending])

    @staticmethod
    def wait_all(pending: Sequence[Pending]) -> None:
        """Complete every started collective in ``pending``."""
        if pending:
            MPI.Request.Waitall([p.request for p in pending])

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

    def allgather_float64(self, values: np.ndarray) -> np.ndarray:
        """Collective: every rank's small 1-D ``float64`` array, stacked in rank order
        as a new ``(size, len(values))`` array, identical on every rank. Summing its
        rows in order gives every rank bit-identical totals, which an ``Allreduce``
        does not promise. A control message (a few numbers per step, such as gradient
        statistics), not counted as data-path traffic."""
        send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        out = np.empty((self.size, send.shape[0]), dtype=np.float64)
        self.mpi.Allgather([send, MPI.DOUBLE], [out, MPI.DOUBLE])
        return out

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


# -- abort on an uncaught exception ---------------------------------------------------
#
# A rank that dies of an exception while the others wait for it in a collective leaves
# them waiting forever: MPI has no failure detection, and mpiexec only ends the job once
# *every* process has exited. The hook below turns an uncaught exception on any rank
# into ``MPI_Abort`` on ``COMM_WORLD``, which makes the launcher kill the whole job.

#: Setting this environment variable to ``1`` (read when the hook would be installed)
#: keeps :func:`install_abort_hook` from doing anything.
NO_ABORT_HOOK_ENV = "ZEROMPI_NO_ABORT_HOOK"

_previous_hooks: tuple[Any, Any] | None = None  # (sys.excepthook, threading.excepthook)
_aborting = False


def _world_rank_size() -> tuple[int, int] | None:
    """``(rank, size)`` of COMM_WORLD, or ``None`` when MPI is not running (not
    initialized yet, or finalized already): then there is nothing to abort."""
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return None
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except Exception:  # pragma: no cover - a broken MPI: leave it to the default hook
        return None


def _abort_world(
    exc_type: type[BaseException], exc: BaseException | None, tb: Any, where: str = ""
) -> None:
    """Report ``exc`` on stderr, naming this rank, and abort every process of the job."""
    global _aborting
    import traceback

    rank, size = _world_rank_size() or (0, 1)
    if _aborting:  # a second failure (another thread, or while reporting the first)
        MPI.COMM_WORLD.Abort(1)
    _aborting = True
    code = 1
    try:
        if issubclass(exc_type, KeyboardInterrupt):
            code = 130  # 128 + SIGINT, as a shell reports it (and mpi4py's runner)
            sys.stderr.write(
                f"zerompi: rank {rank} of {size} interrupted (KeyboardInterrupt){where}; "
                "aborting the job\n"
            )
        else:
            detail = "".join(traceback.format_exception_only(exc_type, exc)).strip()
            sys.stderr.write(f"zerompi: rank {rank} of {size} failed{where}: {detail}\n")
            sys.stderr.write("".join(traceback.format_exception(exc_type, exc, tb)))
            sys.stderr.write(
                f"zerompi: aborting all {size} ranks (MPI_Abort on COMM_WORLD); set "
                f"{NO_ABORT_HOOK_ENV}=1 to disable\n"
            )
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # pragma: no cover - closed streams must not stop the abort
            pass
        time.sleep(0.5)  # let the launcher forward what this rank printed before the kill
        MPI.COMM_WORLD.Abort(code)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    world = _world_rank_size()
    previous = _previous_hooks[0] if _previous_hooks else sys.__excepthook__
    if world is None or world[1] == 1:
        previous(exc_type, exc, tb)
        return
    _abort_world(exc_type, exc, tb)


def _threading_excepthook(args: Any) -> None:
    world = _world_rank_size()
    if world is None or world[1] == 1 or issubclass(args.exc_type, SystemExit):
        import threading

        previous = _previous_hooks[1] if _previous_hooks else threading.__excepthook__
        previous(args)
        return
    name = getattr(args.thread, "name", None)
    _abort_world(
        args.exc_type,
        args.exc_value,
        args.exc_traceback,
        f" in thread {name!r}" if name else " in a thread",
    )


def install_abort_hook() -> bool:
    """Make an uncaught exception on any rank end the whole MPI job at once.

    Installs (once; later calls do nothing) a :data:`sys.excepthook` and a
    :data:`threading.excepthook` that, when ``COMM_WORLD`` has more than one process,
    print ``zerompi: rank R of W failed: <Type>: <message>`` and the traceback to
    stderr and call ``MPI.COMM_WORLD.Abort(1)`` (130 for ``KeyboardInterrupt``, with a
    one-line message), so the launcher kills every rank instead of leaving the others
    waiting forever in a collective. With one process, or before ``MPI_Init`` / after
    ``MPI_Finalize``, the previous hooks run unchanged. Works under ``python -m mpi4py``
    too (its runner re-raises the exception, which then reaches this hook).

    Not covered: ``sys.exit()``/``SystemExit`` on one rank (it bypasses the excepthook;
    run under ``python -m mpi4py`` to abort on a non-zero exit status too) and a rank
    killed by a signal (the launcher handles that itself).

    Opt out with the environment variable ``ZEROMPI_NO_ABORT_HOOK=1`` (read here, at
    install time) or :func:`uninstall_abort_hook`. Returns whether the hook is
    installed after the call.
    """
    global _previous_hooks
    import os
    import threading

    if _previous_hooks is not None:
        return True
    if os.environ.get(NO_ABORT_HOOK_ENV, "").strip() not in ("", "0"):
        return False
    _previous_hooks = (sys.excepthook, threading.excepthook)
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    return True


def uninstall_abort_hook() -> None:
    """Restore the hooks :func:`install_abort_hook` replaced (if they are still ours)."""
    global _previous_hooks
    import threading

    if _previous_hooks is None:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _previous_hooks[0]
    if threading.excepthook is _threading_excepthook:
        threading.excepthook = _previous_hooks[1]
    _previous_hooks = None


#: Environment variables by which launchers announce how many processes they started.
LAUNCHER_SIZE_VARIABLES = (
    "SLURM_STEP_NUM_TASKS",  # srun
    "PMI_SIZE",  # MPICH's hydra and other PMI-1 launchers
    "PMIX_SIZE",
    "OMPI_COMM_WORLD_SIZE",  # Open MPI's mpirun
)


def check_world() -> None:
    """Refuse the classic silent mistake: every rank alone in a world of one while the
    launcher started several (``srun --mpi=none``, or an mpi4py built against another
    MPI than the launcher's): each would train on its own. ``ZEROMPI_ALLOW_SINGLETON=1``
    skips the check."""
    if MPI.COMM_WORLD.Get_size() != 1 or os.environ.get("ZEROMPI_ALLOW_SINGLETON") == "1":
        return
    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"MPI sees a world of 1 process, but {name}={value}: the launcher started "
                f"{value} processes that do not form one MPI world, so each would train "
                "alone. Launch with an MPI-aware launcher matching mpi4py's MPI "
                "(mpiexec -n N, or srun --mpi=pmi2 / pmix under SLURM), check "
                "`python -m mpi4py --mpi-library` against the launcher, or set "
                "ZEROMPI_ALLOW_SINGLETON=1 if this is intended."
            )
