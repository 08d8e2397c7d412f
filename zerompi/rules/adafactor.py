"""Adafactor as an update rule (Shazeer & Stern, "Adafactor: Adaptive Learning Rates
with Sublinear Memory Cost", ICML 2018, Algorithms 4 and 5; in the form of
``torch.optim.Adafactor``): the second moment of a matrix (the last two dimensions of
a parameter with two or more) is factored into a state per row and a state per column,
``n + m`` numbers for ``n * m`` elements; a parameter with fewer dimensions keeps one
per element. No first moment. Per step ``t`` and parameter ``X``::

    beta2_t = 1 - t^beta2_decay                     rho_t = min(lr, 1 / sqrt(t))
    alpha_t = max(eps2, RMS(X)) * rho_t              X *= 1 - lr * weight_decay
    R = beta2_t R + (1 - beta2_t) mean_j(G^2)        C = beta2_t C + (1 - beta2_t) mean_i(G^2)
    V = R C^T / max(mean(R), eps1)                   (a vector: V = beta2_t V + (1 - beta2_t) G^2)
    U = G / sqrt(max(V, eps1^2))                     X -= alpha_t U / max(1, RMS(U) / d)

A matrix is cut across shards by the flat layout, so its rows' and columns' sums of
``G^2``, and every parameter's ``RMS(X)`` and ``RMS(U)``, are sums over ranks: each
rank adds what it counts (:class:`zerompi.rules.base.Piece`) in float64, and two small
allreduces (:meth:`Adafactor.before`) give every rank the same totals. Each rank then
holds, for every matrix its part touches, all of its rows' and columns' states
(:mod:`zerompi.blockwise`: ``per="row"`` and ``"column"``) and updates them alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adam import finite_real
from ..buffers import StateKind
from ..partition import gaps
from .base import Piece, Rule, World, blocks, compiled, write_low
from .base import kernels as _kernels

#: Elements a temporary of the step holds at most: a parameter is processed in pieces
#: cut at the multiples of this many of its elements (:func:`chunks`), whatever part
#: of it a rank holds, so that one rank adds its sums in the reference's order.
CHUNK = 1 << 16


def chunks(a: int, b: int) -> Iterator[tuple[int, int]]:
    """Elements ``a ... b`` of a parameter in pieces of at most :data:`CHUNK`, cut at
    its multiples of :data:`CHUNK`."""
    for k in range(a // CHUNK, -(-b // CHUNK)):
        yield max(a, k * CHUNK), min(b, (k + 1) * CHUNK)


#: Partial sums a sum of squares keeps (the compiled loop's vector lanes).
LANES = 16


def sumsq(x: np.ndarray, kernel: str | None = None, variant: str | None = None) -> float:
    """``sum(x^2)`` in float64 in one fixed order (:func:`sumsq_numpy`'s), from the
    compiled loop where there is one (``kernel``/``variant``: the rule's)."""
    chosen = compiled(kernel, variant, x)
    if chosen is not None:
        return float(_kernels().grad_stats(x, variant=chosen or None)[1])
    return sumsq_numpy(x)


def sumsq_numpy(x: np.ndarray) -> float:
    """``sum(x^2)`` in float64: :data:`LANES` partial sums over the whole groups of
    :data:`LANES` elements (lane ``l`` adds elements ``l, l + LANES, ...`` in turn),
    then the elements after them one by one, then the lanes in order: the compiled
    loop's order (``grad_stats``), so both give the same bits. ``x`` is at most
    :data:`CHUNK` long (the float64 copy)."""
    sq = x.astype(np.float64)
    np.multiply(sq, sq, out=sq)
    whole = sq.shape[0] - sq.shape[0] % LANES
    total = 0.0
    for value in sq[whole:].tolist():
        total += value
    if whole:
        for value in sq[:whole].reshape(-1, LANES).sum(axis=0).tolist():
            total += value
    return total


def rect_sums(g: np.ndarray, rows: int, kernel: str | None = None, variant: str | None = None,
              divisor: float | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The float64 sums of the squares of each row (in :func:`sumsq_numpy`'s order)
    and of each column (row after row) of a rectangle: ``g`` flat, ``rows`` rows.
    With ``divisor``, the sums are those of the quotients ``g / divisor`` (in ``g``'s
    dtype); ``g`` is only read (:func:`rect_u` divides it again where it writes U)."""
    w = g.shape[0] // rows
    chosen = compiled(kernel, variant, g)
    if chosen is not None:
        row_sums, col_sums = np.empty(rows), np.empty(w)
        _kernels().af_sums(g, rows, row_sums, col_sums, divisor=divisor, variant=chosen or None)
        return row_sums, col_sums
    if divisor is not None:
        g = g / g.dtype.type(divisor)
    sq = g.astype(np.float64).reshape(rows, w)
    np.multiply(sq, sq, out=sq)
    whole = w - w % LANES
    row_sums = np.zeros(rows)
    for j in range(whole, w):
        row_sums += sq[:, j]
    if whole:
        lanes = sq[:, :whole].reshape(rows, -1, LANES).sum(axis=1)
        for lane in range(LANES):
            row_sums += lanes[:, lane]
    return row_sums, sq.sum(axis=0)


def rect_u(g: np.ndarray, r: np.ndarray, c: np.ndarray, denom: Any, floor: Any,
           kernel: str | None = None, variant: str | None = None,
           divisor: float | None = None) -> None:  # fmt: skip
    """``U = (G / divisor) / sqrt(max((r / denom) c^T, floor))`` of a rectangle (``g``
    flat, row-major, ``len(r)`` rows of ``len(c)``), in place, in ``g``'s dtype (no
    ``divisor``: ``G``). ``r / denom`` once per row, so an element takes one division
    and one square root, where ``(r c^T) / denom`` took two divisions."""
    chosen = compiled(kernel, variant, g, r, c)
    if chosen is not None:
        _kernels().af_u(g, r, c, float(denom), float(floor), divisor=divisor,
                        variant=chosen or None)  # fmt: skip
        return
    if divisor is not None:
        np.divide(g, g.dtype.type(divisor), out=g)
    v = np.outer(r / denom, c)
    np.maximum(v, floor, out=v)
    np.sqrt(v, out=v)
    g2 = g.reshape(v.shape)
    np.divide(g2, v, out=g2)


def apply(p: np.ndarray, u: np.ndarray, decay: Any, scale: Any, kernel: str | None = None,
          variant: str | None = None) -> None:  # fmt: skip
    """``p = p * decay + u * scale`` in place (``decay`` None: ``p + u * scale``), in
    ``p``'s dtype (``decay`` and ``scale`` of it): the compiled loop, or numpy over
    pieces of :data:`CHUNK`."""
    chosen = compiled(kernel, variant, p, u)
    if chosen is not None:
        _kernels().af_apply(p, u, None if decay is None else float(decay), float(scale),
                            variant=chosen or None)  # fmt: skip
        return
    for lo, hi in blocks(p.shape[0], CHUNK):
        part = p[lo:hi]
        if decay is not None:
            part *= decay
        part += u[lo:hi] * scale


@dataclass(frozen=True)
class AdafactorConfig:
    """Hyperparameters of Adafactor, validated on construction (``eps1=None``: the
    dtype's machine epsilon, as torch's)."""

    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps1: float | None = None
    eps2: float = 1e-3
    d: float = 1.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "beta2_decay", "eps2", "d", "weight_decay"):
            object.__setattr__(self, name, finite_real(name, getattr(self, name)))
        if self.eps1 is not None:
            object.__setattr__(self, "eps1", finite_real("eps1", self.eps1))
        for name in ("lr", "eps2", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.eps1 is not None and self.eps1 < 0:
            raise ValueError(f"eps1 must be >= 0 or None, got {self.eps1!r}")
        if self.beta2_decay > 0:
            raise ValueError(f"beta2_decay must be <= 0, got {self.beta2_decay!r}")
        if self.d < 1:
            raise ValueError(f"d (the update clipping threshold) must be >= 1, got {self.d!r}")


def rects(a: int, b: int, n: int, m: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Elements ``a ... b`` of a stack of ``n x m`` matrices laid out row-major, as
    rectangles ``(k, i0, i1, j0, j1, at)``: matrix ``k``, rows ``i0 ... i1``, columns
    ``j0 ... j1`` (a part of one row, or whole rows, at most :data:`CHUNK` elements),
    ``at`` the first element's index counted from ``a``."""
    pos = a
    while pos < b:
        k, within = divmod(pos, n * m)
        i, j = divmod(within, m)
        end = min(b, (k + 1) * n * m)
        if j or end - pos < m:  # a part of a row
            stop = min(end, pos - j + m)
            yield k, i, i + 1, j, j + (stop - pos), pos - a
            pos = stop
            continue
        rows = min((end - pos) // m, max(1, CHUNK // m))
        yield k, i, i + rows, 0, m, pos - a
        pos += rows * m


class _Matrix:
    """One matrix of the stack of a parameter, on this rank: its rows' and columns'
    states (views of the rank's buffers) and, after :meth:`Adafactor.before`, the
    mean of its rows' state."""

    __slots__ = ("cols", "mean", "rows")

    def __init__(self, rows: np.ndarray, cols: np.ndarray) -> None:
        self.rows, self.cols = rows, cols
        self.mean = rows.dtype.type(0.0)


@dataclass
class _Tensor:
    """A parameter this rank updates part of, for the step: its shape, where its
    elements and its states are, its group's config, and its step sizes."""

    offset: int
    size: int
    shape: tuple[int, ...]
    config: AdafactorConfig
    matrices: list[_Matrix | None]  # by index in the stack (None: not on this rank)
    vector: np.ndarray | None  # a vector's per-element state over the rank's part
    vector_at: int  # the global element of vector[0]
    dtype: str = "float32"
    alpha: float = 0.0
    scale: float = 0.0  # -alpha / max(1, RMS(U) / d)
    #: The first matrix of the stack on this rank, and the rows' and columns' states
    #: of it and those after it (``matrices[k0:]``'s, one after the other)
    k0: int = 0
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    #: Per matrix from ``k0``, ``max(mean of its rows' state, eps1)`` (after step 2)
    denoms: np.ndarray | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.dtype, self.offset


Tensors = dict[tuple[str, int], _Tensor]


class Adafactor(Rule):
    name = "adafactor"
    states = (
        StateKind("exp_avg_sq_row", per="row"),
        StateKind("exp_avg_sq_col", per="column"),
        StateKind("exp_avg_sq", per="vector"),
    )
    settings = ("lr", "beta2_decay", "eps1", "eps2", "d", "weight_decay")
    reads = ("beta2_decay", "eps1", "eps2", "d")
    prepares = True
    #: The gradient read three times (its rows' and columns' sums, then ``sum(U^2)``,
    #: then the update) and the parameters twice (``RMS(X)``, then the update): each
    #: pass needs sums over whole parameters that the one before it gave.
    rereads = 3

    def base(self, config: Any) -> AdafactorConfig:
        return AdafactorConfig(config.lr, config.beta2_decay, config.eps1, config.eps2,
                               config.d, config.weight_decay)  # fmt: skip

    def token(self, config: Any) -> tuple[Any, ...]:
        """Floats only (``hash(None)`` differs between processes before Python 3.12)."""
        c = config
        return (c.lr, c.beta2_decay, -1.0 if c.eps1 is None else c.eps1, c.eps2, c.d,
                c.weight_decay)  # fmt: skip

    def before(self, pieces: list[Piece], step: int, world: World) -> Tensors:
        """The statistics over whole parameters, in two allreduces: the rows' and
        columns' sums of ``G^2`` and ``sum(X^2)``, then ``sum(U^2)``; the rows' and
        columns' states and the vectors' updated on the way, and ``U`` written over
        the gradient (after dividing it by the divisor), which :meth:`update` reads.
        Returns the parameters this rank updates by offset."""
        params, reduce = world.layout.params, world.reduce
        kernel, variant = self.kernel, self.variant
        tensors: Tensors = {}
        for piece in pieces:
            tensors.update(_tensors(piece, params))
        # 1. rows' and columns' sums of G^2 (by the rank counting each element), sum(X^2);
        # the matrices' gradient is divided by the divisor where it is read (here for
        # the sums, in 3. where U is written over it), the rest of what the rank holds
        # (vectors) in place here
        layout = _Stats(params)
        first = np.zeros(layout.size, np.float64)
        for piece in pieces:
            # the compiled loops over each parameter's range in one call, or numpy's
            # over its pieces in Python: the same loops in the same order
            chosen = compiled(kernel, variant, piece.param, piece.grad)
            for t, lo, hi in _counted(piece, tensors):
                x = piece.param[lo - piece.offset : hi - piece.offset]
                if chosen is not None:
                    first[layout.sumsq[t.key]] = _kernels().sumsq_chunks(
                        x, lo - t.offset, CHUNK, first[layout.sumsq[t.key]],
                        variant=chosen or None)  # fmt: skip
                else:
                    for a, b in chunks(lo - t.offset, hi - t.offset):
                        at = a - (lo - t.offset)
                        first[layout.sumsq[t.key]] += sumsq(x[at : at + b - a], kernel, variant)
                if t.matrices:
                    n, m = t.shape[-2], t.shape[-1]
                    rows, cols = layout.rows[t.key], layout.cols[t.key]
                    g = piece.grad[lo - piece.offset : hi - piece.offset]
                    if chosen is not None:
                        stack = t.size // (n * m)
                        _kernels().af_sums_range(
                            g, lo - t.offset, n, m, CHUNK, first[rows : rows + stack * n],
                            first[cols : cols + stack * m], divisor=piece.divisor,
                            variant=chosen or None)  # fmt: skip
                        continue
                    for k, i0, i1, j0, j1, at in rects(lo - t.offset, hi - t.offset, n, m):
                        part = g[at : at + (i1 - i0) * (j1 - j0)]  # (a rectangle)
                        row_sums, col_sums = rect_sums(part, i1 - i0, kernel, variant,
                                                       piece.divisor)  # fmt: skip
                        first[rows + k * n + i0 : rows + k * n + i1] += row_sums
                        first[cols + k * m + j0 : cols + k * m + j1] += col_sums
            matrices = sorted((lo - piece.offset, hi - piece.offset)
                              for t, lo, hi in _held(piece, tensors) if t.matrices)  # fmt: skip
            for a, b in gaps(matrices, 0, piece.grad.shape[0]):
                np.divide(piece.grad[a:b], piece.divisor, out=piece.grad[a:b])
        reduce(first)
        # 2. the states of the rows, columns (every matrix this rank holds) and vectors
        for t in tensors.values():
            c = t.config
            dt = np.dtype(t.dtype).type
            w = dt(float(step) ** c.beta2_decay)  # 1 - beta2_t
            keep = dt(1.0 - float(step) ** c.beta2_decay)  # beta2_t
            if t.matrices:
                n, m = t.shape[-2], t.shape[-1]
                rows, cols = layout.rows[t.key], layout.cols[t.key]
                for k, mat in enumerate(t.matrices):
                    if mat is None:
                        continue  # (a matrix of the stack this rank does not touch)
                    row_mean = (first[rows + k * n : rows + (k + 1) * n] / m).astype(dt)
                    col_mean = (first[cols + k * m : cols + (k + 1) * m] / n).astype(dt)
                    mat.rows *= keep
                    mat.rows += row_mean * w
                    mat.cols *= keep
                    mat.cols += col_mean * w
                    mat.mean = dt(np.mean(mat.rows))
                eps1 = _eps1(c, dt)
                t.denoms = np.array([max(mat.mean, dt(eps1))  # type: ignore[union-attr]
                                     for mat in t.matrices[t.k0 :]], dt)  # fmt: skip
            rms_x = math.sqrt(first[layout.sumsq[t.key]] / t.size)
            t.alpha = max(c.eps2, rms_x) * min(c.lr, 1.0 / math.sqrt(step))
        for piece in pieces:  # the vectors' states over everything the rank updates
            for t, lo, hi in _held(piece, tensors):
                if t.vector is not None:
                    g = piece.grad[lo - piece.offset : hi - piece.offset]
                    v = t.vector[lo - t.vector_at : hi - t.vector_at]
                    c, dt = t.config, g.dtype.type
                    for a, b in blocks(hi - lo, CHUNK):
                        v[a:b] *= dt(1.0 - float(step) ** c.beta2_decay)
                        v[a:b] += (g[a:b] * g[a:b]) * dt(float(step) ** c.beta2_decay)
        # 3. U over everything the rank updates, over the gradient; sum(U^2) of what it
        # counts (the pieces of the counted elements are those of the held ones)
        second = np.zeros(len(layout.index), np.float64)
        for piece in pieces:
            c_lo, c_hi = piece.offset + piece.counted[0], piece.offset + piece.counted[1]
            chosen = compiled(kernel, variant, piece.param, piece.grad)
            for t, lo, hi in _held(piece, tensors):
                index = layout.index[t.key]
                if t.matrices and chosen is not None:
                    dt = piece.grad.dtype.type
                    eps1 = _eps1(t.config, dt)
                    second[index] = _kernels().af_u_range(
                        piece.grad[lo - piece.offset : hi - piece.offset], lo - t.offset,
                        t.shape[-2], t.shape[-1], t.rows, t.cols, t.denoms, t.k0,
                        float(dt(eps1 * eps1)), CHUNK, c_lo - t.offset, c_hi - t.offset,
                        second[index], divisor=piece.divisor, variant=chosen or None)  # fmt: skip
                    continue
                for a, b in chunks(lo - t.offset, hi - t.offset):
                    at = t.offset + a - piece.offset
                    self._u(t, piece.grad[at : at + b - a], t.offset + a, piece.divisor)
                    ca, cb = max(t.offset + a, c_lo), min(t.offset + b, c_hi)
                    if cb > ca:
                        counted = piece.grad[ca - piece.offset : cb - piece.offset]
                        second[index] += sumsq(counted, kernel, variant)
        reduce(second)
        for t in tensors.values():
            rms_u = math.sqrt(second[layout.index[t.key]] / t.size)
            t.scale = -t.alpha / max(1.0, rms_u / t.config.d)
        return tensors

    def _u(self, t: _Tensor, g: np.ndarray, first: int, divisor: float) -> None:
        """``U = G / sqrt(max(V, eps1^2))`` of elements ``first ...`` of the flat
        parameters (``g`` the gradient there, at most :data:`CHUNK` long: a matrix's
        summed, averaged here by ``divisor``; a vector's averaged already), in place."""
        dt = g.dtype.type
        eps1 = _eps1(t.config, dt)
        floor = dt(eps1 * eps1)
        if t.vector is not None:
            v = t.vector[first - t.vector_at : first - t.vector_at + g.shape[0]]
            d = np.maximum(v, floor)
            np.sqrt(d, out=d)
            np.divide(g, d, out=g)
            return
        n, m = t.shape[-2], t.shape[-1]
        for k, i0, i1, j0, j1, at in rects(first - t.offset, first - t.offset + g.shape[0], n, m):
            mat = t.matrices[k]
            denom = max(mat.mean, dt(eps1))
            rect_u(g[at : at + (i1 - i0) * (j1 - j0)], mat.rows[i0:i1], mat.cols[j0:j1], denom,
                   floor, self.kernel, self.variant, divisor)  # fmt: skip

    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> None:  # fmt: skip
        """``X = X * (1 - lr * weight_decay) + scale * U``, ``U`` in ``grad``
        (:meth:`before`)."""
        tensors: Tensors = context
        n = param.shape[0]
        dt = param.dtype.type
        for t in _overlapping(tensors, param.dtype, offset, offset + n):
            lo, hi = max(t.offset, offset) - offset, min(t.offset + t.size, offset + n) - offset
            c = t.config
            decay = dt(1.0 - c.lr * c.weight_decay) if c.weight_decay else None
            apply(param[lo:hi], grad[lo:hi], decay, dt(t.scale), self.kernel, self.variant)
        write_low(param, low, stochastic, 0)


class _Stats:
    """Where each parameter's sums go in the first allreduce's vector: its ``sum(X^2)``
    and, a matrix's, its rows' and columns' sums of ``G^2``; every parameter of the
    model in the layout's order, so the same vector on every rank. ``index``: each
    parameter's place in the second allreduce's (``sum(U^2)``)."""

    def __init__(self, params: Sequence[Any]) -> None:
        self.rows: dict[tuple[str, int], int] = {}
        self.cols: dict[tuple[str, int], int] = {}
        self.sumsq: dict[tuple[str, int], int] = {}
        self.index: dict[tuple[str, int], int] = {}
        at = 0
        for p in params:
            if p.size == 0:
                continue
            key = (np.dtype(p.dtype).name, p.offset)
            self.index[key] = len(self.index)
            self.sumsq[key] = at
            at += 1
            if len(p.shape) >= 2:
                n, m = p.shape[-2], p.shape[-1]
                k = p.size // (n * m)
                self.rows[key], self.cols[key] = at, at + k * n
                at += k * (n + m)
        self.size = at


def _tensors(piece: Piece, params: Sequence[Any]) -> dict[tuple[str, int], _Tensor]:
    """The parameters ``piece`` touches, with views of their states."""
    rows_state, cols_state, vector_state = piece.states
    n = piece.param.shape[0]
    out: dict[tuple[str, int], _Tensor] = {}
    dtype = piece.param.dtype.name
    at_rows = at_cols = at_vec = 0
    for p in params:
        if p.dtype != piece.param.dtype or p.size == 0:
            continue
        if p.offset + p.size <= piece.offset or p.offset >= piece.offset + n:
            continue
        config = next(c for start, stop, c in piece.segments
                      if start <= max(p.offset, piece.offset) - piece.offset < stop)  # fmt: skip
        lo, hi = max(p.offset, piece.offset), min(p.offset + p.size, piece.offset + n)
        if len(p.shape) >= 2:
            rn, rm = p.shape[-2], p.shape[-1]
            k0, k1 = (lo - p.offset) // (rn * rm), (hi - 1 - p.offset) // (rn * rm) + 1
            matrices: list[_Matrix | None] = [None] * k0
            rows = rows_state[at_rows : at_rows + (k1 - k0) * rn]
            cols = cols_state[at_cols : at_cols + (k1 - k0) * rm]
            for _ in range(k0, k1):
                matrices.append(_Matrix(rows_state[at_rows : at_rows + rn],
                                        cols_state[at_cols : at_cols + rm]))  # fmt: skip
                at_rows, at_cols = at_rows + rn, at_cols + rm
            out[(dtype, p.offset)] = _Tensor(p.offset, p.size, tuple(p.shape), config,
                                             matrices, None, 0, dtype, k0=k0, rows=rows,
                                             cols=cols)  # fmt: skip
        else:
            vec = vector_state[at_vec : at_vec + hi - lo]
            at_vec += hi - lo
            out[(dtype, p.offset)] = _Tensor(p.offset, p.size, tuple(p.shape), config, [],
                                             vec, lo, dtype)  # fmt: skip
    return out


def _eps1(config: AdafactorConfig, dt: Any) -> float:
    """``eps1``, by default the machine epsilon of the parameters' dtype ``dt``."""
    return config.eps1 if config.eps1 is not None else float(np.finfo(dt).eps)


def _overlapping(tensors: Tensors, dtype: np.dtype, lo: int, hi: int) -> Iterator[_Tensor]:
    name = dtype.name  # (computed by numpy in Python: once, not once per tensor)
    for t in tensors.values():
        if t.dtype == name and t.offset < hi and t.offset + t.size > lo:
            yield t


def _counted(piece: Piece, tensors: Tensors) -> Iterator[tuple[_Tensor, int, int]]:
    """``(tensor, lo, hi)``: the global elements of each parameter this rank counts."""
    lo, hi = piece.offset + piece.counted[0], piece.offset + piece.counted[1]
    for t in _overlapping(tensors, piece.param.dtype, lo, hi):
        yield t, max(t.offset, lo), min(t.offset + t.size, hi)


def _held(piece: Piece, tensors: Tensors) -> Iterator[tuple[_Tensor, int, int]]:
    """``(tensor, lo, hi)``: the global elements of each parameter in ``piece``."""
    lo, hi = piece.offset, piece.offset + piece.param.shape[0]
    for t in _overlapping(tensors, piece.param.dtype, lo, hi):
        yield t, max(t.offset, lo), min(t.offset + t.size, hi)


ADAFACTOR = Adafactor()
