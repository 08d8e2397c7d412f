"""Test harness that cannot hang under mpiexec.

The same suite runs serially (``pytest``) and on every rank under
``mpiexec -n W python -m pytest --with-mpi``. Three rules keep a failure on one rank
from leaving the others blocked in a collective:

* assertions that may differ between ranks go through :func:`helpers.assert_all`,
  which agrees on the verdict over ``COMM_WORLD`` so every rank fails together;
* any other failure on any rank aborts the whole world at once (below);
* pytest-timeout (thread method, see pyproject.toml) ends a stuck test, and
  ``scripts/test`` puts a timeout around each mpiexec.

Under mpiexec only rank 0 reports (progress, failures, summary). The other ranks'
terminal reporters write to memory; a rank prints its report at the end only if it
saw a failure that rank 0's report does not already show (a collective failure is
the same on every rank, and ``assert_all`` names every rank's message): so one
progress stream and one summary per run, and every failure still visible.

Collective tests take the ``comm`` fixture: like mpi4py's own suite they run on
several communicators carved out of the world (the world itself, ``COMM_SELF``, a
split into unequal groups, the world in reverse rank order), so a single
``mpiexec -n 4`` exercises world sizes 1 to 4 and uneven layouts. Only those that
differ run: in a world of one all four are that one rank (the serial run takes
"world" alone), and under mpiexec "split" already puts the last rank alone in a
communicator of its own inside a larger world, what "self" would check, while the
serial run is the world of one (so "self" runs in neither).
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Iterator

import pytest
from helpers import RUN_COMMS, CollectiveAssertionError
from hypothesis import HealthCheck, settings
from mpi4py import MPI

import zerompi

WORLD = MPI.COMM_WORLD

# The suite's subprocesses (mpiexec'd scripts, the driver, the benchmark) must run the
# zerompi under test, not whatever this Python's site-packages point at: a script in
# tests/ does not see the working directory, and an editable install left over from
# another checkout would be found instead (or nothing at all).
_UNDER_TEST = os.path.dirname(os.path.dirname(os.path.abspath(zerompi.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_UNDER_TEST, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

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


#: This rank's report when it is not rank 0 of a multi-rank world (else ``None``).
_QUIET: io.StringIO | None = None
#: Failures of this rank that rank 0's report may not show (collection errors, ...).
_OWN_FAILURES: list[str] = []
_COLLECTIVE_FAILURES: list[str] = []


@pytest.hookimpl(trylast=True)  # after the terminal plugin has made its reporter
def pytest_configure(config: pytest.Config) -> None:
    global _QUIET
    if WORLD.size == 1 or WORLD.rank == 0:
        return
    standard = config.pluginmanager.getplugin("terminalreporter")
    if standard is None:  # -p no:terminal
        return
    loud = config.get_terminal_writer()  # the standard reporter's, on stdout
    _QUIET = io.StringIO()
    config.pluginmanager.unregister(standard)
    config.pluginmanager.register(pytest.TerminalReporter(config, _QUIET), "terminalreporter")
    # What is written through the config's writer rather than the reporter still shows:
    # pytest-timeout's stack dump before it ends the process (os._exit: no report after).
    config.get_terminal_writer = lambda: loud  # type: ignore[method-assign]


def pytest_report_header(config: pytest.Config) -> str | None:
    if WORLD.size == 1:
        return None
    return (
        f"mpi: rank 0 of {WORLD.size} reports; the other ranks print only failures "
        "that this report does not show"
    )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _OWN_FAILURES.append(report.nodeid or "collection")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or WORLD.size == 1:
        return
    if call.excinfo is not None and call.excinfo.errisinstance(CollectiveAssertionError):
        _COLLECTIVE_FAILURES.append(item.nodeid)
        return  # every rank reached the same verdict together; carry on
    # A failure that the other ranks may not share: they could be waiting in a
    # collective for this one. End the world now rather than hang, showing the failure
    # as pytest would (the test's frames, not pytest's own).
    sys.stderr.write(
        f"\n[rank {WORLD.rank}] {item.nodeid} failed ({report.when}) on this rank only; "
        f"aborting the world\n{report.longreprtext}\n"
    )
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.5)  # let the launcher forward what this rank printed before the kill
    WORLD.Abort(1)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A rank other than 0 shows its report if it failed in a way rank 0's report does
    not show; one line if it only shares rank 0's collective failures."""
    if _QUIET is None:
        return
    prefix = f"[rank {WORLD.rank} of {WORLD.size}]"
    if _OWN_FAILURES:
        text = _QUIET.getvalue()
        sys.stdout.write(
            f"\n{prefix} failed on its own ({', '.join(_OWN_FAILURES)}): its report follows\n"
            + "".join(f"{prefix} {line}\n" for line in text.splitlines())
        )
    elif _COLLECTIVE_FAILURES:
        sys.stdout.write(
            f"{prefix} {len(_COLLECTIVE_FAILURES)} collective failure(s), the same as "
            "rank 0 reports\n"
        )
    sys.stdout.flush()


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


@pytest.fixture(params=RUN_COMMS)
def comm(request: pytest.FixtureRequest) -> MPI.Intracomm:
    """A communicator to run a collective test on (see module docstring), the same on
    every rank; one a test names (``indirect``) that repeats another in this world is
    skipped alike on every rank."""
    if request.param not in RUN_COMMS:
        pytest.skip("the same as another communicator in this world (helpers.RUN_COMMS)")
    return _communicators()[request.param]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for name, c in _COMMS.items():
        if name in ("split", "reversed"):
            c.Free()
    _COMMS.clear()


#: What MPI libraries leave in /dev/shm when a job is aborted or killed (MPICH's
#: mpich_shm_*, Open MPI's sm_segment.*): the harness, failure and watchdog tests
#: abort jobs on purpose, about 90 MiB per suite run, enough to fill the 64 MiB
#: /dev/shm of a typical container and stop later jobs from starting.
_LEAKS = ("mpich_shm_", "sm_segment.")


def _shm_leftovers() -> set[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    uid = os.getuid()
    out = set()
    for name in names:
        if name.startswith(_LEAKS):
            try:
                if os.stat(os.path.join("/dev/shm", name)).st_uid == uid:
                    out.add(name)
            except OSError:
                pass
    return out


@pytest.fixture(autouse=True)
def _no_shared_memory_left_behind() -> Iterator[None]:
    """In a one-process run (where the subprocess jobs run, one at a time), remove
    the MPI libraries' shared-memory files that appeared during a test: its jobs have
    ended, so nothing uses them. Never under mpiexec, where the other ranks' are live.
    (Another MPI job of this user starting during the same test would lose its files'
    names: run the suite alone, as CI does.)"""
    if MPI.COMM_WORLD.Get_size() > 1:
        yield
        return
    before = _shm_leftovers()
    yield
    for name in _shm_leftovers() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
