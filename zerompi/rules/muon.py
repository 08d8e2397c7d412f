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
on one rank, its *owner*, chosen once (:func:`owners`: the largest Newton-Schulz work,
``rows * cols * min(rows, cols)``, first, to the rank counting most of it while the
work stays even; which matrices are Muon's is fixed at construction): one
``Alltoallv`` with exact counts sends each rank's part of each matrix (its shard of
it) to the owner, the owner orthogonalizes, and a second ``Alltoallv`` returns to
every rank its part. At stage 0 every rank holds every matrix: the owner
orthogonalizes its own copy and broadcasts the result. The orthogonalized update
replaces the gradient in place; the states are Adam's two
(``exp_avg``: a matrix's momentum; ``exp_avg_sq``: unused for a matrix). All of it
runs in the rule's workspace (:meth:`Muon.workspace`: the parts exchanged, one
assembled matrix and the Newton-Schulz products of the largest the rank owns),
allocated once with the optimizer's other buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..adam import BLOCK, AdamConfig, adam_step, finite_real
from ..buffers import StateKind
from .adam import betas_of
from .base import Piece, Rule, World, blocks, write_low

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


class NewtonSchulzSpace(NamedTuple):
    """The buffers :func:`newton_schulz` works in, each at least as large as one
    matrix needs (``ns_sizes``): the product ``(B) X`` (``tmp``), the Gram matrix and
    its square (``gram``, ``gram2``), and, for a tall matrix, the iterate in the wide
    orientation (``wide``)."""

    tmp: np.ndarray
    gram: np.ndarray
    gram2: np.ndarray
    wide: np.ndarray


def ns_sizes(rows: int, cols: int) -> tuple[int, int, int, int]:
    """Elements of each :class:`NewtonSchulzSpace` buffer a ``rows x cols`` matrix
    needs."""
    r, c = min(rows, cols), max(rows, cols)
    return r * c, r * r, r * r, r * c if rows > cols else 0


