"""Test harness that cannot hang under mpiexec.

The same suite runs serially (``pytest``) and on every rank under
``mpiexec -n W python -m pytest --with-mpi``. Three rules keep a failure on one rank
from leaving the others blocked in a collective:

* assertions that may differ between ranks go through :func:`helpers.assert_all`,
  which agrees on the verdict over ``COMM_WORLD`` so every rank fails together;
* any other failure on any rank aborts the whole world at once (below);
* pytest-timeout (thread method, see pyproject.toml) ends a stuck test, and
  ``scripts/test`` puts a timeout around each mpiexec.

Collective tests take the ``comm`` fixture: like mpi4py's own suite they run on
several communicators carved out of the world (the world itself, ``COMM_SELF``, a
split into unequal groups, the world in reverse rank order), so a single
``mpiexec -n 4`` exercises world sizes 1 to 4 and uneven layouts.
"""

from __future__ import annotations

import sys
import time
import traceback

import pytest
from helpers import CollectiveAssertionError
from hypothesis import HealthCheck, settings
from mpi4py import MPI

WORLD = MPI.COMM_WORLD

# Every rank must draw the same examples in the same order, or the collectives
# inside a property test would pair up differently and hang. Timing-based checks
# are off: under oversubscription they would fire on one rank and not another.
settings.register_profile(
    "mpi",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile("mpi")


def pytest_configure(config: pytest.Config) -> None:
    if WORLD.size > 1 and WORLD.rank > 0:
        config.option.verbose = -1  # one readable report, from rank 0; failures everywhere


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or WORLD.size == 1:
        return
    if call.excinfo is not None and call.excinfo.errisinstance(CollectiveAssertionError):
        return  # every rank reached the same verdict together; carry on
    # A failure that the other ranks may not share: they could be waiting in a
    # collective for this one. End the world now rather than hang.
    sys.stderr.write(
        f"\n[rank {WORLD.rank}] {item.nodeid} failed on this rank only; aborting the world\n"
    )
    if call.excinfo is not None:
        sys.stderr.write("".join(traceback.format_exception(call.excinfo.value)))
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.5)  # let the launcher forward what this rank printed before the kill
    WORLD.Abort(1)


_COMMS: dict[str, MPI.Intracomm] = {}


def _communicators() -> dict[str, MPI.Intracomm]:
    """Communicators every rank builds together, in the same order."""
    if not _COMMS:
        size, rank = WORLD.size, WORLD.rank
        _COMMS["world"] = WORLD
        _COMMS["self"] = MPI.COMM_SELF
        # All but the last rank, and the last alone: sizes (W-1, 1).
        _COMMS["split"] = WORLD.Split(int(rank == size - 1) if size > 1 else 0, rank)
        _COMMS["reversed"] = WORLD.Split(0, size - 1 - rank)
    return _COMMS


@pytest.fixture(params=["world", "self", "split", "reversed"])
def comm(request: pytest.FixtureRequest) -> MPI.Intracomm:
    """A communicator to run a collective test on (see module docstring)."""
    return _communicators()[request.param]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for name, c in _COMMS.items():
        if name in ("split", "reversed"):
            c.Free()
    _COMMS.clear()
