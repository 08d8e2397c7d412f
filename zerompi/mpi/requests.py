"""Started collectives: :class:`Pending` (one in flight, and the array it delivers)
and :class:`Planned` (a collective prepared once, started many times).

Waiting on either goes through the :data:`WATCHDOG`; starting a planned one records
it in the communicator's fingerprint and traffic books.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from mpi4py import MPI

from .agreement import Fingerprint, token
from .watchdog import WATCHDOG


class Comm(Protocol):
    """What a started collective needs of its communicator (a
    :class:`zerompi.mpi.collectives.Comm`; a protocol here, so that this module, which
    that one imports, does not import it back)."""

    size: int
    timeout: float | None
    seq: int
    fingerprint: Fingerprint
    traffic: dict[str, list[int]]

    def book_between(self, op: str, between: tuple[int, int]) -> None: ...


class Pending:
    """A started nonblocking collective and the array it delivers. MPI owns the
    buffers until :meth:`wait` (or :meth:`zerompi.mpi.collectives.Comm.wait_all`) returns."""

    __slots__ = ("comm", "op", "request", "result", "seq", "tag")

    def __init__(
        self, request: MPI.Request, result: np.ndarray, comm: Comm | None = None,
        op: str = "", seq: int = 0, tag: int = -1,
    ) -> None:  # fmt: skip
        self.request = request
        self.result = result
        self.comm = comm
        self.op = op
        self.seq = seq
        self.tag = tag

    @classmethod
    def done(cls, result: np.ndarray) -> Pending:
        """An already completed collective (one that was run blocking)."""
        return cls(MPI.REQUEST_NULL, result)

    def wait(self) -> np.ndarray:
        """Complete the collective (a no-op once complete) and return its array."""
        comm = self.comm
        if comm is None or comm.timeout is None or comm.size == 1:  # no watchdog
            self.request.Wait()
            return self.result
        WATCHDOG.enter(comm, self.op, self.seq, self.tag)
        try:
            self.request.Wait()
        finally:
            WATCHDOG.leave()
        return self.result

    def test(self) -> bool:
        """Whether it has completed; advances MPI progress."""
        return bool(self.request.Test())


class Planned:
    """A nonblocking collective prepared once (buffers, counts and MPI arguments
    checked and built) and started many times: what the optimizer runs per bucket and
    per layer, so that a start costs the MPI call and the books, nothing more."""

    __slots__ = (
        "between", "blocking", "call", "calldesc", "comm", "key", "op", "pending", "received",
        "sent", "tag", "token",
    )  # fmt: skip

    def __init__(
        self, comm: Comm, op: str, code: int, tag: int, count: int, result: np.ndarray,
        call: Callable[[], MPI.Request], sent: int, received: int,
        blocking: Callable[[], None] | None = None, key: str | None = None,
        between: tuple[int, int] = (0, 0),
    ) -> None:  # fmt: skip
        self.comm, self.op, self.tag, self.call, self.blocking = comm, op, tag, call, blocking
        self.sent, self.received = sent, received
        #: (sent, received) bytes of it that cross a node boundary, or None
        self.between = between if between[0] or between[1] else None
        self.calldesc = (code, tag, count)  # what the fingerprint records
        self.token = token(code, tag, count)
        #: the traffic books' name
        self.key = key or ("allgather" if op == "allgatherv" else op)
        #: One Pending, reused by every start: a planned collective is never started
        #: again while in flight (checked: a started request is not null).
        self.pending = Pending(MPI.REQUEST_NULL, result, comm, op, 0, tag)

    def _books(self) -> int:
        """Record a start in the fingerprint and the traffic; its call number."""
        comm = self.comm
        comm.fingerprint.add(self.calldesc, self.token)
        seq = comm.seq = comm.seq + 1
        entry = comm.traffic.get(self.key)
        if entry is None:
            entry = comm.traffic[self.key] = [0, 0]
        entry[0] += self.sent
        entry[1] += self.received
        if self.between is not None:  # booked where the parent reports it
            comm.book_between(self.key, self.between)
        return seq

    def start(self) -> Pending:
        """Start it: recorded in the fingerprint and the traffic, then handed to MPI."""
        pending = self.pending
        if pending.request:
            raise RuntimeError(f"{self.op} of bucket {self.tag} started while still in flight")
        pending.seq = self._books()
        pending.request = self.call()
        return pending

    def run(self) -> None:
        """Run it to completion: the blocking form of the same collective when one
        was prepared (one MPI call instead of a start and a wait), books as
        :meth:`start`, the wait under the watchdog."""
        blocking = self.blocking
        if blocking is None:
            self.start().wait()
            return
        seq, comm = self._books(), self.comm
        if comm.timeout is None or comm.size == 1:  # what WATCHDOG.enter checks first
            blocking()
            return
        WATCHDOG.enter(comm, self.op, seq, self.tag)
        try:
            blocking()
        finally:
            WATCHDOG.leave()