def newton_schulz(u: np.ndarray, steps: int, space: NewtonSchulzSpace) -> np.ndarray:
    """Keller Jordan's quintic Newton-Schulz iteration on the C-contiguous 2-D ``u``,
    in its dtype, in place and in ``space`` (no allocation): ``X = U / (|U|_F +
    1e-7)`` (transposed to have no more rows than columns), then ``steps`` times ``A =
    X X^T``, ``X = a X + (b A + c A A) X``. Returns the result, ``u`` itself or a
    view of ``space.wide``. The products see their operands in the memory layouts
    :meth:`zerompi.reference.ReferenceMuon.orthogonalize` gives them (a tall
    matrix's first iterate is ``u``'s transpose, the later ones C-contiguous), so
    BLAS computes the same bits."""
    dt = u.dtype.type
    a, b, c = (dt(v) for v in NS_COEFFICIENTS)
    tall = u.shape[0] > u.shape[1]
    np.divide(u, np.linalg.norm(u) + dt(1e-7), out=u)
    x = u.T if tall else u
    r, w = x.shape
    tmp = space.tmp[: r * w].reshape(r, w)
    gram, gram2 = space.gram[: r * r].reshape(r, r), space.gram2[: r * r].reshape(r, r)
    for i in range(steps):
        np.matmul(x, x.T, out=gram)
        np.matmul(gram, gram, out=gram2)
        gram2 *= c
        gram *= b
        np.add(gram, gram2, out=gram2)
        np.matmul(gram2, x, out=tmp)
        if tall and i == 0:  # the next iterates C-contiguous, in the wide buffer
            x = space.wide[: r * w].reshape(r, w)
            np.multiply(u.T, a, out=x)
        else:
            x *= a
        x += tmp
    return x.T if tall else x


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
    fixed = ("muon",)

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
                t = np.empty(min(BLOCK, hi - lo), g.dtype)  # (a block, not the shard)
                for a, b in blocks(hi - lo, BLOCK):
                    gb, mb, tb = g[a:b], m[a:b], t[: b - a]
                    np.subtract(gb, mb, out=tb)  # m += (g - m) * (1 - momentum)
                    tb *= dt(1.0 - c.momentum)
                    mb += tb
                    if c.nesterov:  # g += (m - g) * momentum
                        np.subtract(mb, gb, out=tb)
                        tb *= dt(c.momentum)
                        gb += tb
                    else:
                        gb[...] = mb
        key = ("muon owners", tuple(p.name for p in matrices))
        owner = world.memo.get(key)
        if owner is None:  # (once: a loop over ranks x matrices)
            owner = world.memo[key] = _owners(matrices, layout, world.stage)
        by_dtype: dict[str, list[Any]] = {}
        for dtype in layout.sizes:
            mats = [(p, owner[p.name]) for p in matrices if p.dtype == dtype]
            by_dtype[dtype.name] = [(p.offset, p.size) for p, _ in mats]
            if mats:
                _orthogonalize(pieces, mats, dtype, world)
        return by_dtype

    def workspace(
        self, layout: Any, stage: int, config_of: Callable[[str], Any]
    ) -> dict[np.dtype, int]:  # fmt: skip
        """Per dtype: this rank's counted parts of the matrices (sent to their owners,
        and what comes back), the matrices it owns as they arrive, one of them
        assembled, and the Newton-Schulz products of the largest (stage 0: the
        products only; every rank holds every matrix whole)."""
        matrices = [p for p in layout.params if len(p.shape) >= 2 and p.size
                    and config_of(p.name).muon]  # fmt: skip
        owner = _owners(matrices, layout, stage)
        out = {}
        for dtype in layout.sizes:
            mats = [(p, owner[p.name]) for p in matrices if p.dtype == dtype]
            total = sum(_space(mats, layout, stage))
            if total:
                out[dtype] = total
        return out

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
            for a, b in blocks(hi - lo, scratch.shape[0]):  # p += O * (-lr), by blocks
                t = scratch[: b - a]
                np.multiply(grad[lo + a : lo + b], dt(-config.lr), out=t)
                p[a:b] += t
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


def owners(
    matrices: Sequence[Any], world_size: int, counted: Callable[[int, Any], int] | None = None
) -> dict[str, int]:  # fmt: skip
    """Each matrix's owner, the same on every rank: the largest Newton-Schulz work
    first (``rows * cols * min(rows, cols)``, ties in the model's order). With
    ``counted`` (``counted(rank, matrix)``: the elements of it that rank counts), the
    rank counting the most of it (then the least loaded, then the lowest) among those
    whose load stays within an even share of the work; a matrix no such rank can take,
    and every matrix without ``counted``, goes to the least loaded rank (ties to the
    lowest). A matrix whose owner counts it whole is neither sent nor returned."""
    load = [0] * world_size
    out = {}
    work = [(r * c * min(r, c), i, p) for i, p in enumerate(matrices)
            for r, c in (matrix_shape(p.shape),)]  # fmt: skip
    share = sum(w for w, _, _ in work) / world_size
    for cost, _, p in sorted(work, key=lambda w: (-w[0], w[1])):
        fits = [q for q in range(world_size) if load[q] + cost <= share] if counted else []
        if fits:
            rank = min(fits, key=lambda q: (-counted(q, p), load[q], q))  # type: ignore[misc]
        else:
            rank = min(range(world_size), key=lambda q: (load[q], q))
        out[p.name] = rank
        load[rank] += cost
    return out


def _overlap(p: Any, first: int, count: int, dtype: np.dtype) -> tuple[int, int]:
    """The global elements of parameter ``p`` among ``first ... first + count`` of
    the flat parameters of ``dtype``."""
    if p.dtype != dtype:
        return 0, 0
    return max(p.offset, first), min(p.offset + p.size, first + count)


