"""Launch and abort: the abort hook and the launcher checks.

This module never imports ``mpi4py.MPI`` at import time: importing it initialises MPI,
and ``import zerompi`` installs the abort hook from here on machines (and in tools,
such as the checkpoint reader) that have no MPI. The hook looks MPI up only when an
exception reaches it: a process that never imported ``mpi4py.MPI`` has no MPI job to
abort.
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import Any, NoReturn


def _loaded_mpi() -> Any | None:
    """The ``mpi4py.MPI`` module if this process imported it (so MPI may be
    initialised), else ``None``; never imports it."""
    return sys.modules.get("mpi4py.MPI")


def abort_world(code: int = 1) -> None:
    """End every process of the job (all of COMM_WORLD): the only safe exit when
    this rank cannot continue. Flushes this rank's output first and gives the
    launcher a moment to forward it."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # pragma: no cover - closed streams must not stop the abort
        pass
    time.sleep(0.5)  # let the launcher forward what this rank printed before the kill
    mpi = _loaded_mpi()
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)  # pragma: no cover - no MPI to abort: end this process at least


def end_process(message: str, code: int = 1) -> NoReturn:
    """End this process alone, with ``message`` on stderr: the exit of an elastic
    rank whose recovery failed (ULFM). Not ``MPI_Abort``: after ranks had died, Open
    MPI 5.0.11's mpiexec deadlocked on an abort now and then (its ranks gone, itself
    never ending: 2 runs in 6 here), while ranks that just exit are failures the
    other survivors see, and end the same way."""
    try:
        sys.stderr.write(message + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # pragma: no cover - closed streams must not stop the exit
        pass
    os._exit(code)


# -- abort on an uncaught exception ---------------------------------------------------
#
# A rank that dies of an exception while the others wait for it in a collective leaves
# them waiting forever: MPI has no failure detection, and mpiexec only ends the job once
# *every* process has exited. The hook below turns an uncaught exception on any rank
# into ``MPI_Abort`` on ``COMM_WORLD``, which makes the launcher kill the whole job.

#: Setting this environment variable to ``1`` (read when the hook would be installed)
#: keeps :func:`install_abort_hook` from doing anything.
NO_ABORT_HOOK_ENV = "ZEROMPI_NO_ABORT_HOOK"

_previous_hooks: tuple[Any, Any] | None = None  # (sys.excepthook, threading.excepthook)
_aborting = False


def _world_rank_size() -> tuple[int, int] | None:
    """``(rank, size)`` of COMM_WORLD, or ``None`` when MPI is not running (not
    initialized yet, or finalized already): then there is nothing to abort."""
    MPI = _loaded_mpi()
    if MPI is None:
        return None
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return None
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except Exception:  # pragma: no cover - a broken MPI: leave it to the default hook
        return None


#: Files of the frames a runner puts above the user's code (``python -m mpi4py``,
#: ``python -m pkg``): left out of the traceback the hook prints, as Python's own
#: traceback of ``python script.py`` has none of them.
_RUNNER_FILES = ("<frozen runpy>", "runpy.py", "mpi4py/run.py", "mpi4py/__main__.py")

#: Seconds a rank that leaves the traceback of an error raised on every rank to rank 0
#: waits for rank 0's abort before it aborts the job itself.
EVERY_RANK_GRACE = 3.0


def _user_traceback(tb: Any) -> Any:
    """``tb`` without the leading frames of a runner (runpy, mpi4py's ``run``); all of
    ``tb`` if nothing else is left."""
    first = tb
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if not filename.endswith(_RUNNER_FILES):
            return tb
        tb = tb.tb_next
    return first


def mark_raised_on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised identically on every rank of COMM_WORLD (a collective
    verdict), so that if it reaches the abort hook only rank 0 prints its traceback and
    the others one line each. Returns ``exc``, for ``raise mark_raised_on_every_rank(E())``.
    :class:`zerompi.mpi.agreement.CollectiveError` is treated so without the mark."""
    try:
        exc.zerompi_every_rank = True  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - an exception type with __slots__
        pass
    return exc


def _raised_on_every_rank(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    if getattr(exc, "zerompi_every_rank", False) is True:
        return True
    agreement = sys.modules.get("zerompi.mpi.agreement")
    collective = getattr(agreement, "CollectiveError", None)
    return collective is not None and isinstance(exc, collective)


def _write_stderr(text: str) -> None:
    """``text`` to stderr in one write (so ranks' reports do not interleave within it).

    The process's own stderr when ``sys.stderr`` is an in-memory stand-in: torch's
    ``init_process_group`` wraps ``sys.excepthook`` in one that points ``sys.stderr``
    at a ``StringIO`` while the previous hook (this one) runs and prints it afterwards,
    which never comes when that hook ends the job."""
    stream = sys.stderr
    if isinstance(stream, io.StringIO) and sys.__stderr__ is not None:
        stream = sys.__stderr__
    try:
        stream.write(text)
        stream.flush()
    except Exception:  # pragma: no cover - a closed stderr must not stop the abort
        pass


def _abort_world(
    exc_type: type[BaseException], exc: BaseException | None, tb: Any, where: str = ""
) -> None:
    """Report ``exc`` on stderr, naming this rank, and abort every process of the job.

    Prints the traceback once per failing rank (Python does not print it again: this
    is the excepthook, and it never returns), without the runner's frames. An error
    raised identically on every rank (:func:`mark_raised_on_every_rank`) is printed in
    full by rank 0 only; the other ranks print one line and leave the abort to rank 0
    (aborting themselves after :data:`EVERY_RANK_GRACE` seconds if it never comes)."""
    global _aborting
    import traceback

    rank, size = _world_rank_size() or (0, 1)
    if _aborting:  # a second failure (another thread, or while reporting the first)
        abort_world(1)
    _aborting = True
    code = 1
    grace = 0.0
    try:
        if issubclass(exc_type, KeyboardInterrupt):
            code = 130  # 128 + SIGINT, as a shell reports it (and mpi4py's runner)
            _write_stderr(
                f"zerompi: rank {rank} of {size} interrupted (KeyboardInterrupt){where}; "
                "aborting the job\n"
            )
            return
        detail = "".join(traceback.format_exception_only(exc_type, exc)).strip()
        header = f"zerompi: rank {rank} of {size} failed{where}: {detail}"
        if rank > 0 and _raised_on_every_rank(exc):
            grace = EVERY_RANK_GRACE
            _write_stderr(f"{header} (raised on every rank: traceback from rank 0)\n")
            return
        _write_stderr(
            f"{header}\n"
            + "".join(traceback.format_exception(exc_type, exc, _user_traceback(tb)))
            + f"zerompi: aborting all {size} ranks (MPI_Abort on COMM_WORLD); set "
            f"{NO_ABORT_HOOK_ENV}=1 to disable\n"
        )
    finally:
        if grace:
            time.sleep(grace)  # rank 0 prints the traceback and aborts meanwhile
        abort_world(code)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    world = _world_rank_size()
    previous = _previous_hooks[0] if _previous_hooks else sys.__excepthook__
    if world is None or world[1] == 1:
        previous(exc_type, exc, tb)
        return
    _abort_world(exc_type, exc, tb)


def _threading_excepthook(args: Any) -> None:
    world = _world_rank_size()
    if world is None or world[1] == 1 or issubclass(args.exc_type, SystemExit):
        import threading

        previous = _previous_hooks[1] if _previous_hooks else threading.__excepthook__
        previous(args)
        return
    name = getattr(args.thread, "name", None)
    _abort_world(
        args.exc_type,
        args.exc_value,
        args.exc_traceback,
        f" in thread {name!r}" if name else " in a thread",
    )


def install_abort_hook() -> bool:
    """Make an uncaught exception on any rank end the whole MPI job at once.

    Installs (once; later calls do nothing) a :data:`sys.excepthook` and a
    :data:`threading.excepthook` that, when ``COMM_WORLD`` has more than one process,
    print ``zerompi: rank R of W failed: <Type>: <message>`` and the traceback to
    stderr and call ``MPI.COMM_WORLD.Abort(1)`` (130 for ``KeyboardInterrupt``, with a
    one-line message), so the launcher kills every rank instead of leaving the others
    waiting forever in a collective. Each failing rank prints its traceback once
    (without the frames of ``python -m mpi4py``'s runner); an error raised identically
    on every rank (:func:`mark_raised_on_every_rank`, ``CollectiveError``) is printed
    in full by rank 0 only, the other ranks print one line. With one process, or
    before ``MPI_Init`` / after ``MPI_Finalize``, the previous hooks run unchanged.
    Works under ``python -m mpi4py`` too (its runner re-raises the exception, which
    then reaches this hook, and nothing prints it again).

    Not covered: ``sys.exit()``/``SystemExit`` on one rank (it bypasses the excepthook;
    run under ``python -m mpi4py`` to abort on a non-zero exit status too) and a rank
    killed by a signal (the launcher handles that itself).

    Opt out with the environment variable ``ZEROMPI_NO_ABORT_HOOK=1`` (read here, at
    install time) or :func:`uninstall_abort_hook`. Returns whether the hook is
    installed after the call.
    """
    global _previous_hooks
    import os
    import threading

    if _previous_hooks is not None:
        return True
    if os.environ.get(NO_ABORT_HOOK_ENV, "").strip() not in ("", "0"):
        return False
    _previous_hooks = (sys.excepthook, threading.excepthook)
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    return True


def uninstall_abort_hook() -> None:
    """Restore the hooks :func:`install_abort_hook` replaced (if they are still ours)."""
    global _previous_hooks
    import threading

    if _previous_hooks is None:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _previous_hooks[0]
    if threading.excepthook is _threading_excepthook:
        threading.excepthook = _previous_hooks[1]
    _previous_hooks = None


#: Environment variables by which launchers announce how many processes they started.
LAUNCHER_SIZE_VARIABLES = (
    "SLURM_STEP_NUM_TASKS",  # srun
    "PMI_SIZE",  # MPICH's hydra and other PMI-1 launchers
    "PMIX_SIZE",
    "OMPI_COMM_WORLD_SIZE",  # Open MPI's mpirun
)


def check_world() -> None:
    """Refuse the classic silent mistake: every rank alone in a world of one while the
    launcher started several (``srun --mpi=none``, or an mpi4py built against another
    MPI than the launcher's): each would train on its own. ``ZEROMPI_ALLOW_SINGLETON=1``
    skips the check."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 1 or os.environ.get("ZEROMPI_ALLOW_SINGLETON") == "1":
        return
    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"MPI sees a world of 1 process, but {name}={value}: the launcher started "
                f"{value} processes that do not form one MPI world, so each would train "
                "alone. Launch with an MPI-aware launcher matching mpi4py's MPI "
                "(mpiexec -n N, or srun --mpi=pmi2 / pmix under SLURM), check "
                "`python -m mpi4py --mpi-library` against the launcher, or set "
                "ZEROMPI_ALLOW_SINGLETON=1 if this is intended."
            )


def library_version() -> str:
    """First line of the MPI library's version string (e.g. "MPICH Version: 5.0.2")."""
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].strip()
