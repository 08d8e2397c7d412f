"""A plain, unsharded Adam/AdamW: the yardstick every sharded result is checked against.

Written from the papers, one parameter at a time, with no buffers, blocks or MPI:
Kingma & Ba (2015), Algorithm 1 (bias-corrected moments), and Loshchilov & Hutter
(2019), Algorithm 2 (decoupled weight decay; schedule multiplier = lr, as in torch's
``AdamW``). Without decoupling, weight decay is the classic L2 term added to the
gradient. Gradient accumulation follows the reference's ``GradientBuffer``: summed
micro-batch gradients are divided by their count when there is more than one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


def average(grads: Iterable[np.ndarray]) -> np.ndarray:
    """The reference's ``get_accumulated``: the sum, divided by the count if > 1."""
    grads = list(grads)
    total = grads[0].copy()
    for g in grads[1:]:
        total = total + g
    return total / len(grads) if len(grads) > 1 else total


class ReferenceAdam:
    """Adam/AdamW over a dict of full (unsharded) arrays, updated in place."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
    ) -> None:
        self.params = {name: np.array(p, copy=True) for name, p in params.items()}
        self.lr, self.eps, self.wd = float(lr), float(eps), float(weight_decay)
        self.b1, self.b2 = float(betas[0]), float(betas[1])
        self.decoupled = decoupled_weight_decay
        self.exp_avg = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        self.t += 1
        b1, b2, lr, eps, wd = self.b1, self.b2, self.lr, self.eps, self.wd
        for name, p in self.params.items():
            g = grads[name]
            if wd and not self.decoupled:
                g = g + wd * p
            m = b1 * self.exp_avg[name] + (1.0 - b1) * g
            v = b2 * self.exp_avg_sq[name] + (1.0 - b2) * (g * g)
            m_hat = m / (1.0 - b1**self.t)
            v_hat = v / (1.0 - b2**self.t)
            update = m_hat / (np.sqrt(v_hat) + eps)
            if wd and self.decoupled:
                update = update + wd * p
            self.params[name] = p - lr * update
            self.exp_avg[name], self.exp_avg_sq[name] = m, v
