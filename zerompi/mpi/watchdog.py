"""Deadlines on every wait inside zerompi, and a diagnosis before the abort.

A fingerprint (:mod:`.agreement`) catches ranks that made *different* collective
calls; it cannot see a collective that some rank never enters: the others then wait
forever. Every blocking MPI call zerompi makes (a collective, the completion of a
nonblocking one, a fence, an MPI-IO call) is bracketed by :meth:`Watchdog.enter` /
:meth:`Watchdog.leave`: one tuple and two attribute writes, a few hundred nanoseconds
(it is on the path of every layer of a stage-3 model). One daemon thread per
process, started by the first wait, wakes every second (every eighth of the
timeout, if shorter), times the waits it sees and mirrors this rank's state into
the node's heartbeat; when a wait has outlived the timeout it prints what this rank
waits in (operation, step, call number, bucket) and, from the node's heartbeat
(:class:`zerompi.mpi.shm.Heartbeat`), which ranks of this node have not arrived and
where they were last seen, then aborts the world. mpi4py
releases the GIL inside MPI calls, so the thread runs while the main thread is
blocked in one (torch's NCCL watchdog is the same idea).

The timeout is ``ZeroOptimizer(timeout=...)``, else the environment variable
``ZEROMPI_TIMEOUT`` (seconds; ``0`` or ``none`` disables), else
:data:`DEFAULT_TIMEOUT`. Only time spent *waiting inside zerompi* counts: a rank
busy in the user's code for an hour trips nothing.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from typing import Any

#: Environment variable with the default timeout in seconds (``0``/``none``: off).
TIMEOUT_ENV = "ZEROMPI_TIMEOUT"
#: Seconds a rank may wait inside one zerompi call: torch's NCCL default.
DEFAULT_TIMEOUT = 600.0
#: What a rank can wait in (the heartbeat stores the index).
OPS = (
    "reduce_scatter", "allgatherv", "allreduce", "bcast", "fence", "allgather",
    "barrier", "step agreement", "file I/O", "split", "alltoallv",
)  # fmt: skip


def resolve_timeout(value: object = None) -> float | None:
    """The timeout in seconds for ``value`` (``None``: ``$ZEROMPI_TIMEOUT``, else
    :data:`DEFAULT_TIMEOUT`); ``None`` when disabled (``0``, ``"0"``, ``"none"``,
    ``"off"``). Raises ``ValueError``/``TypeError`` naming a bad value."""
    where = "timeout"
    if value is None:
        value = os.environ.get(TIMEOUT_ENV, "").strip()
        where = TIMEOUT_ENV
        if value == "":
            return DEFAULT_TIMEOUT
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("none", "off", "0", "0.0"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{where} must be a number of seconds, 0 or 'none', got {value!r:.60}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number of seconds or None, got {value!r:.60}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{where} must be finite and >= 0 seconds, got {value!r}")
    return seconds or None


class Watchdog:
    """The process's watchdog (see the module docstring); use :data:`WATCHDOG`.

    The waiting thread only publishes ``current``, ``(comm, op, seq, tag, step)`` of the
    wait in progress or ``None`` (one tuple, replaced whole, so the thread always
    reads a consistent one), and ``last``, the latest wait's tuple: two attribute
    writes per wait. The thread does the clock work: it times a wait from the poll
    that first sees it (so it fires between ``timeout`` and ``timeout`` + two polls
    after the wait began) and mirrors what it sees into the node's heartbeat."""

    def __init__(self) -> None:
        self.current: tuple[Any, str, int, int, int] | None = None
        self.last: tuple[Any, str, int, int, int] | None = None
        self._thread: threading.Thread | None = None
        self._poll = 1.0
        self._fired = False

    def enter(self, comm: Any, op: str, seq: int, tag: int) -> None:
        """This rank starts waiting in ``op`` (collective call ``seq`` of ``comm``,
        bucket ``tag`` or -1); no-op when ``comm.timeout`` is off or the
        communicator has one rank (nothing to wait for)."""
        timeout = comm.timeout
        if timeout is None or comm.size == 1:
            return
        self.current = self.last = (comm, op, seq, tag, comm.step)
        if self._thread is None or timeout < self._poll * 8:
            self._arm(timeout)  # the first wait starts the thread; a shorter timeout polls faster

    def _arm(self, timeout: float) -> None:
        self._poll = max(0.02, min(1.0, timeout / 8))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zerompi-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.publish)  # a rank that ends within a poll still reports

    def publish(self) -> None:
        """Write this rank's state into the node's heartbeat now (the thread does it
        once per poll; at exit, this shows the others where this rank stopped)."""
        self._mark(self.last, self.current is not None, time.monotonic_ns())

    @staticmethod
    def _mark(last: tuple[Any, str, int, int, int] | None, waiting: bool, now: int) -> None:
        if last is not None and last[0].heartbeat is not None:
            comm, op, seq, _, step = last
            comm.heartbeat.mark(seq, op, step, waiting, now)

    def leave(self) -> None:
        """The wait begun by :meth:`enter` is over."""
        self.current = None

    def _run(self) -> None:
        seen: tuple[Any, str, int, int, int] | None = None  # the latest wait, as last seen
        seen_waiting, since = False, 0
        while True:
            time.sleep(self._poll)
            now = time.monotonic_ns()
            wait, last = self.current, self.last
            if last is not seen or (wait is not None) != seen_waiting:
                seen, seen_waiting, since = last, wait is not None, now  # a new state
                self._mark(last, seen_waiting, now)
            elif (
                wait is not None and not self._fired and wait[0].timeout is not None
                and now - since > wait[0].timeout * 1e9
            ):  # fmt: skip
                self._fired = True
                self._fire(wait, (now - since) / 1e9)

    def _fire(self, wait: tuple[Any, str, int, int, int], waited: float) -> None:
        from .launch import abort_world

        comm, op, seq, tag, step = wait
        what = op + (f" of {comm.describe(tag)}" if tag >= 0 else "")
        lines = [
            f"zerompi watchdog: rank {comm.rank} of {comm.size} has waited {waited:.1f} s "
            f"(timeout {comm.timeout:g} s) in {what}, step {step}, collective call "
            f"#{seq}"
        ]
        if comm.heartbeat is not None:
            lines.extend(comm.heartbeat.report(comm.rank, seq))
        else:
            lines.append(
                "zerompi watchdog: no heartbeat on this communicator: which ranks have not "
                "arrived cannot be told from here (each rank that waits prints its own line)"
            )
        lines.append(
            f"zerompi watchdog: a rank skipped or added a collective call (an `if rank == "
            f"0:` around a collective, an exception caught on one rank, a different number "
            f"of steps); aborting all ranks. Set {TIMEOUT_ENV} (seconds, 0 = off) or "
            "ZeroOptimizer(timeout=...) if waits this long are expected"
        )
        sys.stderr.write("\n".join(lines) + "\n")
        abort_world(1)


#: The process's one watchdog.
WATCHDOG = Watchdog()
