"""The interface of an update rule (:class:`Rule`) and what rules share."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .. import adam as _adam
from ..adam import stochastic_round
from ..buffers import StateKind


class Piece(NamedTuple):
    """What a rank updates of one bucket, as :meth:`Rule.before` sees it: the run's
    arrays, its first element's global offset, the elements this rank counts in
    statistics over all ranks (``counted``, run-local: each element of the model is
    counted by one rank), its parameter groups' configs by segment, and the divisor
    that averages the summed gradient."""

    param: np.ndarray
    grad: np.ndarray
    states: Sequence[np.ndarray]
    offset: int
    counted: tuple[int, int]
    segments: Sequence[tuple[int, int, Any]]
    divisor: float


class World(NamedTuple):
    """What :meth:`Rule.before` sees beyond its rank's pieces: the layout (its
    :class:`zerompi.partition.ParamSpec` list ``layout.params``: shapes, offsets in
    the flat parameters of their dtype; its buckets: every rank's part), the stage,
    each parameter's group config by name, and two collectives: ``reduce`` sums a
    small float64 array over the ranks in place; ``exchange(send, send_counts,
    recv, recv_counts)`` is an ``Alltoallv`` with exact counts (elements, per rank in
    rank order); ``broadcast(buf, root)`` overwrites ``buf`` everywhere with root's.
    ``memo``: the engine's dict where a rule keeps what it derived from the layout and
    the configs (computed at its first step, not at every one). ``workspace``: the
    rule's :meth:`Rule.workspace` buffers, by master dtype."""

    layout: Any
    stage: int
    config_of: Mapping[str, Any]
    reduce: Callable[[np.ndarray], None]
    exchange: Callable[[np.ndarray, Sequence[int], np.ndarray, Sequence[int]], None]
    broadcast: Callable[[np.ndarray, int], None]
    memo: dict[Any, Any]
    workspace: Mapping[np.dtype, np.ndarray]


