"""Where a step's time goes: the seconds per phase, each phase a context manager.

``with timings.reduce:`` around the work of a phase adds its duration; the engine's
three phases are the step's (``reduce_scatter``, ``adam``, ``allgather``: the keys
of ``opt.pop_timings()``). A phase is entered around work, never inside itself (it
keeps one start time), and costs two clock reads per entry: it brackets per-layer
hand-overs too.
"""

from __future__ import annotations

from .runtime import clock

#: The phases of a step, as ``opt.pop_timings()`` names them.
PHASES = ("reduce_scatter", "adam", "allgather")


class Phase:
    """Seconds spent inside ``with phase:`` blocks since the last :meth:`Timings.pop`."""

    __slots__ = ("_start", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Phase:
        self._start = clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += clock() - self._start


class Timings:
    """The step's phases: :attr:`reduce` (reductions and hand-overs, and the zeroing
    of the gradient buffers after the update), :attr:`adam` and :attr:`gather` (the
    gathers, of a layer or after Adam)."""

    __slots__ = ("adam", "gather", "reduce")

    def __init__(self) -> None:
        self.reduce, self.adam, self.gather = Phase(), Phase(), Phase()

    def pop(self) -> dict[str, float]:
        """Seconds per phase (:data:`PHASES`) since the last call, and reset."""
        phases = (self.reduce, self.adam, self.gather)
        out = {name: phase.seconds for name, phase in zip(PHASES, phases, strict=True)}
        for phase in phases:
            phase.seconds = 0.0
        return out
