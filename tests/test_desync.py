"""Ranks whose collective calls part ways: never a silent mix, never a silent hang.

Two kinds of desynchronisation, two mechanisms:

* ranks that make *different* calls (different buckets handed over, a different number
  of micro-batches) are caught by the step's agreement, which carries each rank's
  fingerprint of its collective calls: ``CollectiveError`` on every rank, naming the
  first call that differs and the ranks on each side, state untouched. These run
  in-process on every communicator of the suite;
* a collective that some rank never enters (``if rank == 0: opt.step()``) is ended by
  the watchdog: the waiting rank prints what it waits in and which ranks of its node
  have not arrived, then aborts the job. These run as subprocess ``mpiexec`` jobs
  (serial run only) with ``ZEROMPI_TIMEOUT=3``; each must end non-zero within the
  timeout plus a few seconds.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI
from test_failures import run
from test_harness import mpiexec

from zerompi import ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError

HERE = Path(__file__).parent
SCRIPT = HERE / "desync_script.py"
TIMEOUT = 3.0  # ZEROMPI_TIMEOUT of the subprocess jobs
SLACK = 6.0  # seconds past it by which the job must have ended


def _params() -> dict[str, np.ndarray]:
    return {"a.w": np.zeros(4, np.float32), "b.w": np.zeros(4, np.float32)}


def _untouched(opt: ZeroOptimizer) -> bool:
    full = opt.full_params()
    return opt.step_count == 0 and all(not np.any(v) for v in full.values())


def _refused(opt: ZeroOptimizer, match: str) -> tuple[list[str], str]:
    """``opt.step()`` must raise CollectiveError containing ``match`` on this rank and
    leave the state untouched; returns what went wrong and the message (checked
    collectively later: every rank of the world must make the same WORLD calls)."""
    try:
        opt.step()
    except CollectiveError as exc:
        problems = [] if match in str(exc) else [f"{match!r} not in: {exc}"]
        return problems + ([] if _untouched(opt) else ["state changed by a refused step"]), str(
            exc
        )
    return ["step() did not raise"], ""


#: What the refused step says: the first call that differs, both sides.
BOTH_SIDES = re.compile(
    r"rank 0 made reduce_scatter of bucket 0 \[a\.w\] \(4 elements\); "
    r"ranks? [\d, ]+ made reduce_scatter of bucket 1 \[b\.w\]"
)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_different_buckets_handed_over(comm: MPI.Intracomm, stage: int, shared: bool) -> None:
    """Rank 0 hands over ``a``, the others ``b`` (equal sizes: MPI pairs them up):
    the step raises on every rank instead of mixing the gradients, naming the first
    call that differs and the ranks on each side, and the optimizer goes on training
    once the ranks agree again."""
    opt = ZeroOptimizer(_params(), comm=comm, stage=stage, shared_memory=shared, lr=1.0,
                        bucket_elems=4)  # fmt: skip
    problems: list[str] = []
    if comm.size > 1:
        name = "a" if comm.rank == 0 else "b"
        with opt.gradients(name) as g:
            g[f"{name}.w"][...] += 1.0
        problems, message = _refused(opt, "collective calls differ")
        if not BOTH_SIDES.search(message):
            problems.append(f"the message does not name both sides: {message}")
    for name in ("a", "b"):  # agreeing (again): training goes on
        with opt.gradients(name) as g:
            g[f"{name}.w"][...] += 1.0
    opt.step()
    full = opt.full_params()
    if opt.step_count != 1 or not all(np.allclose(v, -1.0) for v in full.values()):
        problems.append(f"after recovery: step {opt.step_count}, {full}")
    opt.close()
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_extra_accumulate_on_one_rank(comm: MPI.Intracomm, stage: int) -> None:
    """One more ``accumulate()`` on rank 0: a clear error on every rank at the step,
    at every stage (no collective of its own, so nothing to hang in)."""
    opt = ZeroOptimizer(_params(), comm=comm, stage=stage, lr=1.0, bucket_elems=4)
    for name in ("a", "b"):
        with opt.gradients(name) as g:
            g[f"{name}.w"][...] += 1.0
    opt.accumulate()
    problems: list[str] = []
    if comm.size > 1:
        if comm.rank == 0:
            opt.accumulate()
        problems, _ = _refused(opt, "number of micro-batches differs between ranks: rank 0 has 2")
    assert_all(not problems, "; ".join(problems))


def test_fingerprint_counts_gathers(comm: MPI.Intracomm) -> None:
    """Stage 3: ranks that gathered different layers (equal sizes) are caught too."""
    opt = ZeroOptimizer(_params(), comm=comm, stage=3, lr=1.0)
    with opt.gathered("a" if comm.rank == 0 else "b"):
        pass
    problems = _refused(opt, "allgatherv of bucket")[0] if comm.size > 1 else []
    assert_all(not problems, "; ".join(problems))


# -- a collective some rank never enters: the watchdog ----------------------------------


def _job(case: str, stage: int, shared: bool = False) -> tuple[int, str, float]:
    cmd = [mpiexec(), "-n", "2", sys.executable, str(SCRIPT), case, str(stage), str(int(shared))]
    status, out, end = run(cmd, timeout=60, ZEROMPI_TIMEOUT=str(TIMEOUT))
    starts = [float(s) for s in re.findall(r"START (\d+\.\d+)", out)]
    assert starts, out
    return status, out, end - max(starts)


#: The cases that only move the hang to another call (same launch, same watchdog and
#: abort path): scripts/test_openmpi runs one with and one without shared memory.
_SAME = pytest.mark.same_launch
WATCHDOG_CASES = [
    pytest.param("step0", 0, False, "allreduce of bucket 0", marks=_SAME),
    ("step0", 1, False, "reduce_scatter of bucket 0"),
    pytest.param("step0", 2, False, "allreduce", marks=_SAME),  # stage 2's opt.grads decision
    ("step0", 2, True, "allreduce"),
    pytest.param("step0", 3, False, "allreduce", marks=_SAME),
    pytest.param("save0", 2, False, "allreduce", marks=_SAME),  # the checkpoint's checksums
    pytest.param("full0", 3, False, "allgatherv of bucket 0", marks=_SAME),
]


@pytest.mark.mpi_skip
@pytest.mark.parametrize("stage", [pytest.param(0, marks=_SAME), 1])
def test_watchdog_ends_one_more_accumulate_with_16_bit_gradients(stage: int) -> None:
    """bfloat16 gradients at stages 0-1 are reduced at every ``accumulate()`` (never
    summed in 16 bits), so one more call on rank 0 is a collective the other rank
    never enters: the watchdog ends the job, naming the alltoallv."""
    status, out, seconds = _job("accumulate16", stage)
    assert status != 0, out
    assert seconds < TIMEOUT + SLACK, f"{seconds:.1f} s:\n{out}"
    assert "zerompi watchdog: rank 0 of 2 has waited" in out, out
    assert "in alltoallv of bucket 0" in out, out
    assert "aborting all ranks" in out, out


@pytest.mark.mpi_skip
@pytest.mark.parametrize(("case", "stage", "shared", "waits_in"), WATCHDOG_CASES)
def test_watchdog_ends_a_collective_one_rank_never_enters(
    case: str, stage: int, shared: bool, waits_in: str
) -> None:
    status, out, seconds = _job(case, stage, shared)
    assert status != 0, out
    assert seconds < TIMEOUT + SLACK, f"{seconds:.1f} s:\n{out}"
    assert "zerompi watchdog: rank 0 of 2 has waited" in out, out
    assert f"in {waits_in}" in out, out
    assert "rank 1 has not arrived" in out, out
    assert "aborting all ranks" in out, out


@pytest.mark.mpi_skip
@pytest.mark.parametrize(("case", "stage", "shared"), [
    pytest.param("mix", 2, False, marks=_SAME), ("mix", 2, True),
    pytest.param("mix", 3, False, marks=_SAME), pytest.param("mix", 3, True, marks=_SAME),
    ("accumulate", 2, False), pytest.param("accumulate", 3, False, marks=_SAME),
])  # fmt: skip
def test_desync_ends_the_job_without_the_watchdog(case: str, stage: int, shared: bool) -> None:
    """The same cases as whole jobs: the uncaught CollectiveError ends them at once."""
    status, out, seconds = _job(case, stage, shared)
    assert status != 0, out
    assert seconds < SLACK, f"{seconds:.1f} s:\n{out}"
    assert "CollectiveError" in out and "watchdog" not in out, out


@pytest.mark.mpi_skip
def test_agreeing_job_exits_zero() -> None:
    status, out, _ = _job("none", 2, True)
    assert status == 0, out


# -- the timeout: parsed, agreed, refused -----------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 600.0), (0, None), ("none", None), ("off", None), ("0", None), (2.5, 2.5),
     ("7", 7.0)],
)  # fmt: skip
def test_timeout_values(value: object, expected: float | None, monkeypatch) -> None:
    from zerompi.mpi.watchdog import TIMEOUT_ENV, resolve_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(value) == expected


def test_timeout_from_the_environment(monkeypatch) -> None:
    from zerompi.mpi.watchdog import TIMEOUT_ENV, resolve_timeout

    monkeypatch.setenv(TIMEOUT_ENV, "12")
    assert resolve_timeout(None) == 12.0
    monkeypatch.setenv(TIMEOUT_ENV, "none")
    assert resolve_timeout(None) is None
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="ZEROMPI_TIMEOUT must be a number of seconds"):
        resolve_timeout(None)


def test_bad_or_different_timeouts_raise_everywhere(comm: MPI.Intracomm) -> None:
    problems = []
    for kwargs, match in (
        ({"timeout": -1}, "timeout must be finite and >= 0 seconds, got -1"),
        ({"timeout": "soon"}, "timeout must be a number of seconds, 0 or 'none'"),
        ({"timeout": [1]}, "timeout must be a number of seconds or None"),
        ({"timeout": 10 + comm.rank} if comm.size > 1 else {"timeout": -1.5},
         "differs between ranks" if comm.size > 1 else "got -1.5"),
    ):  # fmt: skip
        try:
            ZeroOptimizer(_params(), comm=comm, **kwargs)
            problems.append(f"{kwargs}: no error")
        except (CollectiveError, TypeError) as exc:
            if match not in str(exc):
                problems.append(f"{kwargs}: {exc}")
    assert_all(not problems, "; ".join(problems))


def test_a_planned_collective_cannot_start_twice_in_flight(comm: MPI.Intracomm) -> None:
    """Reusing a prepared collective's Pending is safe because a second start while
    the first is in flight is refused."""
    from zerompi.mpi.collectives import Comm

    c = Comm(comm)
    buf = np.zeros(4 * comm.size, np.float32)
    planned = c.plan_allgatherv(buf, [4] * comm.size, [4 * r for r in range(comm.size)])
    pending = planned.start()
    try:
        planned.start()
        refused = False
    except RuntimeError:
        refused = True
    pending.wait()
    planned.start().wait()  # completed: may start again
    assert_all(refused, "a second start while in flight was accepted")


class _FakeComm:
    """What the watchdog reads of a communicator."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.size, self.rank, self.step, self.heartbeat = timeout, 2, 0, 1, None


