"""What a :class:`zerompi.ZeroOptimizer` will hold, per rank, without building one.

:func:`estimate` builds the same :class:`zerompi.partition.Layout` the optimizer
builds (same buckets, same ``shard_range`` counts) and reads the same buffer plan
(:func:`zerompi.plan.buffer_plan`, which :func:`zerompi.engine.build_engine`
allocates from), so its figures are the optimizer's ``memory_usage()`` and
``memory_buffers()`` to the byte, for any world size and rank, in one process and
without allocating or communicating anything.

It also gives the ZeRO paper's model-state formula (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, Sec. 5.1
and Fig. 1) for comparison. zerompi keeps no mixed-precision copies, so with ``P``
parameters of itemsize ``s`` and ``W`` ranks, Adam's model states (parameters,
gradients, two moments) per rank are, in bytes:

======  =====================  ==============  ===================================
stage   formula                float32         what is sharded
======  =====================  ==============  ===================================
0       ``4sP``                ``16P``         nothing (plain data parallelism)
1       ``2sP + 2sP/W``        ``8P + 8P/W``   the two Adam moments
2       ``sP + 3sP/W``         ``4P + 12P/W``  moments and gradients
3       ``4sP/W``              ``16P/W``       moments, gradients and parameters
======  =====================  ==============  ===================================

The exact figure differs from the formula only by the ceil-division of every bucket
over the ranks (less than one element per bucket and sharded array), plus what the
formula leaves out: the per-bucket staging buffers of stages 2-3 and the Adam
kernel's scratch block (``buffers_bytes``).

Command line: ``python -m zerompi.memory --params N --world W --stage S`` (or
``--mlp IN,HIDDEN,DEPTH,CLASSES`` for the driver's model); ``--help`` for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from .. import mlp
from ..buffers import CATEGORIES, Kind, Placement, StateKind, node_share
from ..config import ZeroConfig
from ..elastic import buddy_ranks, snapshot_bytes, snapshot_plan
from ..partition import (
    DEFAULT_BUCKET_ELEMS,
    SUPPORTED_DTYPES,
    Layout,
    default_group,
    optimizer_layout,
)
from ..plan import buffer_plan, full_grads_plan, stage_plan
from ..precision import Precision, precisions, resolve_dtype
from ..rules import Rule, rule_of
from ..settings import group_configs
from .traffic import step_traffic

#: (name, shape, dtype) of one parameter, in the model's order.
Spec = tuple[str, tuple[int, ...], np.dtype]

#: Kinds of planned buffer that are the ZeRO paper's model states; every other
#: buffer (staging, gather, scratch) is counted in ``buffers_bytes``.
#: (The update rule's states, :class:`zerompi.buffers.StateKind`, are model states too.)
MODEL_STATES = (Kind.PARAMS, Kind.PARAMS_LOW, Kind.MASTER, Kind.GRADS, Kind.GRADS_REDUCED)

#: Per stage, (unsharded, sharded) arrays of the four model states: the paper's
#: formula is ``itemsize * P * (unsharded + sharded / W)``.
PAPER_ARRAYS = {0: (4, 0), 1: (2, 2), 2: (1, 3), 3: (0, 4)}


class Checked(list):  # type: ignore[type-arg]
    """Specs :func:`check_specs` returned: checked once, not again by every estimate
    of a world's ranks."""


def check_specs(specs: Sequence[tuple[str, Sequence[int], Any]]) -> list[Spec]:
    """Validate ``(name, shape, dtype)`` triples as ``ZeroOptimizer`` validates its
    parameters, and normalise them (tuple shapes of ints, ``np.dtype``)."""
    if isinstance(specs, Checked):
        return specs
    out: list[Spec] = Checked()
    seen: set[str] = set()
    for item in specs:
        try:
            name, shape, dtype = item
        except (TypeError, ValueError):
            raise TypeError(f"a spec is (name, shape, dtype), got {item!r}") from None
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice")
        seen.add(name)
        dtype = np.dtype(dtype)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {dtype}; zerompi optimizes float32 or float64 arrays"
            )
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"parameter {name!r} has a negative dimension: {shape}")
        if math.prod(shape) == 0:
            raise ValueError(f"parameter {name!r} has no elements (shape {shape})")
        out.append((name, shape, dtype))
    if not out:
        raise ValueError("specs is empty: there is nothing to optimize")
    return out


