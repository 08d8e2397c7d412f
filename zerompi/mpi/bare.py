"""Bare collectives: the MPI calls themselves, with none of :class:`Comm`'s wrapping.

:mod:`zerompi.bench` times the optimizer against what the MPI library does at best
on the same bytes. That yardstick must not pay what it is compared against: no
watchdog, no fingerprint, no traffic counting, no argument checks. So these are
single blocking calls, in place, on a 1-D numpy buffer of float32 or float64:

* :func:`reduce_scatter`: ``Reduce_scatter`` with explicit ``recvcounts`` (rank r's
  sum lands at the top of its buffer, as in :meth:`Comm.reduce_scatter_inplace`);
* :func:`allgatherv`: ``Allgatherv`` of every rank's ``[displs[r], +counts[r])``;
* :func:`allreduce`: ``Allreduce`` of the whole buffer.

and :func:`idle_barrier`, a barrier that waits by sleeping (``Ibarrier`` polled with
``Test``), so that waiting ranks leave the cores to the one rank being measured.

Unchecked: a wrong count writes past the buffer. Use :class:`Comm` for anything
that is not a measurement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .collectives import Comm
from .io import MPI_TYPES

__all__ = ["allgatherv", "allreduce", "idle_barrier", "reduce_scatter"]


def reduce_scatter(comm: Comm, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Blocking in-place ``Reduce_scatter`` (sum) of ``buf`` with ``recvcounts``
    ``counts``: this rank's ``counts[rank]`` summed elements end up in
    ``buf[:counts[rank]]``."""
    comm.mpi.Reduce_scatter(
        MPI.IN_PLACE, [buf, MPI_TYPES[buf.dtype]], recvcounts=list(counts), op=MPI.SUM
    )


def allgatherv(
    comm: Comm, buf: np.ndarray, counts: Sequence[int], displs: Sequence[int]
) -> None:
    """Blocking in-place ``Allgatherv``: rank r contributes
    ``buf[displs[r]:displs[r] + counts[r]]``, every rank receives all of them."""
    comm.mpi.Allgatherv(MPI.IN_PLACE, [buf, list(counts), list(displs), MPI_TYPES[buf.dtype]])


def allreduce(comm: Comm, buf: np.ndarray) -> None:
    """Blocking in-place ``Allreduce`` (sum) of the whole ``buf``."""
    comm.mpi.Allreduce(MPI.IN_PLACE, [buf, MPI_TYPES[buf.dtype]], op=MPI.SUM)


def idle_barrier(comm: Comm, poll: float = 0.002) -> None:
    """A barrier that waits by sleeping ``poll`` seconds between tests, not by
    spinning in the MPI progress loop: the ranks that wait leave the cores to a
    rank being measured alone."""
    request = comm.mpi.Ibarrier()
    while not request.Test():
        time.sleep(poll)
