"""What differs between stages, as data: a :class:`StagePlan` of decisions made once,
the buffers it needs (:func:`buffer_plan`) and, per bucket, a :class:`Part` saying
where its gradient, parameters and moments live on this rank.

======  ==========  ====================  =============  ===============================
stage   parameters  gradients             Adam moments   reduction / gather
======  ==========  ====================  =============  ===============================
0       full        full                  full           Allreduce; no gather
1       full        full                  shard          Reduce_scatter at step; Allgatherv
2       full        shard (+2 buckets)    shard          Ireduce_scatter per bucket as its
                                                         gradients arrive; Iallgatherv
3       shard       shard (+2 buckets)    shard          as 2; parameters Allgatherv'd per
                                                         layer into 1 bucket when used
======  ==========  ====================  =============  ===============================

(The MPI path. With node shared memory, :attr:`StagePlan.node_memory`: one parameter
copy per node in stages 1-2 and in 3 on one node, stage 3's gathered layers once per
node over several; the full gradient buffers of stages 0 and 1 and the
staging buckets of 2-3 summed within a node; see :mod:`zerompi.mpi.nodes` and
:mod:`zerompi.nodesum`.)

The plan names, for the engine to build once (:mod:`zerompi.engine`), the three
strategies that differ between stages: how the model reads its parameters
(:class:`Access`, :mod:`zerompi.handover`), how a bucket's gradients are reduced
(:class:`Reduce`, :mod:`zerompi.reduction`) and how the updated parameters are
published after Adam (:class:`Publish`, :mod:`zerompi.gather`). The step never asks
which stage it runs. The parts are views computed once, here, so a step does no
per-bucket lookups. Pure numpy: no MPI here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import blockwise
from .adam import BLOCK
from .buffers import AnyKind, Kind, Placement, PlannedBuffer, StateKind, Stores
from .partition import Layout
from .precision import Precision


def state_kinds(states: Sequence[StateKind]) -> tuple[AnyKind, ...]:
    """The kinds of state a checkpoint (and an elastic snapshot) holds, in file order:
    the parameters, then the update rule's ``states``."""
    return (Kind.PARAMS, *states)

#: Staging slots of stages 2-3 with ``overlap``: one bucket is reduced while the next
#: one's gradients are being added.
OVERLAP_SLOTS = 2

#: Stage 0-1 reductions in flight at once in ``step()`` (:mod:`zerompi.reducer`):
#: bucket i+2 starts when bucket i is complete. Starting all of them at once measured
#: as slow as one collective on the whole buffer (2.5x slower than bucket by bucket at
#: 64M parameters): MPICH works on all of them together and the working set leaves
#: the cache. Also the receive regions a 16-bit reduction of stages 0-1 needs.
REDUCE_WINDOW = 2


def staging_slots(overlap: bool) -> int:
    """Stages 2-3's staging slots: two with ``overlap``, else one."""
    return OVERLAP_SLOTS if overlap else 1


def gather_slots(overlap: bool) -> int:
    """Stage 3's gather buffers: two with ``overlap`` (the next layer's gather moves
    while the model uses the current one, :mod:`zerompi.prefetch`), else one."""
    return 2 if overlap else 1


class Access(Enum):
    """How the model reads its parameters (:mod:`zerompi.handover`)."""

    #: Every rank holds every parameter all the time (stages 0-2).
    RESIDENT = "resident"
    #: Stage 3 on one node: the node's one copy, read in place.
    NODE_COPY = "node copy"
    #: Stage 3: a layer is gathered into zerompi's gather buffers when used.
    GATHERED = "gathered"
    #: Stage 3 without gather buffers: the caller gathers into its own memory.
    CALLER_GATHERS = "caller gathers"


class Reduce(Enum):
    """How a bucket's gradients become its reduced shard (:mod:`zerompi.reduction`)."""

    #: Stage 0: ``Allreduce`` of the whole bucket.
    ALLREDUCE = "allreduce"
    #: ``Ireduce_scatter`` with exact counts, into the shard.
    REDUCE_SCATTER = "reduce_scatter"
    #: Gradients narrower than the master (16-bit) over MPI: ``Alltoallv`` of every
    #: rank's part, summed here in the master dtype (MPI never sums 16 bits).
    SPLIT = "split"
    #: Node shared memory: each rank sums its region from its node's buffers, then
    #: (over several nodes) a cross-node ``Ireduce_scatter`` of the node sums.
    NODE_SUM = "node sum"