def paper_bytes(params: Mapping[np.dtype, int], world_size: int, stage: int) -> float:
    """The ZeRO paper's model-state bytes per rank (real-valued: ``P/W`` unrounded)
    for ``params[dtype]`` parameters of each dtype (see the module docstring)."""
    unsharded, sharded = PAPER_ARRAYS[stage]
    return float(
        sum(
            np.dtype(dtype).itemsize * count * (unsharded + sharded / world_size)
            for dtype, count in params.items()
        )
    )


def bytes_per_param(stage: int, precision: Precision) -> tuple[int, int]:
    """``(replicated, sharded)`` bytes per parameter of the model states at
    ``precision``: a rank holds ``P * (replicated + sharded / W)`` (the table in the
    module docstring)."""
    m, p, r = precision.master.itemsize, precision.param.itemsize, precision.reduce.itemsize
    master = m if precision.low_params else 0  # a separate master copy
    reduced = m if precision.low_grads else 0  # the reduced gradient, summed in m
    return {
        0: (p + master + r + reduced + 2 * m, 0),
        1: (p + r, master + reduced + 2 * m),
        2: (p, master + m + 2 * m),
        3: (0, m + (p if precision.low_params else 0) + m + 2 * m),
    }[stage]


def formula_bytes(
    params: Mapping[np.dtype, int], world_size: int, stage: int,
    precisions: Mapping[np.dtype, Precision] | None = None, node_ranks: int = 1,
) -> float:  # fmt: skip
    """Model-state bytes per rank by :func:`bytes_per_param` (real-valued: ``P/W``
    unrounded); without ``precisions`` (one dtype throughout) the ZeRO paper's.
    ``node_ranks``: the parameters of stages 1-2 are one copy per node of that many
    ranks (node shared memory), of which a rank holds ``1/node_ranks``."""
    total = 0.0
    for dtype, count in params.items():
        dtype = np.dtype(dtype)
        prec = precisions[dtype] if precisions else Precision(dtype, dtype, dtype)
        replicated, sharded = bytes_per_param(stage, prec)
        if stage in (1, 2) and node_ranks > 1:  # the node's one copy, shared out
            replicated -= prec.param.itemsize
            total += count * prec.param.itemsize / node_ranks
        total += count * (replicated + sharded / world_size)
    return total