def _owners(matrices: Sequence[Any], layout: Any, stage: int) -> dict[str, int]:
    """:func:`owners` preferring the rank that counts most of a matrix."""
    return owners(matrices, layout.world_size,
                  lambda rank, p: _len(_span(layout, stage, rank, p, counted=True)))  # fmt: skip


def _local(layout: Any, stage: int, p: Any) -> bool:
    """Whether this rank counts all of matrix ``p`` (at stage 0 it holds it whole)."""
    return stage == 0 or _span(layout, stage, layout.rank, p, counted=True) == (
        p.offset, p.offset + p.size)  # fmt: skip


def _space(mats: list[tuple[Any, int]], layout: Any, stage: int) -> list[int]:
    """Elements of one dtype's workspace, in order: this rank's counted parts of the
    matrices others own (``mats``: ``(ParamSpec, owner)``), the other ranks' parts of
    the matrices it owns, one owned matrix assembled (the largest it does not count
    whole), and the Newton-Schulz buffers of the largest it owns (:func:`ns_sizes`)."""
    me = layout.rank
    mine = [p for p, q in mats if q == me]
    ns = [max((ns_sizes(*matrix_shape(p.shape))[i] for p in mine), default=0) for i in range(4)]
    if stage == 0:
        return [0, 0, 0, *ns]
    sent = sum(_len(_span(layout, stage, me, p, counted=True)) for p, q in mats if q != me)
    arriving = sum(p.size - _len(_span(layout, stage, me, p, counted=True)) for p in mine)
    whole = max((p.size for p in mine if not _local(layout, stage, p)), default=0)
    return [sent, arriving, whole, *ns]


def _carve(buf: np.ndarray | None, sizes: Sequence[int], dtype: np.dtype) -> list[np.ndarray]:
    """``buf`` cut into consecutive pieces of ``sizes`` elements."""
    if buf is None:
        return [np.empty(0, dtype) for _ in sizes]
    out, at = [], 0
    for n in sizes:
        out.append(buf[at : at + n])
        at += n
    return out


class _Plan(NamedTuple):
    """One dtype's exchanges of a step at stages 1-3 on this rank, from the layout
    and the matrices' owners alone (made at the first step, kept in the engine's
    ``World.memo``): this rank's counted parts of the matrices others own, in send
    order (by owner, then the matrices' order) as global ``(lo, hi)``, and the
    counts; per matrix this rank owns, its own counted part (global ``(lo, hi)``)
    and where the others' parts arrive (``(at, start, stop)``: at ``at`` of what
    arrives, elements ``start ... stop`` of the matrix; by sending rank, then the
    matrices' order), and the counts received. What goes back has the same layout
    (a rank updates what it counts), so the owned parts go back from where they
    arrived and come back where they were sent from. ``moves``: whether any rank
    sends anything (the same on every rank; else no exchange at all)."""

    sends: list[tuple[int, int]]
    send_counts: list[int]
    owned: dict[str, tuple[tuple[int, int], list[tuple[int, int, int]]]]
    recv_counts: list[int]
    moves: bool


def _plan(mats: list[tuple[Any, int]], world: World) -> _Plan:
    """:class:`_Plan` of ``mats`` (``(ParamSpec, owner)``, the matrices' order)."""
    layout, stage = world.layout, world.stage
    ranks = range(layout.world_size)
    me = layout.rank
    counted = {(r, p.name): _span(layout, stage, r, p, counted=True)
               for r in ranks for p, _ in mats}  # fmt: skip
    moves = any(_len(counted[r, p.name]) for r in ranks for p, q in mats if q != r)
    send_counts = [0] * len(ranks)
    sends = []
    for p, q in sorted(mats, key=lambda m: m[1]):
        lo, hi = counted[me, p.name]
        if q != me and hi > lo:
            sends.append((lo, hi))
            send_counts[q] += hi - lo
    mine = [p for p, q in mats if q == me]
    owned: dict[str, tuple[tuple[int, int], list[tuple[int, int, int]]]] = {
        p.name: (counted[me, p.name], []) for p in mine}  # fmt: skip
    recv_counts, at = [], 0
    for r in ranks:
        got = 0
        for p in mine:
            lo, hi = counted[r, p.name]
            if r != me and hi > lo:
                owned[p.name][1].append((at, lo - p.offset, hi - p.offset))
                at += hi - lo
                got += hi - lo
        recv_counts.append(got)
    return _Plan(sends, send_counts, owned, recv_counts, moves)


