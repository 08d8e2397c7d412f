"""Adam/AdamW as an update rule: the fused kernel of :mod:`zerompi.adam` (Kingma & Ba
2015; Loshchilov & Hutter 2019 with ``decoupled_weight_decay=True``), called as it
was before rules existed: the rule adds no work to the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..adam import AdamConfig, adam_step
from ..buffers import StateKind
from .base import Rule


def betas_of(config: Any, default: tuple[float, float]) -> tuple[float, float]:
    """``config.betas`` (``None``: the rule's ``default``) as a checked pair."""
    betas = default if config.betas is None else config.betas
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return b1, b2


class Adam(Rule):
    name = "adam"
    states = (StateKind("exp_avg"), StateKind("exp_avg_sq"))
    settings = ("lr", "beta1", "beta2", "eps", "weight_decay")
    reads = ("betas", "eps")

    def base(self, config: Any) -> AdamConfig:
        b1, b2 = betas_of(config, (0.9, 0.999))
        return AdamConfig(config.lr, b1, b2, config.eps, config.weight_decay,
                          config.decoupled_weight_decay)  # fmt: skip

    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> None:  # fmt: skip
        exp_avg, exp_avg_sq = states
        adam_step(param, grad, exp_avg, exp_avg_sq, step, config, scratch, divisor, low=low,
                  stochastic=stochastic)  # fmt: skip

    def token(self, config: Any) -> tuple[Any, ...]:
        c = config
        return (c.lr, c.beta1, c.beta2, c.eps, c.weight_decay)


ADAM = Adam()