class Publish(Enum):
    """How the updated parameters reach every rank after Adam (:mod:`zerompi.gather`)."""

    #: Nothing to publish: stage 0 (Adam ran everywhere) and stage 3 (gathered on use).
    NONE = "none"
    #: ``Iallgatherv`` of each bucket as Adam finishes it.
    ALLGATHERV = "allgatherv"
    #: Adam wrote the node's one copy in place: only other nodes' parts are gathered.
    NODE = "node"


@dataclass(frozen=True)
class StagePlan:
    """How one stage keeps and moves its data: the decisions the engine builds its
    strategies from, once."""

    stage: int
    #: Every rank holds every parameter (stages 0-2, and 3 on one node in node memory).
    full_params: bool
    #: The model adds into full gradient buffers, reduced at ``step()`` (stages 0-1);
    #: else gradients are handed over bucket by bucket and reduced as they arrive.
    full_grads: bool
    access: Access
    #: How each bucket's gradients are reduced, in the master dtype and narrower
    #: (16-bit, :meth:`reduction`).
    reduce: Reduce
    reduce_low: Reduce
    publish: Publish
    #: The kinds of buffer placed in node shared memory, each as its
    #: :attr:`zerompi.buffers.Kind.shared` says (empty: none).
    node_memory: frozenset[Kind] = frozenset()
    #: Stage 2: ``opt.grads`` may add full-size gradient buffers (reduced per
    #: micro-batch); stage 3 has none.
    full_grads_on_demand: bool = False

    @property
    def shared_memory(self) -> bool:
        return bool(self.node_memory)

    def reduction(self, precision: Precision) -> Reduce:
        """How a bucket of ``precision`` is reduced."""
        return self.reduce_low if precision.low_grads else self.reduce


def stage_plan(
    stage: int, shared_memory: bool, one_node: bool = False, low_grads: bool = False,
    layer_buffers: bool = True,
) -> StagePlan:  # fmt: skip
    """The plan of ``stage``. With ``shared_memory``:

    * stage 0 keeps its full gradient buffers in node shared memory (not
      ``low_grads``): each rank sums its region of a bucket from every node rank's
      buffer (on one node its shard, with the statistics in the same pass; over
      several, the ranks of its local index reduce-scatter their node's sums and
      gather the results back across nodes), and then copies the others' regions into
      its own buffer (:class:`zerompi.nodesum.NodeCopies`), where MPI's ``Allreduce``
      would move each byte through its shared cells; the parameters and states stay
      every rank's own (stage 0 updates them all on every rank);

    * the parameters are one copy per node at stages 1-2, and at stage 3 on
      ``one_node`` too (the node's ranks' shards together are the whole model, so the
      node holds what it would hold sharded, and a layer is read in place); stage 3
      over several nodes keeps its gathered layers once per node instead;
    * the gradients live in node shared memory, summed within the node there and
      across nodes by MPI: the staging buckets of stages 2-3, and stage 1's full
      buffers unless they are 16-bit (``low_grads``: reduced per micro-batch by MPI).

    ``layer_buffers=False`` (stage 3 without a node copy): no gather buffers; the
    caller gathers into its own memory (the torch adapter)."""
    if stage == 0:
        grads = shared_memory and not low_grads
        return StagePlan(
            stage=0, full_params=True, full_grads=True, access=Access.RESIDENT,
            reduce=Reduce.NODE_SUM if grads else Reduce.ALLREDUCE, reduce_low=Reduce.SPLIT,
            publish=Publish.NONE, node_memory=frozenset({Kind.GRADS} if grads else ()),
        )  # fmt: skip
    shared = shared_memory
    node_copy = shared and (stage <= 2 or one_node)
    kinds: set[Kind] = set()
    if node_copy:
        kinds.add(Kind.PARAMS)
    elif shared:  # stage 3 over several nodes: the gathered layers, one copy per node
        kinds.add(Kind.PARAM_BUCKET)
    if shared and stage >= 2:
        kinds.add(Kind.GRAD_BUCKET)
    elif shared and stage == 1 and not low_grads:
        kinds.add(Kind.GRADS)
    if stage <= 2 or node_copy:
        access = Access.RESIDENT if stage <= 2 else Access.NODE_COPY
    else:
        access = Access.GATHERED if layer_buffers else Access.CALLER_GATHERS
    if stage == 1:
        reduce = Reduce.NODE_SUM if Kind.GRADS in kinds else Reduce.REDUCE_SCATTER
        low = Reduce.SPLIT
    else:
        reduce = Reduce.NODE_SUM if shared else Reduce.REDUCE_SCATTER
        low = Reduce.NODE_SUM if shared else Reduce.SPLIT
    publish = Publish.NODE if node_copy else (
        Publish.NONE if stage in (0, 3) else Publish.ALLGATHERV)  # fmt: skip
    if access is Access.CALLER_GATHERS:
        kinds.discard(Kind.PARAM_BUCKET)
    return StagePlan(
        stage=stage, full_params=stage <= 2 or node_copy, full_grads=stage <= 1,
        access=access, reduce=reduce, reduce_low=low, publish=publish,
        node_memory=frozenset(kinds), full_grads_on_demand=stage == 2,
    )  # fmt: skip


