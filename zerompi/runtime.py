"""What the command-line tools (:mod:`zerompi.driver`, :mod:`zerompi.bench`) share.

* the argument parser that prints on rank 0 only, its help formatter and the small
  type converters of their options;
* control of numpy's OpenBLAS thread pool at run time (W ranks on one node must not
  each spin one thread per core);
* resident-set-size measurement, the clock, byte formatting;
* output files: their folders are made (or found unwritable) before any work, so
  that a long run never loses its results at the very end.

Nothing here imports MPI (the Python bindings): the collective functions take a
:class:`zerompi.mpi.collectives.Comm`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

try:
    import resource
except ImportError:  # not a Unix: no getrusage, no RSS figures
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .mpi.collectives import Comm

#: The clock of every timing (seconds, monotonic, the finest available).
clock = time.perf_counter


# -- command line ------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An argument parser that only prints on rank 0, so ``--help`` and usage
    errors appear once instead of once per rank (every rank still exits)."""

    def __init__(self, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rank = rank

    def _print_message(self, message: str, file: Any = None) -> None:
        if self._rank == 0:
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if self._rank != 0:
            message = None
        super().exit(status, message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only for options that have a meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def positive(value: str) -> int:
    """An integer >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def non_negative(value: str) -> int:
    """An integer >= 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def positive_float(value: str) -> float:
    """A finite number > 0."""
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return number


def non_negative_float(value: str) -> float:
    """A finite number >= 0."""
    number = float(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return number


def count(text: str) -> int:
    """A positive integer written as ``1000``, ``1e6`` or ``1.6e7``."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(number) and number.is_integer()):
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


# -- BLAS threads ------------------------------------------------------------------


def openblas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """``(get, set)`` of the number of threads numpy's OpenBLAS uses, or ``None`` when
    no OpenBLAS is loaded (another BLAS, or not Linux). Works at run time, after
    numpy (and OpenBLAS's thread pool) has started, which environment variables
    cannot: ``python -m zerompi.driver`` imports numpy before this module runs.

    Why: every rank's OpenBLAS otherwise keeps one spinning thread per core, so W
    ranks on one node oversubscribe the cores and a small matmul can take tens of
    milliseconds instead of microseconds.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted(
                {ln.split()[-1] for ln in maps if "openblas" in ln.lower() and "/" in ln}
            )
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already loaded: this only looks it up
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                try:
                    setter = getattr(lib, f"{prefix}_set_num_threads{suffix}")
                    getter = getattr(lib, f"{prefix}_get_num_threads{suffix}")
                except AttributeError:
                    continue
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return getter, setter
    return None


def auto_blas_threads(world: int) -> int | None:
    """Threads per rank when ``--blas-threads`` is not given: left alone (``None``)
    when the environment chooses (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``) or
    there is one rank, else the cores this process may use divided by the ranks
    (assumes that the ranks share one node: pass ``--blas-threads`` otherwise)."""
    if world == 1 or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world)


@contextmanager
def blas_threads(requested: int | None, world: int) -> Iterator[int | None]:
    """Run the block with ``requested`` OpenBLAS threads (``None``: see
    :func:`auto_blas_threads`) and restore the previous count afterwards, so that a
    ``main()`` imported into another program leaves its process as it found it.
    Yields the number of threads in use (``None`` without OpenBLAS)."""
    blas = openblas_threads()
    previous = blas[0]() if blas else None
    threads = requested or auto_blas_threads(world)
    try:
        if blas and threads:
            blas[1](threads)
        yield blas[0]() if blas else None
    finally:
        if blas and previous:
            blas[1](previous)


# -- memory ------------------------------------------------------------------------


def max_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (``ru_maxrss`` is in
    KiB on Linux and in bytes on macOS; 0 where there is no ``getrusage``)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def minor_faults() -> int:
    """This process's minor page faults so far (pages it touched for the first time
    since they were mapped; 0 where there is no ``getrusage``)."""
    return 0 if resource is None else int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``; elsewhere the
    peak so far). A floor is taken with this, not the peak, so that a warm-up's own
    temporaries do not raise it."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def add_shared_memory_options(p: argparse.ArgumentParser) -> None:
    """``--shared-memory`` / ``--no-shared-memory`` into ``args.shared_memory``
    (``None`` unless given): the optimizer's ``shared_memory`` argument."""
    shm = p.add_mutually_exclusive_group()
    shm.add_argument(
        "--shared-memory", dest="shared_memory", action="store_const", const=True,
        help="the optimizer's shared_memory=True (default: its default: node shared memory "
        "at stages 1-3 with more than one rank per node where it can work, one parameter "
        "copy per node and the reduction within a node through memory)",
    )  # fmt: skip
    shm.add_argument(
        "--no-shared-memory", dest="shared_memory", action="store_const", const=False,
        help="shared_memory=False: MPI collectives only, a parameter copy per rank",
    )  # fmt: skip


def pss_bytes() -> int:
    """This process's proportional set size now: its private pages plus its share of
    each shared page (Linux ``/proc/self/smaps_rollup``; elsewhere the resident set
    size). Summed over a node's ranks it counts a node-shared copy once, which RSS
    would count once per rank."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return current_rss_bytes()


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: four significant digits, binary units."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.4g} {unit}"
        count /= 1024
    return f"{count:.4g} GiB"


# -- output files ------------------------------------------------------------------


def prepare_outputs(comm: Comm, paths: Sequence[str | None]) -> str | None:
    """Collective: rank 0 makes the folder of every output file in ``paths`` (``None``
    entries are skipped) and checks that it can write there; every rank gets the same
    answer, ``None`` or what is wrong. Called before any work, so that a run whose
    results cannot be written fails at once, on every rank, instead of at the end."""
    problem = None
    if comm.rank == 0:
        for path in paths:
            if not path:
                continue
            folder = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                problem = f"cannot create the folder of {path}: {exc.strerror or exc}"
                break
            if os.path.isdir(path):
                problem = f"{path} is a folder, not a file"
                break
            if not os.access(folder, os.W_OK | os.X_OK):
                problem = f"cannot write {path}: the folder {folder} is not writable"
                break
    return comm.allgather(problem)[0]


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON (making the folder if it went missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
