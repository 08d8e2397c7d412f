"""Collective assertions: every rank reaches the same verdict, so none is left waiting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


class CollectiveAssertionError(AssertionError):
    """Raised on every rank of COMM_WORLD when an assertion failed on any rank."""


def assert_all(ok: bool, message: str = "") -> None:
    """Collective over COMM_WORLD: fail on every rank if ``ok`` is false on any rank,
    with the messages of the ranks that failed."""
    verdicts = WORLD.allgather(None if ok else (message or "assertion failed"))
    failed = [(r, m) for r, m in enumerate(verdicts) if m is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failed)
        raise CollectiveAssertionError(f"failed on {len(failed)} of {WORLD.size} rank(s):\n{lines}")


def assert_raises_all(
    exc_type: type[BaseException], match: str, fn: Callable[[], Any]
) -> BaseException | None:
    """Collective: ``fn()`` must raise ``exc_type`` whose message contains ``match`` on
    every rank. Never lets an exception escape on one rank only."""
    try:
        fn()
    except exc_type as exc:
        ok = match in str(exc)
        assert_all(ok, f"{exc_type.__name__} raised, but {match!r} not in: {exc}")
        return exc
    except Exception as exc:  # the wrong error, on this rank
        assert_all(False, f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
    else:
        assert_all(False, f"expected {exc_type.__name__}, nothing was raised")
    return None


def rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| (0 for equal arrays)."""
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale else diff


def assert_close_all(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str) -> None:
    """Collective: the relative error of ``actual`` is at most ``rtol`` on every rank."""
    ok = actual.shape == expected.shape and actual.dtype == expected.dtype
    err = rel_error(actual, expected) if ok else float("inf")
    assert_all(
        ok and err <= rtol,
        f"{what}: relative error {err:.3e} > {rtol:.1e} (shape {actual.shape} vs "
        f"{expected.shape}, dtype {actual.dtype} vs {expected.dtype})",
    )
