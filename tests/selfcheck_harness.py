"""Deliberately failing tests, run by test_harness.py in a subprocess mpiexec to prove
that a failure on one rank ends the run quickly instead of hanging it. Not collected
by the normal suite (the name does not start with ``test_``)."""

import os

from helpers import assert_all
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
MODE = os.environ.get("ZEROMPI_SELFCHECK", "")


def test_first() -> None:
    if MODE == "local_fail":
        assert WORLD.rank != 1, "rank 1 fails alone"
        WORLD.Barrier()  # the other ranks would wait here forever without the abort
    elif MODE == "collective_fail":
        assert_all(WORLD.rank != 1, "rank 1 fails, every rank reports it")
    elif MODE == "hang":
        if WORLD.rank != 1:
            WORLD.Barrier()  # rank 1 never arrives: only the timeout can end this


def test_second() -> None:
    WORLD.Barrier()
    assert_all(True)
