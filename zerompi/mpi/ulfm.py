"""User-level failure mitigation (ULFM): what zerompi needs to survive a lost rank.

MPI-4's fault-tolerance proposal, built into Open MPI 5 (``ompi_info``: "FT MPI
support: yes") and enabled per job by its launcher, ``mpiexec --with-ft ulfm``.
Then an operation whose peer died returns ``MPI_ERR_PROC_FAILED`` instead of
hanging, and the survivors can

* :func:`revoke` a communicator: every pending and future operation on it, on every
  rank, fails with ``MPI_ERR_REVOKED`` (so a rank that did not notice the failure is
  woken from its collective);
* :func:`shrink` it to a new communicator of the survivors;
* :func:`agree` on a flag (a fault-tolerant AND over the survivors).

Plus the point-to-point and ``Alltoallv`` moves of in-memory snapshots
(:mod:`zerompi.elastic`), which live here because every MPI call does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:
    from .collectives import Comm

#: Error classes of a failed peer (``ERR_PROC_FAILED``, its ``_PENDING`` form for a
#: receive from any source) and of a revoked communicator.
FAILURE_CLASSES = frozenset(
    getattr(MPI, name)
    for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    if hasattr(MPI, name)
)

#: How to enable ULFM, for error messages.
HOW = "Open MPI 5 launched with `mpiexec --with-ft ulfm` (see slurm/README.md)"


def unavailable() -> str | None:
    """Why this process cannot survive a lost rank (``None``: it can): the MPI library
    must be Open MPI with ULFM, and the job launched with fault tolerance on (the
    launcher sets ``OMPI_MCA_mpi_ft_enable``; without it a failure kills the job)."""
    library = MPI.Get_library_version().splitlines()[0].strip()
    if "Open MPI" not in library or not hasattr(MPI.Comm, "Revoke"):
        return f"elastic=True needs ULFM, which this MPI library lacks ({library}); use {HOW}"
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
        return (
            "elastic=True needs fault tolerance enabled by the launcher, and this job was "
            f"launched without it (OMPI_MCA_mpi_ft_enable is not set); use {HOW}"
        )
    return None


def prepare(comm: Comm) -> None:
    """Errors on ``comm`` are returned (raised as ``MPI.Exception``), never fatal."""
    comm.mpi.Set_errhandler(MPI.ERRORS_RETURN)


def is_failure(exc: BaseException, comms: Sequence[Comm] = ()) -> bool:
    """Whether ``exc`` is MPI reporting a failed peer or a revoked communicator; or
    ``MPI_ERR_IN_STATUS``, what a wait on several requests (zerompi's buckets in
    flight) reports for them, a failed peer under ULFM; or ``MPI_ERR_OTHER`` while
    ULFM knows of a failure on one of ``comms`` (:func:`failure_known`): Open MPI's
    nonblocking collectives (libnbc) abort their schedule on a failed peer (error 75)
    or a revoked communicator (77) and the wait then reports only ``MPI_ERR_OTHER``
    (seen with stage 2, ``overlap=False``, small buckets, a rank killed mid-step)."""
    if not isinstance(exc, MPI.Exception):
        return False
    kind = exc.Get_error_class()
    if kind in FAILURE_CLASSES or kind == MPI.ERR_IN_STATUS:
        return True
    return kind == MPI.ERR_OTHER and any(failure_known(c) for c in comms)


def failure_known(comm: Comm) -> bool:
    """Whether ULFM knows that ``comm`` lost a process or was revoked (local
    knowledge, no communication); ``False`` where the library cannot say."""
    mpi = comm.mpi
    if mpi == MPI.COMM_NULL or not hasattr(mpi, "Get_failed"):
        return False
    try:
        if mpi.Is_revoked():
            return True
        failed = mpi.Get_failed()
        try:
            return failed.Get_size() > 0
        finally:
            if failed != MPI.GROUP_EMPTY:  # (a predefined handle must not be freed)
                failed.Free()
    except (MPI.Exception, NotImplementedError):
        return False


def revoke(comms: Sequence[Comm | None]) -> None:
    """Revoke every communicator of ``comms`` (already revoked ones are fine)."""
    for comm in comms:
        if comm is None or comm.mpi == MPI.COMM_NULL:
            continue
        try:
            comm.mpi.Revoke()
        except MPI.Exception:  # revoked already, or this one is gone: nothing to wake
            pass


def shrink(comm: Comm) -> MPI.Intracomm:
    """Collective over the survivors: a new communicator of the living ranks of the
    (revoked) ``comm``, in their old order, returning errors."""
    new = comm.mpi.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new


def agree(comm: Comm, flag: int) -> int:
    """Collective, fault tolerant: the bitwise AND of every living rank's ``flag``."""
    return int(comm.mpi.Agree(int(flag)))


# -- snapshot traffic --------------------------------------------------------------


class Exchange:
    """One snapshot's point-to-point messages: this rank's pieces to its buddy and its
    source's pieces into a receive buffer, all on one tag (MPI keeps the order of
    messages between two ranks on one tag, so pieces match by position)."""

    TAG = 7301

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.requests: list[MPI.Request] = []
        self.received: list[MPI.Request] = []

    def start(
        self, sends: Sequence[np.ndarray], dest: int, recvs: Sequence[np.ndarray], source: int
    ) -> None:
        """Post the receives, then the sends (empty pieces are skipped on both sides
        alike). The send buffers must stay unchanged until :meth:`wait`."""
        mpi, tag = self.comm.mpi, self.TAG
        self.received = [mpi.Irecv(r, source=source, tag=tag) for r in recvs if r.nbytes]
        sent = [mpi.Isend(s, dest=dest, tag=tag) for s in sends if s.nbytes]
        self.requests = self.received + sent
        nbytes = sum(s.nbytes for s in sends)
        self.comm._count("snapshot", nbytes, sum(r.nbytes for r in recvs))

    def received_all(self) -> bool:
        """Whether every receive has completed (no wait; false after an error)."""
        try:
            return bool(MPI.Request.Testall(self.received)) if self.received else True
        except MPI.Exception:
            return False

    def test(self) -> None:
        """Advance the messages without waiting (MPI moves data inside MPI calls)."""
        if self.requests:
            MPI.Request.Testall(self.requests)

    def wait(self) -> None:
        """Complete every message (under the watchdog)."""
        if self.requests:
            requests = self.requests

            def wait() -> None:  # one by one: Waitall would hide the error class
                for request in requests:
                    request.Wait()

            self.comm._blocking("snapshot", -1, wait)
            self.requests = self.received = []


def alltoallv_bytes(
    comm: Comm, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
    recv_counts: Sequence[int],
) -> None:  # fmt: skip
    """Collective: ``send`` (bytes, per destination rank in rank order, exact counts)
    to every rank; ``recv`` gets every source's bytes in rank order. Not recorded in
    the step's fingerprint: the counts differ between ranks by design (a re-shard)."""
    sd = np.zeros(len(send_counts), np.int64)
    rd = np.zeros(len(recv_counts), np.int64)
    np.cumsum(send_counts[:-1], out=sd[1:])
    np.cumsum(recv_counts[:-1], out=rd[1:])
    comm._blocking(
        "alltoallv", -1,
        lambda: comm.mpi.Alltoallv(
            [send, list(send_counts), sd.tolist(), MPI.BYTE],
            [recv, list(recv_counts), rd.tolist(), MPI.BYTE],
        ),
    )  # fmt: skip
