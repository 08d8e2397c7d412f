"""SGD with momentum as an update rule: torch's ``SGD`` (Sutskever et al. 2013 for
the momentum form; Nesterov as torch writes it), per element::

    g  = grad / divisor
    g += wd * p                                 (L2, decoupled_weight_decay=False)
    b  = g  at step 1, else  momentum * b + (1 - dampening) * g
    g  = g + momentum * b  (nesterov)  or  b    (momentum > 0)
    p -= lr * wd * p                            (decoupled_weight_decay=True)
    p -= lr * g

One state, ``momentum_buffer`` (held even with ``momentum=0``, where it stays
unused: a schedule may not start momentum later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adam import finite_real
from ..buffers import StateKind
from .base import Rule, blocks, compiled, kernel_blocks, write_low
from .base import kernels as _kernels


@dataclass(frozen=True)
class SGDConfig:
    """Hyperparameters of SGD, validated on construction."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            object.__setattr__(self, name, finite_real(name, getattr(self, name)))
        for name in ("lr", "momentum", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.dampening <= 1.0:
            raise ValueError(f"dampening must be in [0, 1], got {self.dampening!r}")
        for name in ("nesterov", "decoupled"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "nesterov=True needs momentum > 0 and dampening=0, got "
                f"momentum={self.momentum!r}, dampening={self.dampening!r}"
            )


class SGD(Rule):
    name = "sgd"
    states = (StateKind("momentum_buffer"),)
    settings = ("lr", "momentum", "dampening", "weight_decay")
    reads = ("momentum", "dampening", "nesterov")

    def base(self, config: Any) -> SGDConfig:
        return SGDConfig(config.lr, config.momentum, config.dampening, config.nesterov,
                         config.weight_decay, config.decoupled_weight_decay)  # fmt: skip

    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> None:  # fmt: skip
        c = config
        (buf,) = states
        variant = compiled(self.kernel, self.variant, param, grad, buf)
        if variant is not None:  # the fused C loop, the same bits; blocks for the copy
            for lo, hi in kernel_blocks(param.shape[0], scratch, low):
                _kernels().sgd(param[lo:hi], grad[lo:hi], buf[lo:hi], c.lr, c.momentum,
                               c.dampening, c.nesterov, c.weight_decay, c.decoupled,
                               step == 1, float(divisor), variant=variant or None)  # fmt: skip
                write_low(param[lo:hi], None if low is None else low[lo:hi], stochastic, lo)
            return
        for lo, hi in blocks(param.shape[0], scratch.shape[0]):
            p, g, b, t = param[lo:hi], grad[lo:hi], buf[lo:hi], scratch[: hi - lo]
            if divisor != 1.0:
                np.divide(g, divisor, out=g)
            if c.weight_decay and not c.decoupled:
                np.multiply(p, c.weight_decay, out=t)
                np.add(g, t, out=g)
            if c.momentum:
                if step == 1:
                    np.copyto(b, g)
                else:
                    np.multiply(b, c.momentum, out=b)
                    if c.dampening:
                        np.multiply(g, 1.0 - c.dampening, out=t)
                        np.add(b, t, out=b)
                    else:
                        np.add(b, g, out=b)
            step_of = g  # what the parameter moves along: g, or b with plain momentum
            if c.momentum:
                if c.nesterov:
                    np.multiply(b, c.momentum, out=t)
                    np.add(g, t, out=g)
                else:
                    step_of = b
            if c.weight_decay and c.decoupled:
                np.multiply(p, c.lr * c.weight_decay, out=t)
                np.subtract(p, t, out=p)
            np.multiply(step_of, c.lr, out=t)
            np.subtract(p, t, out=p)
            write_low(p, None if low is None else low[lo:hi], stochastic, lo)

    def as_group(self, config: Any) -> dict[str, Any]:
        return {**super().as_group(config), "nesterov": config.nesterov}


SGD_RULE = SGD()
