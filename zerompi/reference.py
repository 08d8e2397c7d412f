"""Plain, unsharded optimizers: the yardsticks every sharded result is checked against.

Written from the papers, one parameter at a time, with no buffers, blocks or MPI:

* :class:`ReferenceAdam`: Kingma & Ba (2015), Algorithm 1 (bias-corrected moments),
  and Loshchilov & Hutter (2019), Algorithm 2 (decoupled weight decay; schedule
  multiplier = lr, as in torch's ``AdamW``). Without decoupling, weight decay is the
  classic L2 term added to the gradient.
* :class:`ReferenceAdam8bit`: the same with its moments stored in 8 bits per element
  and a scale per block (Dettmers et al. 2022; :mod:`zerompi.quant`).
* :class:`ReferenceSGD`: SGD with momentum as Sutskever et al. (2013) write it in the
  form torch's ``SGD`` uses (the buffer starts as the first gradient; dampening;
  Nesterov as ``g + momentum * b``); weight decay L2, or decoupled (``p -= lr * wd *
  p``, Loshchilov & Hutter's SGDW).
* :class:`ReferenceLion`: Chen et al. (2023), Algorithm 2: the sign of an
  interpolation of the momentum and the gradient, decoupled weight decay.

Each keeps its states in ``states`` (state name -> parameter name -> array), named as
the sharded optimizer names them. Gradient accumulation follows the reference's
``GradientBuffer``: summed micro-batch gradients are divided by their count when there
is more than one.
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

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


class ReferenceAdam8bit(ReferenceAdam):
    """Adam/AdamW with 8-bit blockwise states (Dettmers et al. 2022, block-wise
    quantization, :mod:`zerompi.quant`): each step dequantizes the moments, takes
    Adam's step in float32 in Kingma & Ba's efficient form
    (:func:`zerompi.quant.adam8_math`: the bias corrections folded into the step size
    and epsilon; the parameters are updated with these float32 moments), and stores
    the new moments quantized, the first as E4M3 with a sign, the second as E5M3.
    Blocks are cut from the start of the float32 parameters laid end to end in
    ``order`` (default: the mapping's), as the sharded optimizer lays them out;
    ``exp_avg``/``exp_avg_sq`` hold the dequantized values, ``quantized`` the bytes
    and the scales."""

    def __init__(
        self, params: Mapping[str, np.ndarray], *, block: int = 256,
        order: Iterable[str] | None = None, **adam: object,
    ) -> None:  # fmt: skip
        super().__init__(params, **adam)  # type: ignore[arg-type]
        from . import quant

        self.quant, self.block = quant, block
        #: Per parameter, settings that differ from the optimizer's (a parameter
        #: group's: ``lr``, ``betas``, ``eps``, ``weight_decay``), changeable between
        #: steps (a schedule).
        self.overrides: dict[str, dict[str, object]] = {}
        self.order = list(self.params) if order is None else list(order)
        bad = [n for n in self.order if self.params[n].dtype != np.float32]
        if bad or sorted(self.order) != sorted(self.params):
            raise ValueError(f"8-bit states need float32 parameters, in one order: {bad}")
        n = sum(self.params[name].size for name in self.order)
        blocks = quant.blocks_of(0, n, block)[1]
        self.quantized = {  # codes 0 and scales 0 (each value 0), as a fresh buffer
            "exp_avg": (np.zeros(n, np.uint8), np.zeros(blocks, np.float32)),
            "exp_avg_sq": (np.zeros(n, np.uint8), np.zeros(blocks, np.float32)),
        }

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        """The stored states as ``optimizer="adam8bit"`` names them: the codes per
        parameter, the scales of the flat float32 parameters' blocks."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for label, (q, scales) in self.quantized.items():
            at, codes = 0, {}
            for name in self.order:
                size = self.params[name].size
                codes[name] = q[at : at + size].reshape(self.params[name].shape)
                at += size
            out[f"{label}_codes"] = {n: codes[n] for n in self.params}
            out[f"{label}_scales"] = {"float32": scales}
        return out

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        from .adam import AdamConfig

        self.t += 1
        base = {"lr": self.lr, "betas": (self.b1, self.b2), "eps": self.eps,
                "weight_decay": self.wd}  # fmt: skip
        for name in self.order:  # from the dequantized moments, in float32
            s = {**base, **self.overrides.get(name, {})}
            b1, b2 = s["betas"]  # type: ignore[misc]
            config = AdamConfig(s["lr"], b1, b2, s["eps"], s["weight_decay"],  # type: ignore[arg-type]
                                self.decoupled)  # fmt: skip
            p = self.params[name]
            arrays = (p, grads[name], self.exp_avg[name], self.exp_avg_sq[name])
            flat = [np.array(a, np.float32).reshape(-1) for a in arrays]
            self.quant.adam8_math(*flat, self.t, config)
            self.params[name] = flat[0].reshape(p.shape)
            m, v = (a.reshape(p.shape) for a in flat[2:])
            self.exp_avg[name], self.exp_avg_sq[name] = m, v
        for label, codes in (("exp_avg", self.quant.SIGNED),
                             ("exp_avg_sq", self.quant.UNSIGNED)):  # fmt: skip
            moments = getattr(self, label)
            flat = np.concatenate([moments[name].ravel() for name in self.order])
            q, scales = self.quantized[label]
            scales[...] = self.quant.block_max(flat, 0, self.block)
            self.quant.quantize(flat, 0, scales, codes, q, self.block)
            self.quant.dequantize(q, 0, scales, codes, flat, self.block)
            at = 0
            for name in self.order:
                size = self.params[name].size
                moments[name] = flat[at : at + size].reshape(self.params[name].shape)
                at += size


class ReferenceSGD:
    """SGD with momentum over a dict of full arrays."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        *,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
    ) -> None:
        self.params = {name: np.array(p, copy=True) for name, p in params.items()}
        self.lr, self.momentum, self.dampening = float(lr), float(momentum), float(dampening)
        self.nesterov, self.wd = nesterov, float(weight_decay)
        self.decoupled = decoupled_weight_decay
        self.momentum_buffer = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        self.t += 1
        mu, lr, wd = self.momentum, self.lr, self.wd
        for name, p in self.params.items():
            g = grads[name]
            if wd and not self.decoupled:
                g = g + wd * p
            if mu:
                if self.t == 1:
                    b = g.copy()
                elif self.dampening:
                    b = mu * self.momentum_buffer[name] + (1.0 - self.dampening) * g
                else:
                    b = mu * self.momentum_buffer[name] + g
                self.momentum_buffer[name] = b
                g = g + mu * b if self.nesterov else b
            if wd and self.decoupled:
                p = p - (lr * wd) * p
            self.params[name] = p - lr * g

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        return {"momentum_buffer": self.momentum_buffer}


class ReferenceLion:
    """Lion over a dict of full arrays."""

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        self.params = {name: np.array(p, copy=True) for name, p in params.items()}
        self.lr, self.wd = float(lr), float(weight_decay)
        self.b1, self.b2 = float(betas[0]), float(betas[1])
        self.exp_avg = {n: np.zeros_like(p) for n, p in self.params.items()}

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        b1, b2, lr, wd = self.b1, self.b2, self.lr, self.wd
        for name, p in self.params.items():
            g, m = grads[name], self.exp_avg[name]
            update = np.sign(b1 * m + (1.0 - b1) * g)
            if wd:
                update = update + wd * p
            self.params[name] = p - lr * update
            self.exp_avg[name] = b2 * m + (1.0 - b2) * g

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        return {"exp_avg": self.exp_avg}


class ReferenceAdafactor:
    """Adafactor (Shazeer & Stern 2018, Algorithms 4 and 5, as ``torch.optim.Adafactor``
    computes them) over a dict of full arrays: factored second moments for each
    matrix (the last two dimensions of a parameter with two or more), one per element
    for the others, relative step size, update clipping, decoupled weight decay.
    ``states``: the rows' and columns' states of every matrix and the vectors'
    states, each flat by dtype name in the parameters' order, as
    ``optimizer="adafactor"`` lays them out. The sums over whole parameters are
    float64, added over pieces of 65536 elements in order
    (:func:`zerompi.rules.adafactor.chunks`, :func:`~zerompi.rules.adafactor.rects`),
    each in a fixed order (:func:`zerompi.rules.adafactor.sumsq_numpy`), as the
    optimizer adds them; ``V = (R / max(mean(R), eps1)) C^T``, the optimizer's order
    (torch divides the outer product ``R C^T``: within an ulp)."""

    def __init__(
        self, params: Mapping[str, np.ndarray], *, lr: float = 1e-2, beta2_decay: float = -0.8,
        eps1: float | None = None, eps2: float = 1e-3, d: float = 1.0,
        weight_decay: float = 0.0,
    ) -> None:  # fmt: skip
        self.params = {name: np.array(p, copy=True) for name, p in params.items()}
        self.lr, self.beta2_decay, self.eps1, self.eps2 = lr, beta2_decay, eps1, eps2
        self.d, self.wd = d, weight_decay
        #: Per parameter, settings that differ (a parameter group's), changeable.
        self.overrides: dict[str, dict[str, float]] = {}
        self.rows: dict[str, np.ndarray] = {}
        self.cols: dict[str, np.ndarray] = {}
        self.vectors: dict[str, np.ndarray] = {}
        for name, p in self.params.items():
            if p.ndim >= 2:
                stack = p.reshape(-1, p.shape[-2], p.shape[-1]).shape
                self.rows[name] = np.zeros(stack[:2], p.dtype)
                self.cols[name] = np.zeros((stack[0], stack[2]), p.dtype)
            else:
                self.vectors[name] = np.zeros(p.shape, p.dtype)
        self.t = 0

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        import math

        self.t += 1
        t = float(self.t)
        for name, p in self.params.items():
            s = {"lr": self.lr, "beta2_decay": self.beta2_decay, "eps1": self.eps1,
                 "eps2": self.eps2, "d": self.d, "weight_decay": self.wd,
                 **self.overrides.get(name, {})}  # fmt: skip
            dt = p.dtype.type
            g = np.asarray(grads[name], p.dtype).reshape(-1)
            x = p.reshape(-1).copy()
            eps1 = s["eps1"] if s["eps1"] is not None else float(np.finfo(p.dtype).eps)
            w, keep = dt(t ** s["beta2_decay"]), dt(1.0 - t ** s["beta2_decay"])
            alpha = max(s["eps2"], math.sqrt(self._sumsq(x) / x.size)) * min(
                s["lr"], 1.0 / math.sqrt(t))  # fmt: skip
            if s["weight_decay"]:
                x *= dt(1.0 - s["lr"] * s["weight_decay"])
            if p.ndim >= 2:
                n, m = p.shape[-2], p.shape[-1]
                g3 = g.reshape(-1, n, m)
                row_sq, col_sq = self._factored_sums(g, n, m)
                rows, cols = self.rows[name], self.cols[name]
                rows[...] = rows * keep + (row_sq / m).astype(p.dtype) * w
                cols[...] = cols * keep + (col_sq / n).astype(p.dtype) * w
                u = np.empty_like(g3)
                for k in range(g3.shape[0]):
                    denom = max(dt(np.mean(rows[k])), dt(eps1))
                    v = np.outer(rows[k] / denom, cols[k])
                    u[k] = g3[k] / np.sqrt(np.maximum(v, dt(eps1 * eps1)))
                u = u.reshape(-1)
            else:
                vec = self.vectors[name].reshape(-1)
                vec[...] = vec * keep + (g * g) * w
                u = g / np.sqrt(np.maximum(vec, dt(eps1 * eps1)))
            rms_u = math.sqrt(self._sumsq(u) / u.size)
            x += u * dt(-alpha / max(1.0, rms_u / s["d"]))
            self.params[name] = x.reshape(p.shape)

    @staticmethod
    def _sumsq(x: np.ndarray) -> float:
        """``sum(x^2)`` in float64: over pieces of 65536 elements, each summed in
        :func:`zerompi.rules.adafactor.sumsq_numpy`'s order, in turn."""
        from .rules.adafactor import chunks, sumsq_numpy

        total = 0.0
        for a, b in chunks(0, x.size):
            total += sumsq_numpy(x[a:b])
        return total

    @staticmethod
    def _factored_sums(g: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The float64 sums of ``G^2`` of every row and column of each ``n x m``
        matrix of the flat ``g``: over the rectangles of
        :func:`zerompi.rules.adafactor.rects` (at most 65536 elements, or one row), each
        summed as :func:`zerompi.rules.adafactor.rect_sums` sums, added in turn."""
        from .rules.adafactor import rect_sums, rects

        count = g.size // (n * m)
        rows, cols = np.zeros((count, n)), np.zeros((count, m))
        for k, i0, i1, j0, j1, at in rects(0, g.size, n, m):
            row_sums, col_sums = rect_sums(g[at : at + (i1 - i0) * (j1 - j0)], i1 - i0, "numpy")
            rows[k, i0:i1] += row_sums
            cols[k, j0:j1] += col_sums
        return rows, cols

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        """The states as ``optimizer="adafactor"``'s ``gather_state`` gives them: flat
        by dtype name, in the parameters' order."""
        out: dict[str, dict[str, list[np.ndarray]]] = {
            "exp_avg_sq_row": {}, "exp_avg_sq_col": {}, "exp_avg_sq": {}}  # fmt: skip
        for name, p in self.params.items():
            d = p.dtype.name
            for label, table in (("exp_avg_sq_row", self.rows), ("exp_avg_sq_col", self.cols),
                                 ("exp_avg_sq", self.vectors)):  # fmt: skip
                out[label].setdefault(d, [])
                if name in table:
                    out[label][d].append(table[name].reshape(-1))
        return {label: {d: np.concatenate(parts) if parts else np.zeros(0, d)
                        for d, parts in by.items()} for label, by in out.items()}  # fmt: skip


class ReferenceMuon:
    """Muon (Keller Jordan 2024) over a dict of full arrays: the momentum of every
    matrix (two or more dimensions, seen as ``(shape[0], rest)``) not in ``adamw``
    orthogonalized by the quintic Newton-Schulz iteration, scaled by
    ``max(1, rows / cols)^0.5`` (or ``match_rms * sqrt(max(rows, cols))``, Moonlight),
    ``W = W (1 - lr wd) - lr O``; the other parameters with AdamW
    (:class:`ReferenceAdam`'s arithmetic, decoupled decay). ``overrides`` per
    parameter as :class:`ReferenceAdam8bit`'s."""

    def __init__(
        self, params: Mapping[str, np.ndarray], *, lr: float = 0.02, momentum: float = 0.95,
        nesterov: bool = True, ns_steps: int = 5, match_rms: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
        weight_decay: float = 0.0, adamw: Iterable[str] = (),
    ) -> None:  # fmt: skip
        self.params = {name: np.array(p, copy=True) for name, p in params.items()}
        self.settings = {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                         "ns_steps": ns_steps, "match_rms": match_rms, "betas": betas,
                         "eps": eps, "weight_decay": weight_decay}  # fmt: skip
        self.adamw = set(adamw)
        self.overrides: dict[str, dict[str, object]] = {}
        self.exp_avg = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.t = 0

    @staticmethod
    def orthogonalize(u: np.ndarray, steps: int) -> np.ndarray:
        """The quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315)
        on ``u / (|u|_F + 1e-7)``, transposed to the wide side."""
        dt = u.dtype.type
        a, b, c = dt(3.4445), dt(-4.7750), dt(2.0315)
        tall = u.shape[0] > u.shape[1]
        x = u.T if tall else u
        x = x / (np.linalg.norm(x) + dt(1e-7))
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * (gram @ gram)) @ x
        return x.T if tall else x

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        self.t += 1
        for name, p in self.params.items():
            s = {**self.settings, **self.overrides.get(name, {})}
            dt = p.dtype.type
            g = np.array(grads[name], p.dtype)
            if p.ndim >= 2 and name not in self.adamw:
                m = self.exp_avg[name]
                m += (g - m) * dt(1.0 - s["momentum"])  # type: ignore[operator]
                u = g + (m - g) * dt(s["momentum"]) if s["nesterov"] else m.copy()  # type: ignore[arg-type]
                rows, cols = p.shape[0], p.size // p.shape[0]
                o = self.orthogonalize(u.reshape(rows, cols), int(s["ns_steps"]))  # type: ignore[call-overload]
                scale = (s["match_rms"] * max(rows, cols) ** 0.5 if s["match_rms"]  # type: ignore[operator]
                         else max(1.0, rows / cols) ** 0.5)  # fmt: skip
                o = o * dt(scale)
                x = p.copy()
                if s["weight_decay"]:
                    x *= dt(1.0 - s["lr"] * s["weight_decay"])  # type: ignore[operator]
                x += o.reshape(p.shape) * dt(-s["lr"])  # type: ignore[operator]
                self.params[name] = x
                continue
            b1, b2 = s["betas"]  # type: ignore[misc]
            adam = ReferenceAdam({name: p}, lr=s["lr"], betas=(b1, b2), eps=s["eps"],  # type: ignore[arg-type]
                                 weight_decay=s["weight_decay"],  # type: ignore[arg-type]
                                 decoupled_weight_decay=True)  # fmt: skip
            adam.exp_avg[name], adam.exp_avg_sq[name] = self.exp_avg[name], self.exp_avg_sq[name]
            adam.t = self.t - 1
            adam.step({name: g})
            self.params[name] = adam.params[name]
            self.exp_avg[name], self.exp_avg_sq[name] = adam.exp_avg[name], adam.exp_avg_sq[name]

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