def buffer_plan(
    layout: Layout, plan: StagePlan, overlap: bool = True,
    precisions: Mapping[np.dtype, Precision] | None = None,
    region: Sequence[int] | None = None, *, states: Sequence[StateKind],
    scratch_blocks: int = 1, workspace: Mapping[np.dtype, int] | None = None,
) -> list[PlannedBuffer]:  # fmt: skip
    """Every buffer an optimizer of ``plan`` allocates at construction on the rank of
    ``layout``, in allocation order, each placed as the plan says: the one
    description the engine allocates from and :mod:`zerompi.memory` estimates from.
    Over several nodes with node memory, ``region`` (the ranks whose shards this rank
    sums within its node, :attr:`zerompi.mpi.nodes.Nodes.peers`) sizes the buffer of
    those sums, one per staging slot (stage 1: per reduction in flight), that the
    cross-node reduce-scatter sends.

    Per master dtype ``M`` (the arrays' own), with ``P``/``R`` the parameter and
    reduce dtypes (:mod:`zerompi.precision`; ``M`` by default): the parameters the
    model reads in ``P`` (full in stages 0-2; in 3 the shard, kept in ``M``, plus its
    ``P`` copy when ``P`` differs); the master copy in ``M`` when ``P`` differs (all
    of it in stage 0, the shard in 1-2); the gradients the model adds into, in ``R``
    (full in 0-1; 2-3 stage them in buckets, two with ``overlap``, else one); the
    reduced gradient in ``M`` (the shard in 2-3, and in 0-1 when ``R`` differs: the
    shard in 1, all in 0); where ``R`` is narrower and the reduction goes through
    MPI, a receive buffer per staging bucket for every rank's part; one bucket of
    parameter gathering in ``P`` per gather slot (3: two with ``overlap``); the update
    rule's ``states`` (Adam's two moments) in ``M`` over what the rule runs on
    (everything in stage 0, the shard otherwise), its ``scratch_blocks`` scratch
    blocks and its ``workspace`` (elements of ``M``, where it has one:
    :meth:`zerompi.rules.Rule.workspace`).
    """
    stage, shared = plan.stage, plan.shared_memory
    out: list[PlannedBuffer] = []
    sharded = not plan.full_params
    # Over several nodes the node's sums of this rank's region go across nodes.
    node_sums = shared and region is not None and len(region) > 1
    low_any = any(p.low_grads for p in (precisions or {}).values())

    def widest(dtype: np.dtype) -> int:  # elements of the widest region of a bucket
        # (a bucket's counts follow from its size: each size once, for thousands of
        # buckets of a few sizes)
        firsts = {b.size: b for b in layout.buckets if b.dtype == dtype}
        return max((sum(b.counts[r] for r in region or ()) for b in firsts.values()),
                   default=0)  # fmt: skip

    def add(kind: AnyKind, dtype: np.dtype, count: int, group: np.dtype) -> None:
        placement = kind.shared if kind in plan.node_memory else Placement.PRIVATE
        out.append(PlannedBuffer(kind, dtype, count, group, placement))

    for dtype, size in layout.sizes.items():
        prec = precisions[dtype] if precisions else Precision(dtype, dtype, dtype)
        p_dt, r_dt = prec.param, prec.reduce
        shard = layout.shard_sizes[dtype]
        local = size if stage == 0 else shard  # what Adam runs on
        slots = staging_slots(overlap)
        if sharded:
            add(Kind.PARAMS, dtype, shard, dtype)
            if prec.low_params:
                add(Kind.PARAMS_LOW, p_dt, shard, dtype)
        else:
            add(Kind.PARAMS, p_dt, size, dtype)
            if prec.low_params:
                add(Kind.MASTER, dtype, local, dtype)
        if stage <= 1:
            add(Kind.GRADS, r_dt, size, dtype)
            if prec.low_grads:
                add(Kind.GRADS_REDUCED, dtype, local, dtype)
            elif node_sums and not low_any:  # node sums, per window slot
                add(Kind.GRAD_NODE, dtype, widest(dtype) * REDUCE_WINDOW, dtype)
        else:
            add(Kind.GRADS, dtype, shard, dtype)
            add(Kind.GRAD_BUCKET, r_dt, layout.max_bucket(dtype) * slots, dtype)
            if node_sums:
                add(Kind.GRAD_NODE, dtype, widest(dtype) * slots, dtype)
        if prec.low_grads and not (shared and stage >= 2):  # Reduce.SPLIT's receive regions
            parts = (slots if stage >= 2 else REDUCE_WINDOW) * layout.world_size
            add(Kind.GRAD_RECV, r_dt, parts * layout.max_part(dtype), dtype)
        if sharded and plan.access is not Access.CALLER_GATHERS:
            add(Kind.PARAM_BUCKET, p_dt, layout.max_bucket(dtype) * gather_slots(overlap), dtype)
        for kind in states:
            count = (blockwise.count(layout, stage, dtype, blockwise.spans_of(kind, layout, dtype))
                     if kind.units else local)  # fmt: skip
            add(kind, kind.storage(dtype), count, dtype)
        add(Kind.SCRATCH, dtype, min(BLOCK, max(local, 1)) * scratch_blocks, dtype)
        if workspace and workspace.get(dtype):
            add(Kind.WORKSPACE, dtype, workspace[dtype], dtype)
    return out