class Rule(ABC):
    """An optimizer's update of a flat shard, element by element."""

    #: The name ``ZeroConfig(optimizer=...)`` selects it by.
    name: ClassVar[str]
    #: Its per-element states, in checkpoint order.
    states: ClassVar[tuple[StateKind, ...]]
    #: The config's fields a parameter group and ``set_hyperparameters`` may change
    #: (a group may also write ``betas`` for ``beta1``/``beta2``).
    settings: ClassVar[tuple[str, ...]]
    #: ``ZeroConfig`` fields the rule reads besides ``lr`` and ``weight_decay``;
    #: setting any other of :data:`RULE_FIELDS` away from its default is an error.
    reads: ClassVar[tuple[str, ...]]
    #: Scratch blocks the update needs (each ``len(scratch) // scratch_blocks``).
    scratch_blocks: ClassVar[int] = 1
    #: Where a rule has a compiled loop (:func:`compiled`): ``"c"`` or ``"numpy"``
    #: (``None``: :data:`zerompi.adam.KERNEL`) and the C variant (``None``:
    #: :data:`zerompi.adam.VARIANT`, else the best). Tests set them on an instance of
    #: their own: the registered rules are shared.
    kernel: str | None = None
    variant: str | None = None
    #: Whole arrays its data flow must read again, per element, beyond one read of the
    #: parameters, the gradient and the states (the memory floor of
    #: :func:`zerompi.bench.floor.floor_bytes` counts them): a rule whose update needs
    #: sums over whole parameters first reads what they are summed from twice.
    rereads: ClassVar[int] = 0
    #: Settings a group has from construction on: ``set_hyperparameters`` refuses to
    #: change them (Muon's ``muon`` decides which rank orthogonalizes which matrix and
    #: the workspace that takes).
    fixed: ClassVar[tuple[str, ...]] = ()
    #: The master dtypes it runs on (``None``: any).
    dtypes: ClassVar[tuple[str, ...] | None] = None
    #: Whether it needs statistics over whole parameters before any element is updated
    #: (:meth:`before`; Adafactor's factored second moments and its RMS terms).
    prepares: ClassVar[bool] = False

    @abstractmethod
    def base(self, config: Any) -> Any:
        """Group 0's hyperparameters from a :class:`zerompi.config.ZeroConfig`."""

    @abstractmethod
    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> Any:  # fmt: skip
        """One step on 1-D views of equal length, in place. ``grad`` holds the
        gradient summed over ranks and micro-batches and is consumed; dividing it by
        ``divisor`` gives the averaged (clipped, unscaled) gradient. ``step`` is the
        1-based step count. ``low``, where given, receives the updated parameters
        rounded to its narrower dtype (nearest even, or ``stochastic=(key, base)``:
        :func:`zerompi.adam.stochastic_round`).

        A state held per unit (:attr:`StateKind.per <zerompi.buffers.StateKind.per>`:
        block, matrix row or column) comes as the entries of the units the elements
        touch, and ``offset`` is the global element (in the flat parameters of its
        dtype) of ``param[0]``. What the update returns, if not ``None``, is
        handed to :meth:`finish` at the end of the step's update. ``context``: what
        :meth:`before` returned this step (rules that :attr:`prepares`)."""

    def before(self, pieces: list[Piece], step: int, world: World) -> Any:
        """Collective, before the update of a step, for a rule that :attr:`prepares`:
        ``pieces`` are what this rank updates (:class:`Piece`, one per bucket),
        ``world`` the model's layout and the collectives a rule may use
        (:class:`World`). Returns the context every :meth:`update` call gets. It may
        divide the gradients by the divisor in place (and then say so to
        :meth:`update` in the context)."""
        return None

    def finish(self, pending: list[Any], agree: Any) -> None:
        """Collective, at the end of every update of a rule with per-block states:
        ``pending`` is what this rank's :meth:`update` calls returned, ``agree`` a
        :class:`zerompi.blockwise.Agreement` (the blocks several parts share get the
        largest value proposed for them). Rules without block states never see it."""
        return None

    @property
    def block(self) -> int:
        """The block size of its per-block states (``0``: it has none)."""
        return max((s.block for s in self.states), default=0)

    @property
    def units(self) -> bool:
        """Whether any of its states is held per unit (block, matrix, vector element)."""
        return any(s.units for s in self.states)

    def workspace(
        self, layout: Any, stage: int, config_of: Callable[[str], Any]
    ) -> dict[np.dtype, int]:  # fmt: skip
        """Elements of each master dtype the rule's step works in beyond its states
        and scratch, on ``layout``'s rank at ``stage`` (``config_of``: a parameter's
        group config by name): allocated once with the other buffers
        (:data:`zerompi.buffers.Kind.WORKSPACE`), counted by ``memory_usage()`` and the
        estimator, handed to :meth:`before` as ``World.workspace``. None by default."""
        return {}

    def check(self, dtypes: Sequence[np.dtype]) -> None:
        """Raise (a ``ValueError`` naming the value) where the rule cannot run on
        parameters of ``dtypes``."""
        if self.dtypes is not None:
            bad = [d.name for d in dtypes if d.name not in self.dtypes]
            if bad:
                raise ValueError(
                    f"optimizer={self.name!r} runs on {', '.join(self.dtypes)} parameters "
                    f"only; this model has {', '.join(bad)} ones")  # fmt: skip

    def group(self, base: Any, entry: Mapping[str, Any], where: str) -> Any:
        """A parameter group's hyperparameters: ``base`` with the group's settings."""
        changes: dict[str, Any] = {}
        for key, value in entry.items():
            if key == "params":
                continue
            if key == "betas" and "beta1" in self.settings:
                try:
                    changes["beta1"], changes["beta2"] = value
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: betas must be a pair, got {value!r}") from None
            elif key in self.settings:
                changes[key] = value
            else:
                known = ", ".join(self._group_keys())
                raise TypeError(f"{where}: unknown setting {key!r} (a group of {self.name} "
                                f"may set {known})")  # fmt: skip
        return dataclasses.replace(base, **changes)

    def _group_keys(self) -> list[str]:
        keys = [k for k in self.settings if k not in ("beta1", "beta2")]
        if "beta1" in self.settings:
            keys.insert(1, "betas")
        return keys

    def as_group(self, config: Any) -> dict[str, Any]:
        """The hyperparameters as a torch ``param_group`` writes them."""
        out = {k: getattr(config, k) for k in self.settings if k not in ("beta1", "beta2")}
        if "beta1" in self.settings:
            out["betas"] = (config.beta1, config.beta2)
        return out

    def token(self, config: Any) -> tuple[Any, ...]:
        """The hyperparameters as a tuple (the step's agreement hashes it)."""
        return dataclasses.astuple(config)

    def state_labels(self) -> list[str]:
        return [s.label for s in self.states]


