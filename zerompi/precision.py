"""Mixed precision: which dtype each copy of the model has, and dynamic loss scaling.

Three dtypes per group of parameters (the groups of :mod:`zerompi.partition` are
per dtype of the arrays the user passed):

* the **master** dtype (float32 or float64, the arrays' own): the shard Adam updates,
  ``exp_avg``, ``exp_avg_sq``, and the reduced gradient, where rank contributions are
  summed;
* the **parameter** dtype (``param_dtype``; default the master's): the full or
  gathered parameters the model computes with, and the ``Allgatherv``'s wire;
* the **reduce** dtype (``reduce_dtype``; default the master's): the gradients the
  model hands over, and the reduction's wire. A 16-bit one is never summed in 16
  bits: each rank receives its part of every rank's bucket in 16 bits (``Alltoallv``,
  or read from node shared memory) and sums them in the master dtype, in rank order.

16-bit values cross MPI as ``uint16`` (MPI has no standard bfloat16 type, and only
moving them needs none). ``bfloat16`` comes from ``ml_dtypes`` (the package JAX
uses), imported only when asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .adam import finite_real

#: Dtypes a ``param_dtype`` or ``reduce_dtype`` may name, narrowest first.
NAMES = ("bfloat16", "float16", "float32", "float64")


def bfloat16() -> np.dtype:
    """numpy's bfloat16, from ``ml_dtypes`` (a clear error where it is missing)."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(
            "bfloat16 needs the ml_dtypes package (pip install ml_dtypes, or "
            'pip install "zerompi[bf16]")'
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def resolve_dtype(value: object, what: str) -> np.dtype | None:
    """``value`` (``None``, ``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float64"``
    or a numpy dtype) as a numpy dtype (``None`` stays ``None``), or a
    ``TypeError``/``ValueError`` naming it."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("bfloat16", "bf16"):
        return bfloat16()
    try:
        dtype = np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"{what} must be one of {', '.join(NAMES)}, a numpy dtype or None, got {value!r:.60}"
        ) from None
    if dtype.name not in NAMES:
        raise ValueError(
            f"{what} must be a floating dtype among {', '.join(NAMES)}, got {dtype.name!r}"
        )
    return dtype


def is_half(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of the 16-bit floats (moved as ``uint16``)."""
    return dtype.itemsize == 2


def check_narrower(dtype: np.dtype, master: np.dtype, what: str) -> None:
    """Refuse a ``param_dtype``/``reduce_dtype`` wider than the master dtype."""
    if dtype.itemsize > master.itemsize:
        raise ValueError(
            f"{what}={dtype.name} is wider than the {master.name} parameters it would "
            "copy: the master copy keeps the arrays' own dtype, pass float64 arrays "
            f"for a {dtype.name} {what}, or a narrower {what}"
        )


@dataclass(frozen=True)
class Precision:
    """The dtypes of one group of parameters (see the module docstring)."""

    master: np.dtype
    param: np.dtype
    reduce: np.dtype

    @property
    def low_params(self) -> bool:
        """The model's parameters are a separate, narrower copy of the master."""
        return self.param != self.master

    @property
    def low_grads(self) -> bool:
        """The model hands over narrower gradients than the master's."""
        return self.reduce != self.master


def precisions(
    masters: list[np.dtype], param_dtype: np.dtype | None, reduce_dtype: np.dtype | None
) -> dict[np.dtype, Precision]:
    """Master dtype -> :class:`Precision`, checking that neither setting is wider than
    a master dtype it applies to."""
    out = {}
    for master in masters:
        param = param_dtype or master
        reduce = reduce_dtype or master
        check_narrower(param, master, "param_dtype")
        check_narrower(reduce, master, "reduce_dtype")
        out[master] = Precision(master, param, reduce)
    return out