def full_grads_plan(
    layout: Layout, precisions: Mapping[np.dtype, Precision] | None = None,
    shared_memory: bool = False,
) -> list[PlannedBuffer]:  # fmt: skip
    """The full-size gradient buffers (in the reduce dtype) a stage-2 optimizer adds
    the first time ``opt.grads`` is used (the non-streamed hand-over; see
    ``ZeroOptimizer.grads``), and, for narrower gradients where the staging buckets
    reduce through shared memory (so :func:`buffer_plan` has none), one receive
    region for their reduction over MPI."""
    reduce = {d: precisions[d].reduce if precisions else d for d in layout.sizes}
    out = [PlannedBuffer(Kind.GRADS_FULL, reduce[dtype], size, dtype)
           for dtype, size in layout.sizes.items()]  # fmt: skip
    for d in layout.sizes if shared_memory else ():
        if reduce[d] != d:
            count = layout.world_size * layout.max_part(d)
            out.append(PlannedBuffer(Kind.GRAD_RECV, reduce[d], count, d))
    return out


class Part(NamedTuple):
    """Bucket ``index`` on this rank, as Adam and the statistics see it."""

    index: int
    #: The reduced (summed) gradient of what Adam updates, once the reduction is done.
    grad: np.ndarray
    #: The elements of ``grad`` this rank counts in the global statistics (each
    #: element of the model is counted by exactly one rank).
    stats: np.ndarray
    #: The parameters Adam updates (this rank's shard, or the bucket in stage 0).
    param: np.ndarray
    #: The update rule's states over ``param`` (Adam: ``exp_avg``, ``exp_avg_sq``).
    states: tuple[np.ndarray, ...]
    scratch: np.ndarray
    #: The whole bucket of parameters (stages 0-2), what a gather fills; else None.
    full_param: np.ndarray | None
    #: The whole bucket of the full gradient buffer (stages 0-1), what is reduced.
    full_grad: np.ndarray | None
    #: Where Adam writes the updated ``param`` rounded to the parameter dtype, when
    #: that is narrower than the master's (the model's copy: part of ``full_param`` in
    #: stages 0-2, the 16-bit shard that stage 3 gathers from); else None.
    low: np.ndarray | None = None

    @property
    def gather_source(self) -> np.ndarray:
        """What stage 3 gathers this bucket from: the shard, or its rounded copy."""
        return self.param if self.low is None else self.low