@pytest.mark.parametrize("timeout", [600.0, 3.0, 0.1])
def test_the_first_wait_starts_the_watchdog_thread(timeout: float) -> None:
    """Whatever the timeout (the default 600 s included), the first wait inside zerompi
    starts the thread, polling often enough to fire within about 1/8 of it."""
    from zerompi.mpi.watchdog import Watchdog

    dog = Watchdog()
    dog.enter(_FakeComm(timeout), "allreduce", 1, -1)
    dog.leave()
    assert dog._thread is not None and dog._thread.is_alive()
    assert dog._poll <= max(0.02, timeout / 8)


def test_watchdog_times_one_wait_not_a_run_of_short_ones() -> None:
    """The thread times a wait from the poll that first sees it: one wait longer than
    the timeout fires; many short waits back to back, together far longer, do not."""
    import time

    from zerompi.mpi.watchdog import Watchdog

    fired: list[float] = []

    class Recording(Watchdog):
        def _fire(self, wait: tuple, waited: float) -> None:  # type: ignore[override]
            fired.append(waited)

    dog, comm = Recording(), _FakeComm(0.2)
    for seq in range(40):  # 40 waits of 25 ms: 1 s in all, 5 timeouts
        dog.enter(comm, "allreduce", seq, -1)
        time.sleep(0.025)
        dog.leave()
    assert fired == [], f"short waits fired the watchdog after {fired} s"
    dog.enter(comm, "allreduce", 40, -1)
    time.sleep(0.5)  # one wait of 2.5 timeouts
    dog.leave()
    assert len(fired) == 1 and 0.2 <= fired[0] <= 0.5, fired