def _orthogonalize(
    pieces: list[Piece], mats: list[tuple[Any, int]], dtype: np.dtype, world: World
) -> None:  # fmt: skip
    """Collective: every matrix of ``dtype`` orthogonalized and scaled on its owner,
    in the workspace (:meth:`Muon.workspace`), and written over the gradient of every
    rank that updates a part of it. Stages 1-3: the parts other ranks count go to the
    owner and back, two ``Alltoallv`` with exact counts (none where no part moves); a
    matrix its owner counts whole is orthogonalized in place. Stage 0: every rank
    holds every matrix, the owner works on its own and broadcasts the result."""
    layout = world.layout
    space = _carve(world.workspace.get(dtype), _space(mats, layout, world.stage), dtype)
    sent, arrived, whole = space[:3]
    ns = NewtonSchulzSpace(*space[3:])
    if world.stage == 0:
        for p, q in mats:
            if q == layout.rank:
                g = _grad_view(pieces, dtype, p.offset, p.offset + p.size)
                _scaled(g.reshape(matrix_shape(p.shape)), p, ns, world)
        for p, q in mats:  # (every rank, in the matrices' order)
            world.broadcast(_grad_view(pieces, dtype, p.offset, p.offset + p.size), q)
        return
    key = ("muon", dtype.name, tuple((p.name, q) for p, q in mats))
    plan = world.memo.get(key)
    if plan is None:
        plan = world.memo[key] = _plan(mats, world)
    at = 0
    for lo, hi in plan.sends:
        sent[at : at + hi - lo] = _grad_view(pieces, dtype, lo, hi)
        at += hi - lo
    if plan.moves:
        world.exchange(sent, plan.send_counts, arrived, plan.recv_counts)
    by_name = {p.name: p for p, _ in mats}
    for name, ((lo, hi), parts) in plan.owned.items():
        p = by_name[name]
        if not parts:  # counted whole here: in place
            _scaled(_grad_view(pieces, dtype, lo, hi).reshape(matrix_shape(p.shape)), p, ns,
                    world)  # fmt: skip
            continue
        u = whole[: p.size]
        if hi > lo:
            u[lo - p.offset : hi - p.offset] = _grad_view(pieces, dtype, lo, hi)
        for at, start, stop in parts:
            u[start:stop] = arrived[at : at + stop - start]
        _scaled(u.reshape(matrix_shape(p.shape)), p, ns, world)
        if hi > lo:
            _grad_view(pieces, dtype, lo, hi)[...] = u[lo - p.offset : hi - p.offset]
        for at, start, stop in parts:  # back where it came from
            arrived[at : at + stop - start] = u[start:stop]
    if plan.moves:
        world.exchange(arrived, plan.recv_counts, sent, plan.send_counts)
    at = 0
    for lo, hi in plan.sends:
        _grad_view(pieces, dtype, lo, hi)[...] = sent[at : at + hi - lo]
        at += hi - lo


def _scaled(u: np.ndarray, p: Any, ns: NewtonSchulzSpace, world: World) -> None:
    """``u`` (C-contiguous, the matrix's shape for Muon) replaced by its
    orthogonalized and scaled update."""
    rows, cols = u.shape
    c = world.config_of[p.name]
    o = newton_schulz(u, c.ns_steps, ns)
    if o is not u:
        np.copyto(u, o)
    u *= u.dtype.type(scale_of(c, rows, cols))


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
