"""One frozen description of an optimizer: :class:`ZeroConfig` and its policies.

``ZeroOptimizer(params, config, ...)`` and ``zerompi.torch.shard(model, config, ...)``
take the same :class:`ZeroConfig`. Its fields are the optimizer's settings (stage,
Adam's hyperparameters, buckets, failure handling, the watchdog), and four small
policies group what belongs together, after FSDP2's ``MixedPrecisionPolicy``:

* :class:`PrecisionPolicy`: the dtypes the model computes and communicates in, and
  the loss scale;
* :class:`NodeMemoryPolicy`: whether ranks on a node share memory;
* :class:`OverlapPolicy`: whether communication overlaps computation (a second
  staging slot, stage 3's prefetch);
* :class:`ElasticPolicy`: surviving a lost rank.

A config is a plain value: building one checks nothing, so that it can be made
anywhere. It is checked once, when an optimizer is built, by :func:`settle`, and
agreed across ranks in one collective: an error on any rank, or any setting that
differs between ranks, is raised on every rank, naming it. The flat keywords of the
constructors (``param_dtype=``, ``shared_memory=``, ``snapshot_every=`` ...) are
:meth:`ZeroConfig.replace` applied to the config (:data:`FLAT` maps them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .arrays import check_failure_settings, check_params
from .partition import DEFAULT_BUCKET_ELEMS, Layout, default_group, optimizer_layout
from .precision import LossScale, Precision, precision_settings
from .rules import Rule, check_fields, rule_of
from .settings import group_configs

if TYPE_CHECKING:
    from .mpi.collectives import Comm
    from .partition import Deferred


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of the model's copies (:mod:`zerompi.precision`).

    ``param_dtype`` (``"bfloat16"``, ``"float16"``, a numpy dtype; ``None``: the
    arrays' own) is what the model reads and the gather moves; ``reduce_dtype`` that
    of the gradients it hands over and of the reduction's wire (summed in the master
    dtype all the same); ``loss_scale`` (``"dynamic"``, a number, a
    :class:`zerompi.precision.LossScale`; ``None``: dynamic for float16 gradients)
    is what the model multiplies its loss gradient by; ``rounding="stochastic"``
    rounds the bfloat16 copy stochastically."""

    param_dtype: object = None
    reduce_dtype: object = None
    loss_scale: object = None
    rounding: str = "nearest"


@dataclass(frozen=True)
class NodeMemoryPolicy:
    """Node shared memory (:mod:`zerompi.mpi.nodes`): one parameter copy per node and
    the reduction within a node through memory. ``shared``: ``None`` wherever it
    helps (more than one rank per node, a stage above 0, room in ``/dev/shm``),
    ``True`` insists (an error where it cannot work), ``False`` never."""

    shared: bool | None = None


@dataclass(frozen=True)
class OverlapPolicy:
    """``enabled``: a second staging slot at stages 2-3 (one bucket is reduced while
    the next is handed over) and a second gather buffer at stage 3 (the next layer
    is gathered while the model computes the current one); off, one of each."""

    enabled: bool = True


@dataclass(frozen=True)
class ElasticPolicy:
    """Surviving a lost rank (Open MPI with ``mpiexec --with-ft ulfm``;
    :mod:`zerompi.elastic`): in-memory snapshots every ``snapshot_every`` batches."""

    enabled: bool = False
    snapshot_every: int = 10


#: Flat keyword -> (policy field of :class:`ZeroConfig`, field of that policy).
FLAT: dict[str, tuple[str, str]] = {
    "param_dtype": ("precision", "param_dtype"),
    "reduce_dtype": ("precision", "reduce_dtype"),
    "loss_scale": ("precision", "loss_scale"),
    "rounding": ("precision", "rounding"),
    "shared_memory": ("node_memory", "shared"),
    "overlap": ("overlap", "enabled"),
    "elastic": ("elastic", "enabled"),
    "snapshot_every": ("elastic", "snapshot_every"),
}


