"""Collective validation and the fingerprint of the collectives a rank makes.

MPI cannot tell that two ranks called collectives that do not belong together: two
reduce-scatters of equal size pair up even when one rank reduces bucket ``a`` and the
other bucket ``b``, and the data is mixed silently. Each
:class:`zerompi.mpi.collectives.Comm` therefore keeps a running :class:`Fingerprint` of
every data-path collective it starts (operation, bucket, element count, in order). The
step's one small collective already carries a few numbers per rank; it carries the
fingerprint too, so a difference is found on every rank at once, with no extra
collective in steady state. Only then, on the failure path, the ranks exchange their
call logs to name the first call that differs and the ranks on each side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from mpi4py import MPI

from .launch import mark_raised_on_every_rank


class CollectiveError(ValueError):
    """Raised identically on every rank when validation failed on any rank, or when
    the ranks' collective calls differ."""


#: Operation codes in a fingerprint (ints: their hash is the same in every process).
OPS = ("reduce_scatter", "allgatherv", "allreduce", "bcast", "alltoallv")
OP_CODE = {op: code for code, op in enumerate(OPS)}

_MASK26 = (1 << 26) - 1
_MASK64 = (1 << 64) - 1
_MULT = 0x100000001B3  # FNV-1a's 64-bit prime: an order-sensitive running combination


def token(op: int, tag: int, count: int) -> int:
    """One call as a 64-bit number, the same in every process (no string hashing)."""
    return hash((op, tag, count)) & _MASK64


class Fingerprint:
    """A running hash of ``(operation, bucket, count)`` per collective call, and the
    calls themselves since the last :meth:`reset` (for the diagnosis)."""

    __slots__ = ("calls", "log", "value")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.value = 0
        self.calls = 0
        self.log: list[tuple[int, int, int]] = []

    def record(self, op: int, tag: int, count: int) -> None:
        """One collective call: operation code, bucket (or -1), elements."""
        self.add((op, tag, count), token(op, tag, count))

    def add(self, call: tuple[int, int, int], token: int) -> None:
        """:meth:`record` with ``call``'s :func:`token` computed beforehand (a
        prepared collective does it once)."""
        self.value = (self.value * _MULT + token) & _MASK64
        self.calls += 1
        self.log.append(call)

    def words(self) -> tuple[float, float, float]:
        """``(calls, high, low)``: the call count and 52 bits of the hash as three
        floats that a float64 carries exactly."""
        value = self.value & ((1 << 52) - 1)
        return float(self.calls), float(value >> 26), float(value & _MASK26)


def describe_call(call: tuple[int, int, int] | None, describe: Callable[[int], str]) -> str:
    if call is None:
        return "no call"
    op, tag, count = call
    where = f" of {describe(tag)}" if tag >= 0 else ""
    return f"{OPS[op]}{where} ({count} elements)"


def first_difference(
    logs: Sequence[Sequence[tuple[int, int, int]]], describe: Callable[[int], str]
) -> str:
    """Where the ranks' call logs part: ``"call #k: ranks 0, 2 made X; rank 1 made
    Y"`` (calls counted from 1, since the last step's agreement)."""
    length = max(len(log) for log in logs)
    for k in range(length):
        calls = [tuple(log[k]) if k < len(log) else None for log in logs]
        if len(set(calls)) > 1:
            sides: dict[Any, list[int]] = {}
            for rank, call in enumerate(calls):
                sides.setdefault(call, []).append(rank)
            parts = [
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                f"made {describe_call(call, describe)}"
                for call, ranks in sides.items()
            ]
            return f"collective call #{k + 1} differs: " + "; ".join(parts)
    return "the call logs agree but their fingerprints differ"


def agree_step(
    comm: Any, row: np.ndarray, describe: Callable[[int], str], step: int
) -> tuple[int, float]:
    """Collective: the step's agreement. ``row`` is this rank's ``[non-finite count,
    sum of squares, step count, micro-batches, *fingerprint words, Adam settings
    token]`` (:func:`zerompi.settings.settings_token`); every rank gets
    every row and sums them in rank order, so all reach the same decision. Returns
    ``(non-finite elements, sum of squares)`` over all ranks, or raises
    :class:`CollectiveError` on every rank, naming what differs (for different calls:
    the first one, after one more exchange of the call logs, on this failure path
    only)."""
    rows = comm.allgather_float64(row, op="step agreement")
    log = comm.fingerprint.log
    comm.fingerprint.reset()
    for column, what in ((2, "step count"), (3, "number of micro-batches")):
        if (rows[:, column] != rows[0, column]).any():
            r = int(np.argmax(rows[:, column] != rows[0, column]))
            raise CollectiveError(
                f"the {what} differs between ranks: rank 0 has {int(rows[0, column])}, "
                f"rank {r} has {int(rows[r, column])} (every rank must call step() and "
                "accumulate() alike); this step's gradients were discarded"
            )
    if (rows[:, 7] != rows[0, 7]).any():  # checked at every step: no drift survives
        r = int(np.argmax(rows[:, 7] != rows[0, 7]))
        raise CollectiveError(
            f"Adam's settings differ between ranks: rank {r}'s lr, betas, eps or "
            "weight_decay (of some parameter group) are not rank 0's; every rank must "
            "call set_hyperparameters() alike. This step's gradients were discarded"
        )
    if (rows[:, 4:7] != rows[0, 4:7]).any():
        where = first_difference(comm.allgather(log), describe)
        raise CollectiveError(
            f"the ranks' collective calls differ in step {step}: {where}. Every rank must "
            "hand over and gather the same buckets in the same order; this step's "
            "gradients were discarded"
        )
    nonfinite = int(math.fsum(rows[:, 0]))
    try:
        sumsq = math.fsum(rows[:, 1])  # the same on every rank
    except (OverflowError, ValueError):  # inf - inf, or finite terms overflowing
        sumsq = math.inf if not np.isnan(rows[:, 1]).any() else math.nan
    return nonfinite, sumsq


