"""Muon as an update rule (Keller Jordan's reference, ``muon.py`` of KellerJordan/Muon,
2024; the scaling of Moonlight, Liu et al. 2025, as an option): the momentum of every
matrix parameter (two or more dimensions, seen as ``(shape[0], rest)``) is
orthogonalized by five Newton-Schulz iterations; AdamW steps the other parameters, and
every parameter of a group with ``muon=False`` (embeddings and heads, as in the
references). Per step and matrix ``W`` (``G`` the averaged gradient)::

    M = M + (1 - momentum) (G - M)                      (a lerp: Keller's buffer)
    U = G + momentum (M - G) if nesterov else M
    O = NewtonSchulz5(U) * scale      scale = max(1, rows / cols)^0.5 (Keller's), or
                                              match_rms * sqrt(max(rows, cols)) (Moonlight's)
    W = W * (1 - lr * weight_decay) - lr * O

A matrix is cut across shards by the flat layout, so its momentum is assembled whole
on one rank, its *owner*, chosen per step to balance the Newton-Schulz work
(``rows * cols * min(rows, cols)``, largest first, to the least loaded rank): one
``Alltoallv`` with exact counts sends each rank's part of each matrix (the part it
counts: its shard; at stage 0 its part of the bucket) to the owner, the owner
orthogonalizes, and a second ``Alltoallv`` returns to every rank the part it updates.
The orthogonalized update replaces the gradient in place; the states are Adam's two
(``exp_avg``: a matrix's momentum; ``exp_avg_sq``: unused for a matrix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adam import AdamConfig, adam_step, finite_real
from ..buffers import StateKind
from .adam import betas_of
from .base import Piece, Rule, World, write_low

#: The quintic iteration's coefficients (Keller Jordan's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@dataclass(frozen=True)
class MuonConfig:
    """Hyperparameters of Muon and of the AdamW it uses for the rest, validated on
    construction."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    match_rms: float = 0.0
    muon: bool = True
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-10
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "match_rms", "beta1", "beta2", "eps", "weight_decay"):
            object.__setattr__(self, name, finite_real(name, getattr(self, name)))
        for name in ("lr", "match_rms", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("momentum", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if int(self.ns_steps) != self.ns_steps or not 0 <= self.ns_steps <= 100:
            raise ValueError(f"ns_steps must be an integer 0 to 100, got {self.ns_steps!r}")
        object.__setattr__(self, "ns_steps", int(self.ns_steps))
        object.__setattr__(self, "nesterov", bool(self.nesterov))
        object.__setattr__(self, "muon", bool(self.muon))

    def adam(self) -> AdamConfig:
        """The AdamW of the parameters Muon leaves out."""
        return AdamConfig(self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, True)


def newton_schulz(update: np.ndarray, steps: int) -> np.ndarray:
    """Keller Jordan's quintic Newton-Schulz iteration on a 2-D array, in its dtype:
    ``X = U / (|U|_F + 1e-7)`` (transposed to have no more rows than columns), then
    ``steps`` times ``A = X X^T``, ``X = a X + (b A + c A A) X``."""
    a, b, c = (update.dtype.type(v) for v in NS_COEFFICIENTS)
    x = update.T if update.shape[0] > update.shape[1] else update
    x = x / (np.linalg.norm(x) + update.dtype.type(1e-7))
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if update.shape[0] > update.shape[1] else x


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view Muon orthogonalizes: ``(shape[0], everything else)``."""
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


def scale_of(config: MuonConfig, rows: int, cols: int) -> float:
    """Keller's ``max(1, rows / cols)^0.5``, or with ``match_rms`` Moonlight's
    ``match_rms * sqrt(max(rows, cols))`` (an update of the RMS of AdamW's)."""
    if config.match_rms:
        return config.match_rms * max(rows, cols) ** 0.5
    return max(1.0, rows / cols) ** 0.5


class Muon(Rule):
    name = "muon"
    states = (StateKind("exp_avg"), StateKind("exp_avg_sq"))
    settings = ("lr", "momentum", "nesterov", "ns_steps", "match_rms", "muon", "beta1", "beta2",
                "eps", "weight_decay")  # fmt: skip
    reads = ("betas", "eps", "muon_momentum", "muon_nesterov", "ns_steps", "match_rms")
    prepares = True

    def base(self, config: Any) -> MuonConfig:
        b1, b2 = betas_of(config, (0.9, 0.95))
        return MuonConfig(config.lr, config.muon_momentum, config.muon_nesterov,
                          config.ns_steps, config.match_rms, True, b1, b2, config.eps,
                          config.weight_decay)  # fmt: skip

    def token(self, config: Any) -> tuple[Any, ...]:
        c = config
        return (c.lr, c.momentum, float(c.nesterov), float(c.ns_steps), c.match_rms,
                float(c.muon), c.beta1, c.beta2, c.eps, c.weight_decay)  # fmt: skip

    def before(self, pieces: list[Piece], step: int, world: World) -> dict[str, list[Any]]:
        """The momentum of every matrix this rank updates, then the orthogonalized
        update of each (assembled on its owner and returned) in place of the
        gradient. Returns, per dtype name, the matrices' ``(offset, size)``."""
        layout = world.layout
        matrices = [p for p in layout.params if len(p.shape) >= 2 and p.size
                    and world.config_of[p.name].muon]  # fmt: skip
        for piece in pieces:
            np.divide(piece.grad, piece.divisor, out=piece.grad)
            for p in matrices:
                lo, hi = _overlap(p, piece.offset, piece.param.shape[0], piece.param.dtype)
                if hi <= lo:
                    continue
                c = world.config_of[p.name]
                dt = piece.grad.dtype.type
                g = piece.grad[lo - piece.offset : hi - piece.offset]
                m = piece.states[0][lo - piece.offset : hi - piece.offset]
                m += (g - m) * dt(1.0 - c.momentum)
                if c.nesterov:
                    g += (m - g) * dt(c.momentum)
                else:
                    g[...] = m
        owner = owners(matrices, layout.world_size)
        by_dtype: dict[str, list[Any]] = {}
        for dtype in layout.sizes:
            mats = [(p, owner[p.name]) for p in matrices if p.dtype == dtype]
            by_dtype[dtype.name] = [(p.offset, p.size) for p, _ in mats]
            if mats:
                _orthogonalize(pieces, mats, dtype, world)
        return by_dtype

    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> None:  # fmt: skip
        """A matrix's elements: ``W = W * (1 - lr * wd) - lr * O`` (``O`` in ``grad``);
        the others: AdamW on the averaged gradient."""
        n = param.shape[0]
        dt = param.dtype.type
        at = 0
        for start, size in context[param.dtype.name]:
            lo, hi = max(start, offset) - offset, min(start + size, offset + n) - offset
            if hi <= lo:
                continue
            if lo > at:
                self._adam(param, grad, states, at, lo, step, config, scratch)
            p = param[lo:hi]
            if config.weight_decay:
                p *= dt(1.0 - config.lr * config.weight_decay)
            p += grad[lo:hi] * dt(-config.lr)
            at = hi
        if at < n:
            self._adam(param, grad, states, at, n, step, config, scratch)
        write_low(param, low, stochastic, 0)

    @staticmethod
    def _adam(
        param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], lo: int, hi: int,
        step: int, config: MuonConfig, scratch: np.ndarray,
    ) -> None:  # fmt: skip
        adam_step(param[lo:hi], grad[lo:hi], states[0][lo:hi], states[1][lo:hi], step,
                  config.adam(), scratch, 1.0)  # fmt: skip


def owners(matrices: Sequence[Any], world_size: int) -> dict[str, int]:
    """Each matrix's owner: the largest Newton-Schulz work first (``rows * cols *
    min(rows, cols)``, ties in the model's order), each to the least loaded rank (ties
    to the lowest). The same on every rank."""
    load = [0] * world_size
    out = {}
    work = [(-(r * c * min(r, c)), i, p) for i, p in enumerate(matrices)
            for r, c in (matrix_shape(p.shape),)]  # fmt: skip
    for cost, _, p in sorted(work, key=lambda w: (w[0], w[1])):
        rank = min(range(world_size), key=lambda q: (load[q], q))
        out[p.name] = rank
        load[rank] -= cost
    return out


def _overlap(p: Any, first: int, count: int, dtype: np.dtype) -> tuple[int, int]:
    """The global elements of parameter ``p`` among ``first ... first + count`` of
    the flat parameters of ``dtype``."""
    if p.dtype != dtype:
        return 0, 0
    return max(p.offset, first), min(p.offset + p.size, first + count)


def _orthogonalize(
    pieces: list[Piece], mats: list[tuple[Any, int]], dtype: np.dtype, world: World
) -> None:  # fmt: skip
    """Collective: every matrix of ``dtype`` assembled on its owner from the parts the
    ranks count, orthogonalized and scaled there, and returned to every rank for the
    part it updates, written over the gradient."""
    layout, stage = world.layout, world.stage
    ranks = range(layout.world_size)
    me = layout.rank

    def counted(rank: int, p: Any) -> tuple[int, int]:
        return _span(layout, stage, rank, p, counted=True)

    def held(rank: int, p: Any) -> tuple[int, int]:
        return _span(layout, stage, rank, p, counted=False)

    # 1. this rank's counted parts to each owner, in the matrices' order
    send_counts = [0] * len(ranks)
    sends = []
    for p, q in sorted(mats, key=lambda m: m[1]):
        lo, hi = counted(me, p)
        if hi > lo:
            sends.append(_grad_view(pieces, dtype, lo, hi))
        send_counts[q] += max(hi - lo, 0)
    mine = [p for p, q in mats if q == me]
    recv_counts = [sum(_len(counted(r, p)) for p in mine) for r in ranks]
    send = np.concatenate(sends) if sends else np.zeros(0, dtype)
    recv = np.empty(sum(recv_counts), dtype)
    world.exchange(send, send_counts, recv, recv_counts)
    # 2. the owner assembles (rank by rank, each rank's parts in the matrices' order)
    whole = {p.name: np.empty(p.size, dtype) for p in mine}
    at = 0
    for r in ranks:
        for p in mine:
            lo, hi = counted(r, p)
            if hi > lo:
                whole[p.name][lo - p.offset : hi - p.offset] = recv[at : at + hi - lo]
                at += hi - lo
    for p in mine:
        rows, cols = matrix_shape(p.shape)
        c = world.config_of[p.name]
        o = newton_schulz(whole[p.name].reshape(rows, cols), c.ns_steps)
        o *= dtype.type(scale_of(c, rows, cols))
        whole[p.name] = o.reshape(-1)
    # 3. back: each rank's held part of every matrix this rank owns, in rank order
    back_counts = [sum(_len(held(r, p)) for p in mine) for r in ranks]
    back = np.concatenate([whole[p.name][lo - p.offset : hi - p.offset] for r in ranks
                           for p in mine for lo, hi in (held(r, p),) if hi > lo]
                          or [np.zeros(0, dtype)])  # fmt: skip
    got_counts = [sum(_len(held(me, p)) for p, q in mats if q == r) for r in ranks]
    got = np.empty(sum(got_counts), dtype)
    world.exchange(back, back_counts, got, got_counts)
    at = 0
    for r in ranks:
        for p in [p for p, q in mats if q == r]:
            lo, hi = held(me, p)
            if hi > lo:
                _grad_view(pieces, dtype, lo, hi)[...] = got[at : at + hi - lo]
                at += hi - lo


def _span(layout: Any, stage: int, rank: int, p: Any, counted: bool) -> tuple[int, int]:
    """The global elements of parameter ``p`` (in one bucket) that ``rank`` counts (its
    shard; at stage 0 its part of the bucket) or, ``counted=False``, updates (at stage
    0 all of it); ``hi <= lo`` for none."""
    b = layout.buckets[layout.bucket_of[p.name]]
    lo, hi = (0, b.size) if stage == 0 and not counted else b.local(rank)
    return max(b.start + lo, p.offset), min(b.start + hi, p.offset + p.size)


def _len(span: tuple[int, int]) -> int:
    return max(span[1] - span[0], 0)


def _grad_view(pieces: list[Piece], dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    """The gradient of global elements ``lo ... hi`` of ``dtype`` in this rank's
    pieces."""
    for piece in pieces:
        if piece.grad.dtype == dtype and piece.offset <= lo and hi <= piece.offset + len(
                piece.grad):  # fmt: skip
            return piece.grad[lo - piece.offset : hi - piece.offset]
    raise AssertionError(f"elements {lo}...{hi} of {dtype} are not on this rank")


MUON = Muon()