def shard_of(store: Mapping[np.dtype, np.ndarray], layout: Layout, index: int) -> np.ndarray:
    """This rank's shard of bucket ``index`` in a shard-sized buffer."""
    bucket = layout.buckets[index]
    lo = bucket.shard_offset
    return store[bucket.dtype][lo : lo + bucket.counts[layout.rank]]


def bucket_parts(
    plan: StagePlan, layout: Layout, stores: Stores, states: Sequence[StateKind]
) -> list[Part]:
    """Every bucket's :class:`Part` over the optimizer's buffers (``stores`` by kind,
    then master dtype, as :func:`buffer_plan` plans them; ``states``: the rule's)."""
    parts = []
    params, grads = stores[Kind.PARAMS], stores[Kind.GRADS]
    master, params_low = stores.get(Kind.MASTER, {}), stores.get(Kind.PARAMS_LOW, {})
    reduced = stores.get(Kind.GRADS_REDUCED, {})
    summed_in_place = Kind.GRADS in plan.node_memory  # peers read the rest of the bucket
    units = {  # per state held by units, per bucket: its entries in the state's buffer
        kind: {s.index: slice(s.at, s.at + s.count) for d in layout.sizes
               for s in blockwise.slots(layout, plan.stage, d, blockwise.spans_of(kind, layout, d))}
        for kind in states if kind.units}  # fmt: skip
    for index, bucket in enumerate(layout.buckets):
        dtype, (lo, hi) = bucket.dtype, bucket.local(layout.rank)
        whole = slice(bucket.start, bucket.stop)
        mine = slice(bucket.shard_offset, bucket.shard_offset + hi - lo)
        full_param = params[dtype][whole] if plan.full_params else None
        full_grad = grads[dtype][whole] if plan.full_grads else None
        low: np.ndarray | None = None
        if plan.stage == 0:  # everything everywhere; count each element once
            moments = whole
            grad = reduced[dtype][whole] if dtype in reduced else full_grad
            param = full_param
            if dtype in master:
                param, low = master[dtype][whole], full_param
            stats = grad[lo:hi]  # type: ignore[index]
        else:
            moments = mine
            if full_grad is None:
                grad = shard_of(grads, layout, index)
            elif dtype in reduced:
                grad = reduced[dtype][mine]
            elif summed_in_place:  # summed into its place: peers read the rest
                grad = full_grad[lo:hi]
            else:  # stage 1 reduces in place: the shard lands at the top of the bucket
                grad = full_grad[: hi - lo]
            stats = grad
            if full_param is not None:
                param = full_param[lo:hi]
                if dtype in master:
                    param, low = master[dtype][mine], param
            else:
                param = shard_of(params, layout, index)
                if dtype in params_low:
                    low = shard_of(params_low, layout, index)
        held = tuple(
            stores[kind][dtype][units[kind][index]] if kind.units
            else stores[kind][dtype][moments] for kind in states)  # fmt: skip
        scratch = stores[Kind.SCRATCH][dtype]
        part = Part(
            index, grad, stats, param, held, scratch, full_param, full_grad, low
        )  # type: ignore[arg-type]
        parts.append(part)
    return parts


class Run(NamedTuple):
    """Consecutive buckets whose arrays continue one another in memory, so one kernel
    call covers them all (stage 3's one-layer buckets: one Adam call per dtype, not
    one per layer). ``last`` is the index of its last bucket, ``first`` of its first."""

    last: int
    arrays: tuple[np.ndarray, ...]
    scratch: np.ndarray  # the kernel's scratch block of the run's dtype
    first: int