@dataclass(frozen=True)
class ZeroConfig:
    """Every setting of a ``ZeroOptimizer`` (and of ``zerompi.torch.shard``).

    ``stage`` 0 (plain data parallelism) to 3; ``optimizer``, the update rule
    (:mod:`zerompi.rules`: ``"adam"``, ``"sgd"``, ``"lion"``, ``"adam8bit"``,
    ``"adafactor"``, ``"muon"``) and its hyperparameters:
    ``lr`` and ``weight_decay`` for every rule (``decoupled_weight_decay=True``: AdamW,
    SGDW; Lion's is always decoupled), ``betas`` (Adam, Lion; ``None``: the rule's
    default, (0.9, 0.999) and (0.9, 0.99)) and ``eps`` (Adam), ``momentum``,
    ``dampening`` and ``nesterov`` (SGD), ``beta2_decay``, ``eps1``, ``eps2`` and
    ``d`` (Adafactor), ``muon_momentum``, ``muon_nesterov``, ``ns_steps`` and
    ``match_rms`` (Muon), a setting of another rule being an error;
    ``param_groups``
    (torch's list of dicts by parameter name, :mod:`zerompi.settings`); ``max_norm``
    clips the global gradient norm, ``nonfinite`` (``"skip"`` or ``"raise"``) says
    what a non-finite gradient does; ``bucket_elems`` and ``group_of`` cut the flat
    parameters into buckets (:mod:`zerompi.partition`); ``gather_buffers=False``
    (stage 3): the caller gathers into its own memory (``gather_into``); ``timeout``
    (seconds, ``0``/``"none"``: off; default ``$ZEROMPI_TIMEOUT``, else 600) bounds
    every wait inside zerompi. ``overlap=False`` and ``elastic=True`` may be given
    for their policies (``OverlapPolicy(False)``, ``ElasticPolicy(True)``)."""

    stage: int = 1
    lr: float = 1e-3
    betas: tuple[float, float] | None = None
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    param_groups: Sequence[Mapping[str, Any]] | None = None
    max_norm: float | None = None
    nonfinite: str = "skip"
    bucket_elems: int = DEFAULT_BUCKET_ELEMS
    group_of: Callable[[str], str] = default_group
    gather_buffers: bool = True
    timeout: float | str | None = None
    precision: PrecisionPolicy = PrecisionPolicy()
    node_memory: NodeMemoryPolicy = NodeMemoryPolicy()
    overlap: OverlapPolicy = OverlapPolicy()
    elastic: ElasticPolicy = ElasticPolicy()
    optimizer: str = "adam"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    beta2_decay: float = -0.8
    eps1: float | None = None
    eps2: float = 1e-3
    d: float = 1.0
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    match_rms: float = 0.0

    def __post_init__(self) -> None:
        for name, policy in (("overlap", OverlapPolicy), ("elastic", ElasticPolicy)):
            value = getattr(self, name)
            if not isinstance(value, policy):  # the shorthand: a bool for the policy
                object.__setattr__(self, name, policy(value))

    def replace(self, **keywords: Any) -> ZeroConfig:
        """A copy with ``keywords`` changed: fields of this class, or the flat names
        of :data:`FLAT` (``param_dtype=``, ``shared_memory=``, ``snapshot_every=``,
        ...) for fields of its policies. An unknown name is a ``TypeError``."""
        fields = {f.name for f in dataclasses.fields(self)}
        direct: dict[str, Any] = {}
        policies: dict[str, dict[str, Any]] = {}
        for key, value in keywords.items():
            if key in FLAT and not isinstance(value, type(getattr(self, FLAT[key][0]))):
                owner, field = FLAT[key]
                policies.setdefault(owner, {})[field] = value
            elif key in fields:
                direct[key] = value
            else:
                known = ", ".join(sorted(fields | set(FLAT)))
                raise TypeError(f"unknown setting {key!r}; the settings are: {known}")
        for owner, changes in policies.items():
            direct[owner] = dataclasses.replace(direct.get(owner, getattr(self, owner)), **changes)
        return dataclasses.replace(self, **direct)


def config_of(config: ZeroConfig | None, keywords: Mapping[str, Any]) -> ZeroConfig:
    """``config`` (default :class:`ZeroConfig`) with the flat ``keywords`` applied."""
    if config is None:
        config = ZeroConfig()
    elif not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zerompi.ZeroConfig, got {type(config).__name__}")
    return config.replace(**keywords) if keywords else config


