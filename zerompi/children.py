"""Child process groups that stop with their launcher.

A launcher of this repository that starts ``mpiexec`` (the GPT benchmark's setups,
the elastic measurement) starts it in a session of its own, so that a timeout can end
mpiexec, its proxies and every rank at once with ``os.killpg``: the ranks of an MPI
job outlive an mpiexec killed alone. The same isolation hides the job from the
signals that stop the launcher: ``timeout``'s SIGTERM, Ctrl-C's SIGINT and a closed
terminal's SIGHUP reach the launcher's process group, not the job's, and a launcher
stopped by one used to leave its job running (two ranks spun for 11 minutes after
their launcher was killed, #27).

:func:`process_group` starts a command in its own group and, while the group lives,
forwards those signals: on SIGTERM, SIGINT or SIGHUP every live group gets SIGTERM
(whose default action ends a Python rank even inside an MPI wait, where SIGINT's
``KeyboardInterrupt`` would wait for the call to return), :data:`GRACE_S` seconds to
end, then SIGKILL; once none is left, the launcher ends by the signal it received,
so its caller sees which. Leaving the block ends what is left of the group the same
way (after a timeout, all of it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

#: Seconds a group gets to end after SIGTERM before it is killed.
GRACE_S = 5.0
#: The signals a launcher forwards to its groups.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_live: list[subprocess.Popen[Any]] = []
_previous: dict[int, Any] = {}


def _alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left (a zombie leader counts until
    it is reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (a pgid reused by another user's processes: not ours)
        return False
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def end(proc: subprocess.Popen[Any], grace: float = GRACE_S) -> None:
    """End ``proc``'s process group and wait until none of it is left: SIGTERM,
    ``grace`` seconds, then SIGKILL (``grace=0``: SIGKILL at once). Reaps ``proc``."""
    pgid = proc.pid
    deadline = time.monotonic() + grace
    if grace > 0:
        _signal_group(pgid, signal.SIGTERM)
        while time.monotonic() < deadline:
            proc.poll()  # (reap the leader, so a dead one does not keep the group)
            if not _alive(pgid):
                break
            time.sleep(0.05)
    if _alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    proc.poll()
    stop = time.monotonic() + 10.0  # SIGKILL cannot be refused: only the reaping waits
    while _alive(pgid) and time.monotonic() < stop:
        proc.poll()
        time.sleep(0.02)


def _forward(signum: int, frame: FrameType | None) -> None:
    """The handler while a group lives: end every group, then this process, by
    ``signum`` (its default action, or the handler that was there before)."""
    for proc in list(_live):
        end(proc)
    _restore()
    previous = signal.getsignal(signum)
    if callable(previous):  # (SIGINT: Python's KeyboardInterrupt)
        previous(signum, frame)
        return
    os.kill(os.getpid(), signum)


def _restore() -> None:
    for signum, handler in _previous.items():
        signal.signal(signum, handler)
    _previous.clear()


@contextmanager
def process_group(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``subprocess.Popen(cmd, **popen)`` in a session of its own, ended with this
    process: see the module docstring. The signals are forwarded only where a
    handler can be installed (the main thread); elsewhere the group is still ended
    when the block is left."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    main = threading.current_thread() is threading.main_thread()
    if main and not _live:
        for signum in FORWARDED:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # (nohup's SIGHUP stays so)
                _previous[signum] = signal.signal(signum, _forward)
    _live.append(proc)
    try:
        yield proc
    finally:
        end(proc)  # (a group already gone: at once)
        _live.remove(proc)
        if main and not _live:
            _restore()


# -- a process tree, for the shell scripts ---------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (read from ``/proc``: Linux), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # (after the command's name)
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def end_tree(pid: int, grace: float = GRACE_S) -> None:
    """End ``pid``'s descendants and their process groups (a ``timeout`` or an
    ``mpiexec`` in a group of its own): SIGTERM, ``grace`` seconds, then SIGKILL.
    ``pid`` itself is left to its parent."""
    tree = descendants(pid)
    groups = {_pgid(p) for p in tree} - {None, os.getpgid(0)}
    for p in tree:
        _signal(p, signal.SIGTERM)
    for g in groups:
        _signal_group(g, signal.SIGTERM)  # type: ignore[arg-type]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(_exists(p) for p in tree)
                                           or any(_alive(g) for g in groups)):  # fmt: skip
        time.sleep(0.05)
    for p in tree + descendants(pid):
        _signal(p, signal.SIGKILL)
    for g in groups:
        _signal_group(g, signal.SIGKILL)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerompi.children end-tree PID``: :func:`end_tree`, for the shell
    scripts' ``zerompi_wait`` (``scripts/_env.sh``)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "end-tree" or not args[1].isdigit():
        print("usage: python -m zerompi.children end-tree PID", file=sys.stderr)
        return 2
    end_tree(int(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