class Verdict:
    """This rank's first error in a collective operation, until every rank hears of
    it: the one helper for "catch locally, then agree" (:meth:`Agreement.verdict`).

    As a context manager it catches the block's exception and, at the end of the
    block, raises on every rank if any rank caught one (one small collective)::

        with comm.verdict():
            check_arguments()          # may raise on some ranks only

    Where later collectives must still run after a local error (a checkpoint's
    writes, so that the ranks' collective sequences stay paired), each phase is
    caught with :meth:`catch` and the ranks agree once with :meth:`agree`::

        verdict = comm.verdict()
        for offset, shard in pieces:
            with verdict.catch():
                comm.write_at_all(fh, offset, shard if verdict.ok else shard[:0])
        verdict.agree()
    """

    __slots__ = ("comm", "error")

    def __init__(self, comm: Agreement) -> None:
        self.comm = comm
        #: The first exception caught on this rank (``None``: none so far).
        self.error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """Whether this rank has caught nothing so far."""
        return self.error is None

    @contextmanager
    def catch(self) -> Iterator[None]:
        """Keep the block's exception (the first one) instead of raising it here."""
        try:
            yield
        except Exception as exc:  # whatever it is, every rank must hear of it
            if self.error is None:
                self.error = exc

    def agree(self) -> None:
        """Collective: raise on every rank if any rank caught an error
        (:meth:`Agreement.agree`)."""
        error, self.error = self.error, None
        self.comm.agree(error)

    def __enter__(self) -> Verdict:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # an interrupt: no collective on the way out
        if exc is not None and self.error is None:
            self.error = exc
        self.agree()
        return exc is not None


class Agreement:
    """Validation methods of :class:`zerompi.mpi.collectives.Comm`: raise on every
    rank, never on one."""

    mpi: MPI.Intracomm
    rank: int
    size: int

    def allgather(self, obj: Any) -> list[Any]:  # provided by Comm
        raise NotImplementedError

    def verdict(self) -> Verdict:
        """A :class:`Verdict` over this communicator."""
        return Verdict(self)

    def agree(self, error: BaseException | None) -> None:
        """Collective: raise on every rank if ``error`` is set on any rank.

        The raised exception keeps the type of the first failing rank's error when it
        is a ``TypeError`` and names the ranks it was found on (else
        :class:`CollectiveError`).
        """
        errors = self.allgather(None if error is None else (type(error).__name__, str(error)))
        self._raise_first(errors)

    def settle(self, error: BaseException | None, sections: Sequence[tuple[str, Any]]) -> None:
        """Collective, in one exchange: :meth:`agree` on ``error``, then
        :meth:`check_same` on every ``(what, value)`` of ``sections`` in order (the
        first that differs is named). What building an optimizer agrees on: its
        layout and every setting."""
        mine = None if error is None else (type(error).__name__, str(error))
        rows = self.allgather((mine, [value for _, value in sections]))
        self._raise_first([e for e, _ in rows])
        for i, (what, _) in enumerate(sections):
            _check_values([values[i] for _, values in rows], what)

    def _raise_first(self, errors: Sequence[tuple[str, str] | None]) -> None:
        """Raise the first rank's error of ``errors`` (one per rank) on every rank."""
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        _, (kind, message) = failed[0]
        ranks = [r for r, e in failed if e == (kind, message)]
        where = (
            f"on all {self.size} ranks"
            if len(ranks) == self.size > 1
            else f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"of {self.size}"
        )
        others = len(failed) - len(ranks)
        if others:
            where += f"; {others} other rank(s) failed differently"
        exc_type = {"TypeError": TypeError}.get(kind, CollectiveError)
        raise mark_raised_on_every_rank(exc_type(f"{message} ({where})"))

    def check_same(self, value: Any, what: str) -> None:
        """Collective: raise on every rank unless ``value`` is equal on all ranks.

        For sequences the message names the first item that differs."""
        _check_values(self.allgather(value), what)


def _check_values(values: Sequence[Any], what: str) -> None:
    """Raise :class:`CollectiveError` unless every rank's value equals rank 0's."""
    for r, other in enumerate(values):
        if other != values[0]:
            difference = _difference(values[0], other, r)
            raise CollectiveError(f"{what} differs between ranks: {difference}")


def _difference(ref: Any, other: Any, rank: int) -> str:
    if isinstance(ref, (list, tuple)) and isinstance(other, (list, tuple)):
        for i, (a, b) in enumerate(zip(ref, other, strict=False)):
            if a != b:
                return f"item {i} is {_short(a)} on rank 0 but {_short(b)} on rank {rank}"
        return f"rank 0 has {len(ref)} items, rank {rank} has {len(other)} items"
    return f"rank 0 has {_short(ref)}, rank {rank} has {_short(other)}"


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