class LossScale:
    """Dynamic loss scaling, as torch's ``GradScaler``: the model multiplies its loss
    gradient by :attr:`scale`; ``step()`` divides it back out. A step whose averaged
    gradient overflows (non-finite on any rank: the step's agreement already says so,
    no extra collective) is skipped and the scale multiplied by ``backoff``; after
    ``growth_interval`` good steps in a row it is multiplied by ``growth``.
    ``dynamic=False`` keeps a static scale."""

    def __init__(
        self, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
        growth_interval: int = 2000, dynamic: bool = True,
    ) -> None:  # fmt: skip
        self.scale = finite_real("loss scale", init, positive=True)
        self.growth = finite_real("growth", growth, positive=True)
        self.backoff = finite_real("backoff", backoff, positive=True)
        if self.growth < 1.0 or self.backoff >= 1.0:
            raise ValueError(f"need growth >= 1 and backoff < 1, got {growth}, {backoff}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or (
            growth_interval < 1
        ):  # fmt: skip
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        #: Good steps since the last change of scale.
        self.good_steps = 0
        #: ``(step, old scale, new scale)`` of every change, for the record.
        self.history: list[tuple[int, float, float]] = []

    def update(self, overflow: bool, step: int) -> None:
        """After a step (``overflow``: it was skipped for a non-finite gradient)."""
        if not self.dynamic:
            return
        old = self.scale
        if overflow:
            self.scale = max(old * self.backoff, math.ulp(0.0))
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps < self.growth_interval:
                return
            grown = old * self.growth
            self.scale = grown if math.isfinite(grown) else old
            self.good_steps = 0
        if self.scale != old:
            self.history.append((step, old, self.scale))

    def restore(self, scale: object, good_steps: object) -> None:
        """Take a saved scale and good-step count back (a checkpoint's)."""
        self.scale = finite_real("loss scale", scale, positive=True)
        self.good_steps = int(good_steps)  # type: ignore[call-overload]


def loss_scale_of(value: object, reduce: np.dtype | None) -> LossScale | None:
    """``loss_scale=`` as a :class:`LossScale`: ``"dynamic"``, a number (static), a
    :class:`LossScale` (its own settings), or ``None`` (dynamic for float16
    gradients, none otherwise)."""
    if isinstance(value, LossScale):
        return value
    if value is None:
        return LossScale() if reduce is not None and reduce == np.float16 else None
    if isinstance(value, str):
        if value.strip().lower() != "dynamic":
            raise ValueError(f"loss_scale must be 'dynamic', a number or None, got {value!r:.60}")
        return LossScale()
    scale = finite_real("loss_scale", value, positive=True, kind="'dynamic', a number or None")
    return LossScale(init=scale, dynamic=False)


#: How Adam rounds the model's copy: to nearest even, or stochastically (bfloat16).
ROUNDINGS = ("nearest", "stochastic")


def low_base(low: np.ndarray | None, stores: list[np.ndarray]) -> int:
    """The index of ``low``'s first element in the buffer (of ``stores``) it views; 0
    for ``None``."""
    if low is None:
        return 0
    for store in stores:
        start = store.ctypes.data
        if store.dtype == low.dtype and start <= low.ctypes.data <= start + store.nbytes:
            return (low.ctypes.data - start) // low.itemsize
    raise ValueError("a rounded copy outside the optimizer's buffers")


def precision_settings(
    masters: list[np.dtype], param_dtype: object, reduce_dtype: object, loss_scale: object,
    nonfinite: str, rounding: str = "nearest",
) -> tuple[dict[np.dtype, Precision], LossScale | None, tuple[object, ...]]:  # fmt: skip
    """Local validation of the optimizer's precision arguments: the
    :class:`Precision` per master dtype, the loss scale, and what every rank must
    agree on."""
    p_dt = resolve_dtype(param_dtype, "param_dtype")
    r_dt = resolve_dtype(reduce_dtype, "reduce_dtype")
    scaler = loss_scale_of(loss_scale, r_dt)
    if scaler is not None and scaler.dynamic and nonfinite == "raise":
        raise ValueError(
            "nonfinite='raise' with dynamic loss scaling: an overflow is how the scale "
            "learns to come down; use nonfinite='skip' (the default)"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r:.60}")
    if rounding == "stochastic" and (p_dt is None or p_dt.name != "bfloat16"):
        raise ValueError(
            "rounding='stochastic' rounds a bfloat16 copy of the parameters: pass "
            f"param_dtype='bfloat16' (got {None if p_dt is None else p_dt.name})"
        )
    names = (*(d.name if d is not None else None for d in (p_dt, r_dt)), rounding)
    scale = None if scaler is None else (
        scaler.scale, scaler.dynamic, scaler.growth, scaler.backoff, scaler.growth_interval
    )  # fmt: skip
    return precisions(masters, p_dt, r_dt), scaler, (*names, scale)
