"""``python -m zerompi.driver`` under a test's control, for tests/test_elastic.py.

Each rank writes its PID to ``$ZEROMPI_TEST_CONTROL/pid.<rank>``. ``$ZEROMPI_TEST_PAUSE``
lists the moments (comma separated) at which every rank writes a marker
``<moment>.<rank>`` (holding its PID) and sleeps ``$ZEROMPI_TEST_PAUSE_S`` seconds, so
that the test can SIGKILL a rank by PID, from outside, at that moment:

* ``step:N``: in batch N's step, after its reduction, before its agreement (mid-step);
* ``snapshot:N``: right after the snapshot after batch N was sent, before it is
  committed (mid-snapshot);
* ``save:N``: inside the checkpoint save after batch N, with every rank's part of the
  temporary file written, before it is renamed into place (mid-save);
  ``save:N:again`` in the next save of that checkpoint (after a recovery);
* ``recover``: inside a recovery, after the survivors shrank the world and chose the
  step to go back to, before the re-shard (a loss during a recovery).

Each moment pauses once per process (a batch redone after a recovery does not pause
again). Everything else is the driver's command line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from zerompi import elastic, recovery, step
from zerompi.driver import main
from zerompi.mpi.collectives import Comm
from zerompi.optimizer import ZeroOptimizer

CONTROL = Path(os.environ["ZEROMPI_TEST_CONTROL"])
PAUSES = {p for p in os.environ.get("ZEROMPI_TEST_PAUSE", "").split(",") if p}
SECONDS = float(os.environ.get("ZEROMPI_TEST_PAUSE_S", "2"))
RANK = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0"
(CONTROL / f"pid.{RANK}").write_text(str(os.getpid()))
done: set[str] = set()


def pause(moment: str) -> None:
    if moment in PAUSES and moment not in done:
        done.add(moment)
        (CONTROL / f"{moment}.{RANK}").write_text(str(os.getpid()))
        time.sleep(SECONDS)


agree = step.agree


def _agree(engine, row):  # type: ignore[no-untyped-def]
    pause(f"step:{engine.step_count + engine.skipped_steps + 1}")
    return agree(engine, row)


post = elastic.Snapshots.post


def _post(self: elastic.Snapshots, engine) -> None:  # type: ignore[no-untyped-def]
    post(self, engine)
    pause(f"snapshot:{self.pending}")


sync = Comm.sync_file
saving: list[int] = []


def _sync(self: Comm, fh):  # type: ignore[no-untyped-def]
    out = sync(self, fh)
    if saving:
        moment = f"save:{saving[-1]}"
        pause(f"{moment}:again" if moment in done else moment)
    return out


save = ZeroOptimizer.save


def _save(self: ZeroOptimizer, path: str) -> None:
    saving.append(self.step_count + self.skipped_steps)
    try:
        save(self, path)
    finally:
        saving.pop()


choose = elastic.choose


def _choose(*args, **kwargs):  # type: ignore[no-untyped-def]
    out = choose(*args, **kwargs)
    pause("recover")
    return out


recovery.choose = _choose  # type: ignore[attr-defined]
step.agree = _agree  # type: ignore[assignment]
elastic.Snapshots.post = _post  # type: ignore[method-assign]
Comm.sync_file = _sync  # type: ignore[method-assign]
ZeroOptimizer.save = _save  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
