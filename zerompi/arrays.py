"""The arrays the optimizer hands out, and the local checks of its arguments.

Validation here is local; the optimizer makes it collective (every rank hears of an
error found on any rank) with :meth:`zerompi.mpi.collectives.Comm.agree`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from .adam import finite_real
from .partition import SUPPORTED_DTYPES, Deferred

#: What ``step()`` does with a non-finite averaged gradient.
NONFINITE = ("skip", "raise")


def check_failure_settings(max_norm: object, nonfinite: object) -> float | None:
    """Local validation of ``max_norm`` and ``nonfinite``; returns ``max_norm`` as a
    float (or None)."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r:.60}")
    if max_norm is None:
        return None
    return finite_real("max_norm", max_norm, positive=True, kind="a real number or None")


class FlatArrays(Mapping[str, np.ndarray]):
    """Name -> view into a flat buffer. Assigning copies into the view after checking
    shape and dtype, so the flat storage can never be swapped out from under the
    optimizer."""

    def __init__(self, views: dict[str, np.ndarray], what: str, read_only: bool = False) -> None:
        self._views = views
        self._what = what
        self._read_only = read_only

    def __getitem__(self, name: str) -> np.ndarray:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name not in self._views:
            raise KeyError(f"no {self._what} named {name!r}")
        if self._read_only:
            raise ValueError(
                f"{self._what} {name!r} is the model's rounded copy (param_dtype): writing "
                "it would not change the master copy Adam updates. Pass initial values "
                "to the constructor, or load a checkpoint"
            )
        view = self._views[name]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{self._what} {name!r} must be a numpy array, got {type(value)}")
        if value.shape != view.shape or value.dtype != view.dtype:
            raise ValueError(
                f"{self._what} {name!r} must have shape {view.shape} and dtype {view.dtype}, "
                f"got shape {value.shape} and dtype {value.dtype}"
            )
        np.copyto(view, value)

    def __repr__(self) -> str:
        return f"<{self._what}s: {', '.join(self._views)}>"


def check_params(params: object) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """Local validation of the parameter mapping; returns its (name, shape, dtype)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> numpy array, got {type(params)}")
    if not params:
        raise ValueError("params is empty: there is nothing to optimize")
    specs = []
    for name, value in params.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        if not isinstance(value, (np.ndarray, Deferred)):
            raise TypeError(
                f"parameter {name!r} must be a numpy array or zerompi.Deferred, "
                f"got {type(value).__name__} {value!r:.60}"
            )
        if value.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {value.dtype}; zerompi optimizes float32 or "
                "float64 arrays"
            )
        if value.size == 0:
            raise ValueError(f"parameter {name!r} has no elements (shape {value.shape})")
        specs.append((name, tuple(int(s) for s in value.shape), value.dtype))
    return specs


