"""A tiny training script that fails on one chosen rank, for tests/test_failures.py.

    mpiexec -n W python tests/failing_script.py PHASE RANK [CHECKPOINT]

PHASE is where rank RANK raises (the other ranks carry on into their next collective,
where they would wait forever without zerompi's abort hook):

* ``model``: in the user's forward code, before any gradient is handed over;
* ``collective``: inside an ``opt.gradients()`` block, before its reduce-scatter;
* ``step``: inside ``opt.step()`` (the Adam update raises on that rank only);
* ``save``: writing a checkpoint (an MPI-IO write fails on that rank only);
* ``load``: reading a checkpoint (reading the file fails on that rank only);
* ``interrupt``: a ``KeyboardInterrupt`` in the user's code;
* ``thread``: an exception in a helper thread of that rank;
* ``kill``: that rank SIGKILLs itself inside an ``opt.gradients()`` block (no Python
  code runs after it, so only the launcher can end the others: mpiexec does,
  ``srun`` needs ``--kill-on-bad-exit``);
* ``none``: no failure; trains, saves and loads, and exits 0.

Just before raising, the failing rank prints ``FAILING_AT <time.time()>`` to stderr,
so that a test can measure how long the job took to end after the failure.
CHECKPOINT is the file used by ``save``/``load``/``none`` (default: a fresh temporary
directory). Runs under ``python -m mpi4py`` as well.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.mpi.launch import install_abort_hook

PHASES = ("model", "collective", "step", "save", "load", "interrupt", "thread", "kill", "none")
STEPS = 3


class InjectedFailure(RuntimeError):
    """The error this script raises on purpose."""


def fail_here(phase: str, rank: int, error: BaseException | None = None) -> None:
    print(f"FAILING_AT {time.time():.6f}", file=sys.stderr, flush=True)
    if phase == "interrupt":
        raise KeyboardInterrupt
    raise error or InjectedFailure(f"injected failure in phase {phase!r} on rank {rank}")


def main(argv: list[str]) -> int:
    phase = argv[0] if argv else "none"
    bad = int(argv[1]) if len(argv) > 1 else 1
    if phase not in PHASES:
        raise SystemExit(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    failing = phase != "none" and rank == bad

    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 4)), "b": np.zeros(4)}
    opt = ZeroOptimizer(params, stage=2, lr=1e-2)
    install_abort_hook()  # ZeroOptimizer.__init__ may do this already; it is idempotent

    if failing and phase == "step":

        def broken_adam_step(*args: object, **kwargs: object) -> None:
            fail_here(phase, rank)

        # the Adam rule calls adam_step by its global name
        sys.modules["zerompi.rules.adam"].adam_step = broken_adam_step
    # Checkpoint I/O failures: the MPI-IO collective itself still runs (a real I/O
    # error is reported by the call, it does not skip it), then this rank raises.
    if failing and phase == "save":
        real_write = opt.comm.write_at_all

        def failing_write(fh: object, offset: int, array: np.ndarray) -> None:
            real_write(fh, offset, array)
            fail_here(phase, rank, OSError(28, "No space left on device (injected)"))

        opt.comm.write_at_all = failing_write
    if failing and phase == "load":
        real_read = opt.comm.read_at_all

        def failing_read(fh: object, offset: int, array: np.ndarray) -> None:
            real_read(fh, offset, array)
            fail_here(phase, rank, PermissionError(13, "Permission denied (injected)"))

        opt.comm.read_at_all = failing_read

    x = np.random.default_rng(1 + rank).standard_normal((16, 8))
    y = np.random.default_rng(100 + rank).standard_normal((16, 4))
    for _ in range(STEPS):
        with opt.gathered("w", "b") as p:
            if failing and phase in ("model", "interrupt"):
                fail_here(phase, rank)
            if failing and phase == "thread":
                worker = threading.Thread(target=fail_here, args=(phase, rank), name="loader")
                worker.start()
                worker.join()
            err = x @ p["w"] + p["b"] - y  # forward of a linear model, squared error
        with opt.gradients("w", "b") as g:
            g["w"] += x.T @ err / len(x)
            g["b"] += err.mean(axis=0)
            if failing and phase == "collective":
                fail_here(phase, rank)
            if failing and phase == "kill":
                print(f"FAILING_AT {time.time():.6f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        opt.step()

    if phase in ("save", "load", "none"):
        path = argv[2] if len(argv) > 2 else None
        if path is None:
            path = world.bcast(tempfile.mkdtemp(prefix="zerompi-fail-") if rank == 0 else None)
            path = os.path.join(path, "state.ckpt")
        opt.save(path)
        opt.load(path)
    world.Barrier()
    if rank == 0:
        print(f"done: {STEPS} steps on {world.Get_size()} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