class Settings(NamedTuple):
    """A :class:`ZeroConfig` checked for one model, identical on every rank: what
    :func:`zerompi.engine.build_engine` builds from (a recovery rebuilds from the same
    settings on a smaller world)."""

    config: ZeroConfig
    #: ``(name, shape, dtype)`` of every parameter, in the model's order.
    specs: list[tuple[str, tuple[int, ...], np.dtype]]
    #: Every parameter group's hyperparameters (group 0: the config's), the update
    #: rule's config type, and each parameter's group
    #: (:func:`zerompi.settings.group_configs`).
    configs: list[Any]
    member: dict[str, int]
    max_norm: float | None
    timeout: float | None
    precisions: dict[np.dtype, Precision]
    scaler: LossScale | None
    #: Whether to use node shared memory: ``False`` never, ``True`` insist, ``None``
    #: where it helps (:func:`zerompi.engine.choose_shared` decides).
    shared_memory: bool | None
    #: The update rule (:mod:`zerompi.rules`).
    rule: Rule

    def layout(self, size: int, rank: int) -> Layout:
        """The flat layout of the model on ``rank`` of a world of ``size``."""
        c = self.config
        return optimizer_layout(self.specs, size, rank, c.stage, c.bucket_elems, c.group_of)


def settle(
    comm: Comm, params: Mapping[str, np.ndarray | Deferred], config: ZeroConfig | None,
    keywords: Mapping[str, Any],
) -> tuple[Settings, Layout]:  # fmt: skip
    """Collective: ``config`` with ``keywords`` checked against the model ``params``
    on this rank, then agreed across ranks in one exchange
    (:meth:`zerompi.mpi.agreement.Agreement.settle`): an error on any rank, or a
    layout or setting that differs between ranks, raises on every rank (the message
    names the setting and the first rank unlike rank 0). Returns the settings and
    this rank's layout."""
    from .elastic import check_elastic
    from .mpi.launch import check_world
    from .mpi.watchdog import resolve_timeout

    error: BaseException | None = None
    specs: list[tuple[str, tuple[int, ...], np.dtype]] = []
    keys: list[str] = []
    sections: list[tuple[str, Any]] = []
    settings = layout = None
    try:
        check_world()
        c = config_of(config, keywords)
        specs = check_params(params)
        rule = rule_of(c.optimizer)
        check_fields(rule, c)
        configs, member = group_configs(rule, rule.base(c), c.param_groups,
                                        [n for n, _, _ in specs])  # fmt: skip
        layout = optimizer_layout(specs, comm.size, comm.rank, c.stage, c.bucket_elems, c.group_of)
        rule.check(list(layout.sizes))
        keys = [c.group_of(name) for name, _, _ in specs]
        max_norm = check_failure_settings(c.max_norm, c.nonfinite)
        shared = c.node_memory.shared
        for name, flag in (("overlap", c.overlap.enabled), ("shared_memory", shared)):
            if not isinstance(flag, bool) and (name == "overlap" or flag is not None):
                raise TypeError(f"{name} must be a bool, got {flag!r:.60}")
        seconds = resolve_timeout(c.timeout)
        shared = check_elastic(c.elastic.enabled, c.elastic.snapshot_every, shared)
        p = c.precision
        precisions, scaler, dtypes = precision_settings(
            list(layout.sizes), p.param_dtype, p.reduce_dtype, p.loss_scale, c.nonfinite,
            p.rounding,
        )  # fmt: skip
        settings = Settings(c, specs, configs, member, max_norm, seconds, precisions, scaler,
                            shared, rule)  # fmt: skip
        sections = [
            ("the optimizer settings (stage, optimizer, hyperparameters, param_groups, "
             "bucket_elems)",
             (c.stage, rule.name, configs, sorted(member.items()), int(c.bucket_elems))),
            ("the failure settings (max_norm, nonfinite)", (max_norm, c.nonfinite)),
            ("(overlap, shared_memory, gather_buffers)",
             (c.overlap.enabled, shared, bool(c.gather_buffers))),
            ("the watchdog timeout (timeout or ZEROMPI_TIMEOUT)", seconds),
            ("(elastic, snapshot_every)", (c.elastic.enabled, c.elastic.snapshot_every)),
            ("the precision settings (param_dtype, reduce_dtype, loss_scale)", dtypes),
        ]  # fmt: skip
    except Exception as exc:  # whatever it is, every rank must hear of it
        error = exc
    layout_key = [(n, s, d.str, k) for (n, s, d), k in zip(specs, keys, strict=False)]
    comm.settle(error, [("the parameter layout (name, shape, dtype, group)", layout_key),
                        *sections])  # fmt: skip
    assert settings is not None and layout is not None
    return settings, layout