def estimate(
    specs: Sequence[tuple[str, Sequence[int], Any]],
    world_size: int,
    rank: int,
    stage: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    group_of: Callable[[str], str] = default_group,
    *,
    full_grads: bool = False,
    overlap: bool = True,
    param_dtype: object = None,
    reduce_dtype: object = None,
    shared_memory: bool | None = None,
    ranks_per_node: int | None = None,
    elastic: bool = False,
    snapshot_every: int = 10,
    optimizer: str = "adam",
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    traffic: bool = True,
) -> dict[str, Any]:
    """The memory of ``ZeroOptimizer`` on ``rank`` of ``world_size``, without MPI.

    ``specs`` are the parameters' ``(name, shape, dtype)`` in the mapping's order;
    ``stage``, ``bucket_elems``, ``group_of`` and ``overlap`` are the optimizer's
    arguments.
    ``full_grads`` adds the stage-2 full gradient buffer that ``opt.grads``
    allocates on first use (ignored in other stages, which allocate nothing there).
    ``param_dtype``, ``reduce_dtype`` and ``shared_memory`` are the optimizer's too;
    ``ranks_per_node`` (default: every rank on one node) places consecutive groups
    of that many ranks on one node, as ``ZEROMPI_NODE_SIZE`` does and launchers
    usually do (``shared_memory`` then decides as the optimizer does, assuming
    ``/dev/shm`` has room: :func:`uses_shared`). A node-shared buffer counts this
    rank's share (so the node's ranks add up to the node's bytes). ``elastic``: the
    in-memory snapshots of ``elastic=True`` (category ``snapshots``: this rank's shard
    state once, its source's twice; no node shared memory) and their traffic: the
    ``snapshot`` entry of ``traffic``, a snapshot's bytes per ``snapshot_every`` steps
    (what the driver's ``comm_bytes`` reports: its mean per step). ``optimizer``:
    the update rule (:mod:`zerompi.rules`), whose states and scratch are counted;
    ``param_groups`` (the optimizer's: names and settings) where the rule's workspace
    depends on them (Muon's: which matrices are Muon's, ``muon=False`` groups not).
    ``traffic=False`` leaves the traffic books out (``None``): what a sum or maximum
    over many ranks, which takes only the bytes held, skips.

    Returns a dict:

    * ``usage``: bytes per category, equal to ``opt.memory_usage()``;
    * ``buffers``: bytes per named buffer, equal to ``opt.memory_buffers()``;
    * ``exact_bytes``: bytes of the model-state arrays (parameters, gradients and
      the rule's states: Adam's ``exp_avg``, ``exp_avg_sq``) as laid out;
    * ``buffers_bytes``: everything else (staging / gather buckets, scratch);
    * ``total_bytes``: ``exact_bytes + buffers_bytes``, the sum of ``usage``;
    * ``paper_bytes``: the ZeRO paper's formula for the same model states with Adam
      (float);
    * ``traffic``: bytes this rank moves in one step, per collective, and of them
      what crosses a node boundary (:func:`zerompi.memory.traffic.step_traffic`:
      ``opt.comm.pop_traffic()`` after one step, to the byte);
    * and ``world_size``, ``rank``, ``stage``, ``bucket_elems``, ``params``
      (elements), ``params_by_dtype``, ``buckets``, ``max_bucket_elems``.
    """
    checked = check_specs(specs)
    layout = _layout(checked, world_size, rank, stage, bucket_elems, group_of)
    precs = precisions(
        list(layout.sizes), _sizing_dtype(param_dtype, "param_dtype"),
        _sizing_dtype(reduce_dtype, "reduce_dtype"),
    )  # fmt: skip
    per_node = ranks_per_node or world_size
    shared = uses_shared(False if elastic else shared_memory, world_size, per_node)
    count, local, peers = node_of(world_size, rank, per_node)
    low = any(p.low_grads for p in precs.values())
    stage_kinds = stage_plan(stage, shared, count == 1, low)
    rule = rule_of(optimizer)
    configs, member = group_configs(rule, rule.base(ZeroConfig(optimizer=optimizer)),
                                    param_groups, [name for name, _, _ in checked])  # fmt: skip
    workspace = rule.workspace(layout, stage, lambda name: configs[member[name]])
    plan = buffer_plan(layout, stage_kinds, overlap, precs, peers if count > 1 else None,
                       states=rule.states, scratch_blocks=rule.scratch_blocks,
                       workspace=workspace)  # fmt: skip
    if full_grads and stage == 2:
        plan += full_grads_plan(layout, precs, shared)
    books = step_traffic(layout, stage, precs, shared, per_node) if traffic else None
    if elastic:  # the snapshots (zerompi.elastic): this rank's and its source's (x2)
        members = [range(n * per_node, (n + 1) * per_node) for n in range(count)]
        buddy, source = buddy_ranks(world_size, rank, members if count > 1 else None)
        plan += snapshot_plan(layout, rank, source, rule.states, stage)
        sent = snapshot_bytes(layout, rank, rule.states, stage)
        received = snapshot_bytes(layout, source, rule.states, stage)
        far = (buddy // per_node != rank // per_node, source // per_node != rank // per_node)
        snapshot = {
            "sent": round(sent / snapshot_every), "received": round(received / snapshot_every),
            "sent_between": round(sent / snapshot_every) * far[0],
            "received_between": round(received / snapshot_every) * far[1],
        }  # fmt: skip
        if books is not None:
            books["snapshot"] = snapshot
    usage = dict.fromkeys(CATEGORIES, 0)
    buffers: dict[str, int] = {}
    exact = 0
    for buf in plan:
        nbytes = buf.nbytes
        if buf.placement is Placement.NODE_COPY:  # this rank's share of its node's copy
            nbytes = node_share(nbytes, per_node, local)
        usage[buf.category] += nbytes
        buffers[buf.name] = nbytes
        exact += nbytes if buf.kind in MODEL_STATES or isinstance(buf.kind, StateKind) else 0
    total = sum(usage.values())
    buffers = {_bf16_named(name): n for name, n in buffers.items()}  # (a stand-in's)
    return {
        "world_size": world_size,
        "rank": rank,
        "stage": stage,
        "bucket_elems": int(bucket_elems),
        "params": sum(layout.sizes.values()),
        "params_by_dtype": {dtype.name: size for dtype, size in layout.sizes.items()},
        "shared_memory": shared,
        "ranks_per_node": per_node,
        "nodes": count,
        "traffic": books,
        "buckets": len(layout.buckets),
        "max_bucket_elems": max(b.size for b in layout.buckets),
        "usage": usage,
        "buffers": buffers,
        "exact_bytes": exact,
        "buffers_bytes": total - exact,
        "total_bytes": total,
        "paper_bytes": paper_bytes(layout.sizes, world_size, stage),
        "formula_bytes": formula_bytes(
            layout.sizes, world_size, stage, precs, per_node if shared else 1
        ),
        "bytes_per_param": {d.name: bytes_per_param(stage, p) for d, p in precs.items()},
        "precision": {d.name: (_bf16_named(p.param.name), _bf16_named(p.reduce.name))
                      for d, p in precs.items()},
    }  # fmt: skip


#: What the estimator sizes a bfloat16 copy with: a 2-byte dtype that is no parameter's
#: (its name reads ``bfloat16`` in every result). The estimator only needs a bfloat16's
#: size, so it neither needs ``ml_dtypes`` (nor pays for importing it).
BFLOAT16_SIZE = np.dtype(np.int16)


def _sizing_dtype(value: object, what: str) -> np.dtype | None:
    """``resolve_dtype(value)``, but bfloat16 as :data:`BFLOAT16_SIZE`."""
    if isinstance(value, str) and value.strip().lower() in ("bfloat16", "bf16"):
        return BFLOAT16_SIZE
    if isinstance(value, np.dtype) and value.name == "bfloat16":
        return BFLOAT16_SIZE
    return resolve_dtype(value, what)


def _bf16_named(name: str) -> str:
    """A buffer or dtype name with :data:`BFLOAT16_SIZE` read as bfloat16."""
    parts = name.split(".")
    return ".".join("bfloat16" if p == BFLOAT16_SIZE.name else p for p in parts)


#: The last layout :func:`estimate` built, on rank 0: ``(key, layout)``. An estimate
#: of several ranks of one world (a node's ranks, the maximum over ranks) builds the
#: buckets once and derives each rank's from it (:meth:`Layout.for_rank`).
_last_layout: list[tuple[tuple[Any, ...], Layout]] = []


def _layout(
    specs: Sequence[Spec], world_size: int, rank: int, stage: int, bucket_elems: int,
    group_of: Callable[[str], str],
) -> Layout:  # fmt: skip
    """:func:`zerompi.partition.optimizer_layout`, remembered for the next rank."""
    key = (tuple((n, tuple(s), d) for n, s, d in specs), world_size, stage, bucket_elems,
           group_of)  # fmt: skip
    if _last_layout and _last_layout[0][0] == key:
        return _last_layout[0][1].for_rank(rank)
    layout = optimizer_layout(specs, world_size, 0, stage, bucket_elems, group_of)
    _last_layout[:] = [(key, layout)]
    return layout.for_rank(rank)


def uses_shared(asked: bool | None, world_size: int, ranks_per_node: int) -> bool:
    """Whether an optimizer uses node shared memory (:func:`zerompi.engine.choose_shared`,
    assuming room in ``/dev/shm``): not when ``asked`` is ``False``, by default only
    with more than one rank per node, and only with nodes of equal size."""
    if asked is False or (asked is None and min(world_size, ranks_per_node) == 1):
        return False
    return world_size % ranks_per_node == 0


def node_of(world_size: int, rank: int, ranks_per_node: int) -> tuple[int, int, list[int]]:
    """``(nodes, local index, peers)`` of ``rank`` when consecutive groups of
    ``ranks_per_node`` ranks are one node: the peers are the ranks with its local
    index on every node (:attr:`zerompi.mpi.nodes.Nodes.peers`)."""
    nodes = -(-world_size // ranks_per_node)
    local = rank % ranks_per_node
    peers = [n * ranks_per_node + local for n in range(nodes)]
    peers = [r for r in peers if r < world_size]
    return nodes, local, peers


def estimate_node(
    specs: Sequence[tuple[str, Sequence[int], Any]], world_size: int, node: int, stage: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS, group_of: Callable[[str], str] = default_group,
    *, ranks_per_node: int | None = None, **options: Any,
) -> dict[str, int]:  # fmt: skip
    """Bytes per category that node ``node`` holds: the sum of :func:`estimate` over
    its ranks (a node-shared buffer once)."""
    per_node = ranks_per_node or world_size
    total = dict.fromkeys(CATEGORIES, 0)
    specs = check_specs(specs)  # (once for all its ranks)
    for rank in range(node * per_node, min((node + 1) * per_node, world_size)):
        one = estimate(specs, world_size, rank, stage, bucket_elems, group_of,
                       ranks_per_node=per_node, traffic=False, **options)  # fmt: skip
        for cat, value in one["usage"].items():
            total[cat] += value
    return total


def estimate_max(
    specs: Sequence[tuple[str, Sequence[int], Any]],
    world_size: int,
    stage: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    group_of: Callable[[str], str] = default_group,
    **options: Any,
) -> dict[str, Any]:
    """The maximum over ranks of every figure of :func:`estimate` (``options``: its
    keyword arguments): rank 0's.

    ``shard_range`` gives rank 0 ``min(ceil(n/W), n)`` elements of every bucket of
    ``n``, at least as many as any other rank, and every planned buffer's size is
    either the same on all ranks or non-decreasing in the rank's shard sizes. So
    rank 0 holds the most in every category and every buffer at once (this is what
    the driver's per-category ``max`` over ranks reports).

    With ``elastic``, a rank also holds its *source's* snapshot twice (the rank before
    it, or the rank with its local index on the node before): the most is then held by
    rank 1 or by rank L (``ranks_per_node``), whose source is rank 0; every figure is
    the maximum over ranks 0, 1 and L. With an update rule whose states are held per
    block or matrix (8-bit Adam's scales, Adafactor's rows and columns), or with a
    workspace (Muon's: the matrices a rank owns), each figure is the maximum over
    every rank (a rank with a smaller shard may touch more units, or own more).
    """
    specs = check_specs(specs)  # (once for all the ranks)
    first = estimate(specs, world_size, 0, stage, bucket_elems, group_of, **options)
    others: set[int] = set()
    if options.get("elastic"):
        others |= {1, options.get("ranks_per_node") or world_size}
    rule = rule_of(options.get("optimizer", "adam"))
    if rule.units or type(rule).workspace is not Rule.workspace:
        # A state held per block or matrix has an entry for every unit a rank's part
        # touches: a rank with a smaller shard may touch more of them; a workspace
        # (Muon's) depends on the matrices a rank owns. Every rank.
        others |= set(range(world_size))
    for rank in sorted(others - {0}):
        if rank < world_size:
            other = estimate(specs, world_size, rank, stage, bucket_elems, group_of,
                             traffic=False, **options)  # fmt: skip
            for key in ("usage", "buffers"):
                for name, value in other[key].items():
                    first[key][name] = max(first[key].get(name, 0), value)
    first["total_bytes"] = sum(first["usage"].values())
    return first


def flat_specs(params: int, layer_elems: int, dtype: Any = np.float32) -> list[Spec]:
    """``params`` elements as ``ceil(params / layer_elems)`` 1-D parameters ``p0``,
    ``p1``, ... of ``layer_elems`` elements (the last one smaller), each its own
    group."""
    if params < 1 or layer_elems < 1:
        raise ValueError(f"params and layer_elems must be >= 1, got {params}, {layer_elems}")
    dtype = np.dtype(dtype)
    count = -(-params // layer_elems)
    last = params - (count - 1) * layer_elems
    return [(f"p{i}", (layer_elems if i < count - 1 else last,), dtype) for i in range(count)]


def mlp_specs(
    in_dim: int, hidden: int, depth: int, classes: int, dtype: Any = np.float32
) -> list[Spec]:
    """The parameters of the driver's MLP (:func:`zerompi.mlp.init_params`):
    ``layer{i}.weight`` of shape ``(fan_in, fan_out)`` and ``layer{i}.bias`` of shape
    ``(fan_out,)``, in layer order."""
    dtype = np.dtype(dtype)
    sizes = mlp.layer_sizes(in_dim, hidden, depth, classes)
    specs: list[Spec] = []
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        specs.append((f"layer{i}.weight", (fan_in, fan_out), dtype))
        specs.append((f"layer{i}.bias", (fan_out,), dtype))
    return specs