def _continues(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.ctypes.data + a.nbytes == b.ctypes.data


def runs(parts: Sequence[Part], fields: tuple[str, ...], merge: bool) -> list[Run]:
    """The parts' ``fields`` (e.g. ``("param", "grad", "states", "low")``; ``states``
    stands for each of the rule's states) grouped into runs of buckets that continue
    one another in every field (only with ``merge``; else one run per bucket), each
    field joined into one view."""
    out: list[Run] = []
    for part in parts:
        arrays = tuple(a for f in fields for a in (
            getattr(part, f) if f == "states" else (getattr(part, f),)))  # fmt: skip
        if merge and out and all(
            _continues(a, b) for a, b in zip(out[-1].arrays, arrays, strict=True)
        ):
            joined = tuple(
                None if a is None else
                as_strided(a, shape=(a.size + b.size,), strides=(a.itemsize,), writeable=True)
                for a, b in zip(out[-1].arrays, arrays, strict=True)
            )  # same buffer, continuing: one longer view of it  # fmt: skip
            out[-1] = Run(part.index, joined, part.scratch, out[-1].first)
        else:
            out.append(Run(part.index, arrays, part.scratch, part.index))
    return out


# -- the state: master parameters and moments ---------------------------------------------


def masters(stores: Stores) -> dict[np.dtype, np.ndarray]:
    """Per master dtype, the buffer of the master parameters: full on every rank
    where :func:`master_is_full`, else this rank's shards."""
    low = stores.get(Kind.MASTER, {})
    return {d: low.get(d, flat) for d, flat in stores[Kind.PARAMS].items()}


def master_is_full(plan: StagePlan, stores: Stores, dtype: np.dtype) -> bool:
    """Whether the master parameters of ``dtype`` are full on every rank."""
    separate = dtype in stores.get(Kind.MASTER, {})  # a narrower param_dtype
    return plan.stage == 0 or (plan.full_params and not separate)


def state_views(
    plan: StagePlan, layout: Layout, stores: Stores, states: Sequence[StateKind]
) -> list[tuple[str, int, np.ndarray]]:
    """``(section, first global element, this rank's shard)`` of every bucket of every
    kind of state (:func:`state_kinds`) with one entry per element, in one fixed
    order: writable views of the buffers (what checkpoints write and read, and elastic
    snapshots send). The states held per unit: :func:`unit_views`."""
    flat = masters(stores)
    out = []
    for kind in state_kinds(states):
        if isinstance(kind, StateKind) and kind.units:
            continue  # (unit_views)
        store = flat if kind is Kind.PARAMS else stores[kind]
        for index, bucket in enumerate(layout.buckets):
            lo, hi = bucket.local(layout.rank)
            full = plan.stage == 0 or (
                kind is Kind.PARAMS and master_is_full(plan, stores, bucket.dtype))  # fmt: skip
            if full:
                shard = store[bucket.dtype][bucket.start + lo : bucket.start + hi]
            else:
                shard = shard_of(store, layout, index)
            out.append((f"{kind.label}.{bucket.dtype.name}", bucket.start + lo, shard))
    return out


def snapshot_views(
    plan: StagePlan, layout: Layout, stores: Stores, states: Sequence[StateKind]
) -> list[np.ndarray]:
    """Writable views of this rank's whole shard state in the order of
    :func:`zerompi.elastic.pieces`: :func:`state_views`' shards, then every entry this
    rank holds of the states held per unit (what an elastic snapshot sends and a
    recovery fills)."""
    shards = [shard for _, _, shard in state_views(plan, layout, stores, states)]
    return shards + [entry.held for _, entry in unit_views(plan, layout, stores, states)]


def unit_views(
    plan: StagePlan, layout: Layout, stores: Stores, states: Sequence[StateKind]
) -> list[tuple[str, blockwise.Entry]]:
    """``(section, entry)`` of every bucket of every state held per unit (block,
    matrix row or column, vector element: :class:`zerompi.blockwise.Entry`, what this
    rank reads and what it writes), in one fixed order, after :func:`state_views`'."""
    written = [(b.start + lo, hi - lo) for b in layout.buckets
               for lo, hi in (b.local(layout.rank),)]  # fmt: skip
    return [
        (f"{kind.label}.{entry.dtype.name}", entry)
        for kind in states if kind.units
        for entry in blockwise.entries(
            layout, plan.stage, stores[kind],
            {d: blockwise.spans_of(kind, layout, d) for d in layout.sizes}, written)
    ]  # fmt: skip