#: ``ZeroConfig`` fields that belong to one rule or another.
RULE_FIELDS: dict[str, Any] = {
    "betas": None, "eps": 1e-8, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
    "beta2_decay": -0.8, "eps1": None, "eps2": 1e-3, "d": 1.0, "muon_momentum": 0.95,
    "muon_nesterov": True, "ns_steps": 5, "match_rms": 0.0}  # fmt: skip


def blocks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of consecutive blocks of at most ``size`` (>= 1) of ``n`` elements:
    the pieces a numpy update works on while they stay in cache."""
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def kernel_blocks(n: int, scratch: np.ndarray, low: np.ndarray | None) -> Iterator[tuple[int, int]]:
    """The blocks a compiled update runs over: the whole shard in one call, or, where
    the rounded copy is written after each, blocks of the scratch's size (still in
    cache for that write)."""
    return blocks(n, scratch.shape[0] if low is not None else max(n, 1))


def kernels() -> Any:
    """The compiled extension (:func:`compiled` said it is there)."""
    return _adam._kernels


def compiled(kernel: str | None, variant: str | None, *arrays: np.ndarray) -> str | None:
    """The C variant to run a rule's update on ``arrays`` with (``""``: the best this
    CPU runs), or ``None`` for the numpy loop: the compiled kernels are in use
    (``kernel``, default :data:`zerompi.adam.KERNEL`) and the arrays contiguous
    float32/float64 of one dtype."""
    if (kernel or _adam.KERNEL) != "c" or _adam._kernels is None:
        return None
    dtype = arrays[0].dtype
    if dtype not in (np.float32, np.float64):
        return None
    if not all(a.flags.c_contiguous and a.dtype == dtype for a in arrays):
        return None
    return variant or _adam.VARIANT or ""


def write_low(
    p: np.ndarray, low: np.ndarray | None, stochastic: tuple[int, int] | None, lo: int
) -> None:
    """The updated block ``p`` (elements ``lo...`` of the call) rounded into ``low``."""
    if low is None:
        return
    if stochastic is not None:
        stochastic_round(p, low, stochastic[0], stochastic[1] + lo)
    else:  # (overflow rounds to inf, as the kernels do: no warning)
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(low, p, casting="unsafe")


def check_fields(rule: Rule, config: Any) -> None:
    """A rule-specific ``ZeroConfig`` field set for a rule that does not read it is
    an error naming it (``betas`` for SGD, ``momentum`` for Adam, ...)."""
    for field, default in RULE_FIELDS.items():
        value = getattr(config, field)
        if field not in rule.reads and value != default:
            raise ValueError(f"{field}={value!r} is not a setting of optimizer={rule.name!r} "
                             f"(its settings: lr, weight_decay"
                             f"{''.join(', ' + f for f in rule.reads)})")  # fmt: skip
