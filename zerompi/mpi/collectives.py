"""The exact-count data path and the small collectives around it.

The data path is two collectives with exact variable counts and no padding:
``Reduce_scatter`` (explicit ``recvcounts``, so mpi4py does not run an extra
Allgather to discover them) and ``Allgatherv``, both in place on a bucket of the
flat buffer, blocking or nonblocking. Ranks that own an empty shard pass a count of
zero and take part like any other. Around it, small collectives make validation
collective (:mod:`.agreement`): an error found on one rank is raised on every rank,
instead of leaving the others waiting forever in their next collective.

Every data-path call is recorded in the communicator's :class:`Fingerprint` and every
blocking call is bracketed by the :data:`WATCHDOG`, so a desynchronised job either
fails the next step's agreement or ends with a diagnosis within its timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from mpi4py import MPI

from .agreement import OP_CODE, Agreement, CollectiveError, Fingerprint
from .io import MPI_TYPES, FileIO
from .launch import abort_world
from .requests import Pending, Planned
from .watchdog import WATCHDOG, resolve_timeout

__all__ = ["CollectiveError", "Comm", "Pending", "Planned"]

_RS, _AG, _AR, _BC, _A2A = (
    OP_CODE[op] for op in ("reduce_scatter", "allgatherv", "allreduce", "bcast", "alltoallv")
)


def _mpi_type(array: np.ndarray) -> MPI.Datatype:
    mpi_type = MPI_TYPES.get(array.dtype)
    if mpi_type is None:
        raise TypeError(
            f"no MPI type for {array.dtype}: 16-bit floats are moved as uint16 (_wire) "
            "and never summed by MPI"
        )
    return mpi_type


def _wire(array: np.ndarray) -> np.ndarray:
    """``array`` as MPI moves it: a 16-bit float (bfloat16 has no MPI type) as uint16."""
    return array.view(np.uint16) if array.dtype.itemsize == 2 else array


class Comm(FileIO, Agreement):
    """The communicator zerompi runs on, with the collectives it needs.

    ``timeout``: seconds any one wait may take before the watchdog ends the job
    (``None``: ``$ZEROMPI_TIMEOUT`` or its default; ``0``/``"none"``: never). The
    node's heartbeat for the watchdog's report is set up by
    :func:`zerompi.mpi.nodes.enable_heartbeat`."""

    def __init__(self, comm: MPI.Intracomm | None = None, *, timeout: object = None) -> None:
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
        #: The data-path collectives started since the last step's agreement.
        self.fingerprint = Fingerprint()
        #: Collective calls made (data path and small ones): the watchdog's "call #".
        self.seq = 0
        #: The optimizer's step being worked on (for the watchdog's report).
        self.step = 0
        #: Names a bucket number in reports (the optimizer sets it).
        self.describe: Callable[[int], str] = lambda tag: f"bucket {tag}"
        #: Seconds one wait may take (None: no watchdog); see :mod:`.watchdog`.
        self.timeout = resolve_timeout(timeout)
        #: This node's heartbeat (:func:`zerompi.mpi.nodes.enable_heartbeat`), for
        #: the watchdog's report.
        self.heartbeat: Any = None
        #: Of the traffic, the bytes that cross a node boundary, per op (same shape as
        #: :attr:`traffic`), booked on the communicator that reports them
        #: (:func:`.nodes.nodes_of`: the parent of a cross-node communicator).
        self.between: dict[str, list[int]] = {}
        self.books: Comm = self
        #: Per rank, whether it is on another node than this one (``None``: all on
        #: this node; :func:`.nodes.nodes_of`).
        self.offnode: list[bool] | None = None

    def _count(self, op: str, sent: int, received: int, between: tuple[int, int] = (0, 0)) -> None:
        entry = self.traffic.setdefault(op, [0, 0])
        entry[0] += sent
        entry[1] += received
        if between[0] or between[1]:
            self.book_between(op, between)

    def book_between(self, op: str, between: tuple[int, int]) -> None:
        """Book ``(sent, received)`` bytes of ``op`` that crossed a node boundary, on
        the communicator that reports them (a cross-node communicator's parent)."""
        entry = self.books.between.get(op)
        if entry is None:
            entry = self.books.between[op] = [0, 0]
        entry[0] += between[0]
        entry[1] += between[1]

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Traffic inside the block is not booked (gathers for a checkpoint, a load:
        not training traffic)."""
        saved = self.traffic, self.between
        self.traffic, self.between = {}, {}
        try:
            yield
        finally:
            self.traffic, self.between = saved

    def pop_traffic(self) -> dict[str, dict[str, int]]:
        """``{op: {"sent": bytes, "received": bytes, "sent_between": bytes,
        "received_between": bytes}}`` since the last call, and reset: what must leave
        and reach this rank per collective, and (``_between``) of it what crosses a
        node boundary (over a hierarchy, the cross-node step's bytes)."""
        out: dict[str, dict[str, int]] = {}
        for op in {**self.traffic, **self.between}:
            s, r = self.traffic.get(op, (0, 0))
            bs, br = self.between.get(op, (0, 0))
            out[op] = {"sent": s, "received": r, "sent_between": bs, "received_between": br}
        self.traffic, self.between = {}, {}
        return out

    def _start(self, code: int, tag: int, count: int) -> None:
        """Record a data-path collective in the fingerprint (its call number ``seq``
        is counted where it waits or starts: :meth:`_blocking`, a start)."""
        self.fingerprint.record(code, tag, count)

    def _blocking(self, op: str, tag: int, call: Callable[[], Any]) -> Any:
        """Run one blocking MPI call under the watchdog."""
        self.seq += 1
        WATCHDOG.enter(self, op, self.seq, tag)
        try:
            return call()
        finally:
            WATCHDOG.leave()

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

    def _count_allreduce(self, nbytes: int) -> None:
        """Book an allreduce of ``nbytes`` as a reduce-scatter plus an allgather."""
        volume = 2 * nbytes * (self.size - 1) // self.size if self.size > 1 else 0
        far = 2 * nbytes * sum(self.offnode) // self.size if self.offnode else 0
        self._count("allreduce", volume, volume, (far, far))

    def count_reduce_scatter(self, total: int, mine: int, itemsize: int) -> None:
        """Book a reduce-scatter done without MPI (through node shared memory)."""
        self._count("reduce_scatter", (total - mine) * itemsize, (self.size - 1) * mine * itemsize)

    def count_allgather(self, total: int, mine: int, itemsize: int) -> None:
        """Book an allgather done without MPI (through node shared memory)."""
        self._count("allgather", (self.size - 1) * mine * itemsize, (total - mine) * itemsize)

    def reduce_scatter_inplace(
        self, buf: np.ndarray, counts: Sequence[int], tag: int = -1
    ) -> np.ndarray:
        """Sum ``buf`` over ranks and scatter it: rank r receives elements
        ``[displs[r], displs[r] + counts[r])`` of the sum, written to the *top* of
        its own ``buf`` (MPI_IN_PLACE). Returns that view, ``buf[:counts[rank]]``."""
        return self.ireduce_scatter(buf, counts, tag=tag).wait()

    def allgatherv_inplace(
        self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int], tag: int = -1
    ) -> None:
        """Every rank contributes ``buf[displs[r]:displs[r]+counts[r]]`` and receives
        everyone's slice into the same buffer (MPI_IN_PLACE)."""
        self.plan_allgatherv(buf, counts, displs, tag).run()  # one path: checks, books

    def plan_reduce_scatter(
        self, buf: np.ndarray, counts: Sequence[int], out: np.ndarray | None = None,
        tag: int = -1,
    ) -> Planned:  # fmt: skip
        """A reduce-scatter of ``buf`` checked and prepared once, started any number of
        times (:meth:`Planned.start`): per start only the MPI call and the books.
        Without ``out`` the shard lands at the top of ``buf`` (MPI_IN_PLACE); with
        ``out`` (``counts[rank]`` elements, not overlapping ``buf``) it lands there,
        which saves a copy."""
        if sum(counts) != buf.shape[0]:
            raise ValueError(f"counts {list(counts)} do not sum to the {buf.shape[0]} elements")
        mine = counts[self.rank]
        mpi_type, recvcounts = _mpi_type(buf), list(counts)
        if out is None:
            out = buf[:mine]
            send: Any = MPI.IN_PLACE
            recv: Any = [buf, mpi_type]
        else:
            if out.shape != (mine,) or out.dtype != buf.dtype:
                raise ValueError(
                    f"out must be {mine} elements of {buf.dtype}, got {out.shape} {out.dtype}"
                )
            send, recv = [buf, mpi_type], [out, mpi_type]
        size = buf.itemsize
        return Planned(
            self, "reduce_scatter", _RS, tag, buf.shape[0], out,
            lambda: self.mpi.Ireduce_scatter(send, recv, recvcounts=recvcounts, op=MPI.SUM),
            (buf.shape[0] - mine) * size, (self.size - 1) * mine * size,
            between=between_volume(self, "reduce_scatter", counts, size),
        )  # fmt: skip

    def plan_allgatherv(
        self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int], tag: int = -1,
        send: np.ndarray | None = None,
    ) -> Planned:  # fmt: skip
        """An allgatherv into ``buf`` checked and prepared once (see
        :meth:`plan_reduce_scatter`): in place, or from ``send`` (this rank's
        ``counts[rank]`` elements, kept elsewhere: MPI copies them in, which saves the
        caller a copy per call)."""
        self._check_fits(buf, counts, displs)
        mine, size = counts[self.rank], buf.itemsize
        source: Any = MPI.IN_PLACE
        if send is not None:
            if send.shape != (mine,) or send.dtype != buf.dtype or not send.flags.c_contiguous:
                raise ValueError(
                    f"send must be {mine} contiguous elements of {buf.dtype}, got "
                    f"{send.shape} {send.dtype}"
                )
            send = _wire(send)
            source = [send, _mpi_type(send)]
        buf = _wire(buf)
        spec = [buf, list(counts), list(displs), _mpi_type(buf)]
        return Planned(
            self, "allgatherv", _AG, tag, buf.shape[0], buf,
            lambda: self.mpi.Iallgatherv(source, spec),
            (self.size - 1) * mine * size, (sum(counts) - mine) * size,
            lambda: self.mpi.Allgatherv(source, spec),
            between=between_volume(self, "allgatherv", counts, size),
        )  # fmt: skip

    def plan_alltoallv(
        self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int],
        recv: np.ndarray, tag: int = -1,
    ) -> Planned:  # fmt: skip
        """The first half of a reduction that MPI must not sum (16-bit gradients):
        rank ``r`` receives part ``r`` (``counts[r]`` elements at ``displs[r]`` of
        ``buf``) of every rank's ``buf``, rank ``q``'s at ``recv[q * counts[r]:]``;
        the caller sums them in a wider dtype. Prepared once, started per bucket;
        recorded as an alltoallv, its bytes counted as the reduction's."""
        self._check_fits(buf, counts, displs)
        mine = counts[self.rank]
        if recv.shape[0] < self.size * mine or recv.dtype != buf.dtype:
            raise ValueError(
                f"recv must hold {self.size} x {mine} elements of {buf.dtype}, got "
                f"{recv.shape} {recv.dtype}"
            )
        typed, buf, recv = recv, _wire(buf), _wire(recv)
        mpi_type, size = _mpi_type(buf), buf.itemsize
        send_spec = [buf, list(counts), list(displs), mpi_type]
        recv_spec = [recv, [mine] * self.size, [q * mine for q in range(self.size)], mpi_type]
        return Planned(
            self, "alltoallv", _A2A, tag, buf.shape[0], typed,
            lambda: self.mpi.Ialltoallv(send_spec, recv_spec),
            (buf.shape[0] - mine) * size, (self.size - 1) * mine * size,
            key="reduce_scatter", between=between_volume(self, "reduce_scatter", counts, size),
        )  # fmt: skip

    def ireduce_scatter(
        self, buf: np.ndarray, counts: Sequence[int], out: np.ndarray | None = None,
        tag: int = -1,
    ) -> Pending:  # fmt: skip
        """Start :meth:`reduce_scatter_inplace` of ``buf`` (``out``: see
        :meth:`plan_reduce_scatter`). ``Pending.wait()`` returns the shard. Neither
        buffer may be touched until then."""
        return self.plan_reduce_scatter(buf, counts, out, tag).start()

    def iallgatherv(
        self, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int], tag: int = -1
    ) -> Pending:
        """Start :meth:`allgatherv_inplace`; ``buf`` is complete after ``wait()``."""
        return self.plan_allgatherv(buf, counts, displs, tag).start()

    def iallreduce(self, buf: np.ndarray, tag: int = -1) -> Pending:
        """Start :meth:`allreduce_inplace`; ``buf`` holds the sum after ``wait()``."""
        self._start(_AR, tag, buf.shape[0])
        self.seq += 1
        seq = self.seq
        request = self.mpi.Iallreduce(MPI.IN_PLACE, [buf, _mpi_type(buf)], op=MPI.SUM)
        self._count_allreduce(buf.nbytes)
        return Pending(request, buf, self, "allreduce", seq, tag)

    def allreduce_inplace(self, buf: np.ndarray, tag: int = -1) -> None:
        """Sum ``buf`` over ranks, in place, on every rank (plain data parallelism).
        Counted as a reduce-scatter plus an allgather of equal shards."""
        self._start(_AR, tag, buf.shape[0])
        self._blocking(
            "allreduce", tag,
            lambda: self.mpi.Allreduce(MPI.IN_PLACE, [buf, _mpi_type(buf)], op=MPI.SUM),
        )  # fmt: skip
        self._count_allreduce(buf.nbytes)

    def bcast_inplace(self, buf: np.ndarray, root: int = 0, tag: int = -1) -> None:
        """Overwrite ``buf`` (C-contiguous, any dtype: integer and boolean buffers of
        torch modules too) on every rank with root's contents, moved as bytes."""
        if not buf.flags.c_contiguous:
            raise ValueError("bcast_inplace needs a C-contiguous array (a copy would not be "
                             "written back)")  # fmt: skip
        self._start(_BC, tag, buf.size)
        raw = buf.reshape(-1).view(np.uint8)
        self._blocking("bcast", tag, lambda: self.mpi.Bcast([raw, MPI.BYTE], root=root))

    def record_shared(self, op: str, tag: int, count: int) -> None:
        """Record a collective done through shared memory (:mod:`.shm`) in the
        fingerprint, as the MPI collective it replaces."""
        self._start(OP_CODE[op], tag, count)

    def progress(self, pending: Sequence[Pending]) -> None:
        """Let the MPI library advance started collectives without waiting for them.
        Without an asynchronous progress thread, MPI moves data only inside MPI calls:
        the engine calls this between blocks of other work."""
        if pending:
            MPI.Request.Testall([p.request for p in pending])

    def wait_all(self, pending: Sequence[Pending]) -> None:
        """Complete every started collective in ``pending``."""
        if pending:
            first = pending[0]
            WATCHDOG.enter(self, first.op, first.seq, first.tag)
            try:
                MPI.Request.Waitall([p.request for p in pending])
            finally:
                WATCHDOG.leave()

    def fence(self) -> None:
        """Collective: every rank's writes to shared memory before the call are
        visible to every rank after it, and every rank's reads before it are done."""
        self._blocking("fence", -1, self.mpi.Barrier)

    # -- small collectives -----------------------------------------------------

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's (small, picklable) ``obj``, in rank order. Pickled here and
        moved with buffer collectives, which release the GIL while they wait (mpi4py's
        pickle-based collectives may not), so the watchdog thread can still run."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.size, np.int64)
        mine = np.array([data.shape[0]], np.int64)
        self._blocking("allgather", -1,
                       lambda: self.mpi.Allgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]))
        displs = np.zeros(self.size, np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        out = np.empty(int(sizes.sum()), np.uint8)
        self._blocking(
            "allgather", -1,
            lambda: self.mpi.Allgatherv(
                [data, MPI.BYTE], [out, sizes.tolist(), displs.tolist(), MPI.BYTE]
            ),
        )  # fmt: skip
        return [pickle.loads(out[d : d + s].tobytes()) for d, s in zip(displs, sizes, strict=True)]

    def _reduce_scalar(self, value: float, op: MPI.Op) -> float:
        send = np.array([value], np.float64)
        out = np.empty(1, np.float64)
        self._blocking(
            "allreduce", -1,
            lambda: self.mpi.Allreduce([send, MPI.DOUBLE], [out, MPI.DOUBLE], op=op),
        )
        result = float(out[0])
        return int(result) if isinstance(value, (int, np.integer)) else result

    def max(self, value: float) -> float:
        """Maximum of a scalar over ranks."""
        return self._reduce_scalar(value, MPI.MAX)

    def sum(self, value: float) -> float:
        """Sum of a scalar over ranks."""
        return self._reduce_scalar(value, MPI.SUM)

    def sum_inplace(self, buf: np.ndarray) -> None:
        """Collective: the elementwise sum of a small array (float32 or float64) over
        ranks, in place on every rank; a control message (statistics of a few numbers
        per matrix row or column, per parameter), not counted as data-path traffic."""
        self._small_inplace(buf, MPI.SUM)

    def exchange(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:  # fmt: skip
        """Collective: an ``Alltoallv`` of float32 or float64 elements with exact
        counts: ``send`` holds what goes to each rank in rank order (``send_counts``),
        ``recv`` receives what each rank sends here, in rank order (``recv_counts``).
        Counted as data-path traffic ("alltoallv"), recorded in the fingerprint without
        a count (the counts differ between ranks by design)."""
        sd = np.zeros(len(send_counts), np.int64)
        rd = np.zeros(len(recv_counts), np.int64)
        np.cumsum(send_counts[:-1], out=sd[1:])
        np.cumsum(recv_counts[:-1], out=rd[1:])
        mpi_type = _mpi_type(send)
        self._start(_A2A, -1, 0)
        self._blocking(
            "alltoallv", -1,
            lambda: self.mpi.Alltoallv([send, list(send_counts), sd.tolist(), mpi_type],
                                       [recv, list(recv_counts), rd.tolist(), mpi_type]),
        )  # fmt: skip
        size = send.itemsize
        self._count("alltoallv", (sum(send_counts) - send_counts[self.rank]) * size,
                    (sum(recv_counts) - recv_counts[self.rank]) * size)  # fmt: skip

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Collective: overwrite ``buf`` (C-contiguous float32 or float64) on every rank
        with ``root``'s. Counted as data-path traffic ("bcast": root sends it to every
        other rank, each of them receives it once), recorded in the fingerprint with
        its count."""
        if not buf.flags.c_contiguous:
            raise ValueError("broadcast needs a C-contiguous array")
        mpi_type = _mpi_type(buf)
        self._start(_BC, -1, buf.size)
        self._blocking("bcast", -1, lambda: self.mpi.Bcast([buf, mpi_type], root=root))
        nbytes = buf.nbytes
        self._count("bcast", nbytes * (self.size - 1) if self.rank == root else 0,
                    0 if self.rank == root else nbytes)  # fmt: skip

    def max_inplace(self, buf: np.ndarray) -> None:
        """Collective: the elementwise maximum of a small array (float32 or float64)
        over ranks, in place on every rank. A control message (the scales of the
        8-bit blocks that ranks share, a few numbers per part), not counted as
        data-path traffic. A maximum is exact: every rank gets the same bits."""
        self._small_inplace(buf, MPI.MAX)

    def _small_inplace(self, buf: np.ndarray, op: MPI.Op) -> None:
        self._blocking(
            "allreduce", -1,
            lambda: self.mpi.Allreduce(MPI.IN_PLACE, [buf, _mpi_type(buf)], op=op),
        )  # fmt: skip

    def allgather_float64(self, values: np.ndarray, op: str = "allgather") -> np.ndarray:
        """Collective: every rank's small 1-D ``float64`` array, stacked in rank order
        as a new ``(size, len(values))`` array, identical on every rank. Summing its
        rows in order gives every rank bit-identical totals, which an ``Allreduce``
        does not promise. A control message (a few numbers per step, such as gradient
        statistics), not counted as data-path traffic."""
        send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        out = np.empty((self.size, send.shape[0]), dtype=np.float64)
        self._blocking(op, -1, lambda: self.mpi.Allgather([send, MPI.DOUBLE], [out, MPI.DOUBLE]))
        return out

    def barrier(self) -> None:
        self._blocking("barrier", -1, self.mpi.Barrier)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Collective: ``root``'s (picklable) ``obj`` on every rank. Pickled on root
        only and moved with buffer broadcasts (as :meth:`allgather`: the GIL is
        released while waiting); an object root cannot pickle raises on every rank."""
        if self.rank == root:
            try:
                message = pickle.dumps((True, obj), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # every rank must hear of it, not wait
                message = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
            data = np.frombuffer(message, np.uint8)
        size = np.array([data.shape[0] if self.rank == root else 0], np.int64)
        self._blocking("bcast", -1, lambda: self.mpi.Bcast([size, MPI.INT64_T], root=root))
        if self.rank != root:
            data = np.empty(int(size[0]), np.uint8)
        self._blocking("bcast", -1, lambda: self.mpi.Bcast([data, MPI.BYTE], root=root))
        ok, value = pickle.loads(data.tobytes())
        if not ok:
            raise CollectiveError(f"bcast_object: rank {root} could not pickle the object: {value}")
        return value

    def sum_uint64(self, values: np.ndarray) -> np.ndarray:
        """Collective: elementwise sum of a small ``uint64`` array over ranks, modulo
        2**64 (unsigned overflow wraps), returned as a new array on every rank."""
        send = np.ascontiguousarray(values, dtype=np.uint64)
        out = np.empty_like(send)
        self._blocking(
            "allreduce", -1,
            lambda: self.mpi.Allreduce([send, MPI.UINT64_T], [out, MPI.UINT64_T], op=MPI.SUM),
        )  # fmt: skip
        return out

    @staticmethod
    def abort(code: int = 1) -> None:
        """End every process of the job (all of COMM_WORLD), not just this
        communicator: the only safe exit when this rank cannot continue."""
        abort_world(code)


def between_volume(comm: Comm, op: str, counts: Sequence[int], itemsize: int) -> tuple[int, int]:
    """``(sent, received)`` bytes of a collective of ``comm`` with per-rank ``counts``
    that cross a node boundary (``comm.offnode``), algorithm-independent (each rank
    exchanging directly with the ranks it must): ``op`` is ``"reduce_scatter"`` (or
    its alltoallv) or ``"allgatherv"``."""
    off = comm.offnode
    if off is None:
        return 0, 0
    mine, far = counts[comm.rank], sum(off)
    theirs = sum(c for c, o in zip(counts, off, strict=True) if o)
    if op == "allgatherv":
        return far * mine * itemsize, theirs * itemsize
    return theirs * itemsize, far * mine * itemsize
