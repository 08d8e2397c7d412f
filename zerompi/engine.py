"""The engine: every part of a sharded optimizer, built by one function, once.

:func:`build_engine` takes checked settings (:func:`zerompi.config.settle`), a
communicator and this rank's layout, and builds an :class:`Engine`: the stage's plan
(:mod:`zerompi.plan`), every flat buffer from the one buffer plan (through the
:class:`zerompi.buffers.BufferPool`, which nothing else touches), the per-bucket
parts, and the strategies the plan names, each chosen here and never again: the
parameter access (:mod:`zerompi.handover`), the gradient scheduler with one
reduction backend per bucket (:mod:`zerompi.reducer`, :mod:`zerompi.reduction`), the
publisher after Adam (:mod:`zerompi.gather`) and the in-memory snapshots of an
elastic optimizer (:mod:`zerompi.elastic`). The step (:mod:`zerompi.step`), the state
functions (:mod:`zerompi.state`) and checkpoints take the engine; the optimizer
(:class:`zerompi.optimizer.ZeroOptimizer`) is a front object over it, and a recovery
from a lost rank builds a new engine for the survivors and swaps it in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import reducer
from .arrays import FlatArrays
from .blockwise import Agreement, Spans, held, spans_of
from .buffers import BufferPool, Kind, Placement, PlannedBuffer, Stores
from .config import Settings
from .elastic import NoSnapshots, Snapshots, buddy_ranks, elastic_setup, snapshot_plan
from .gather import MPIGather, NodeGather, NoGather
from .handover import Access, CallerGathers, Found, Gathered, Names, NodeCopy, Resident
from .initial import initialize_by_bucket, initialize_whole
from .mpi.collectives import Comm
from .mpi.nodes import Nodes, enable_heartbeat, nodes_of
from .nodesum import NodeCopies, NodeSum, StatsRuns
from .partition import Deferred, Layout
from .plan import (
    REDUCE_WINDOW,
    Part,
    Publish,
    Reduce,
    Run,
    StagePlan,
    bucket_parts,
    buffer_plan,
    full_grads_plan,
    gather_slots,
    runs,
    snapshot_views,
    stage_plan,
    staging_slots,
)
from .plan import (
    Access as AccessKind,
)
from .precision import LossScale, Precision, low_base
from .prefetch import LayerGather
from .reducer import FullGradients, StagedGradients, staging_offsets
from .reduction import (
    Allreduce,
    Backend,
    GatherReduced,
    NodeReduce,
    Reduced,
    ReduceScatter,
    Split,
)
from .rules import Rule
from .rules.base import World
from .settings import Segment, adam_segments
from .timings import Timings

if TYPE_CHECKING:
    from .config import ZeroConfig

#: ``opt.gradients`` blocks end by calling this with what they handed over (the
#: optimizer's guarded method, which calls :meth:`Engine.handed_over`).
HandedOver = Callable[[Found], None]


@dataclass(eq=False)
class Engine:
    """A sharded optimizer's state and strategies on one rank (see the module
    docstring); the training counters are the engine's too, so that a checkpoint or a
    snapshot holds everything a step depends on."""

    settings: Settings
    comm: Comm
    layout: Layout
    nodes: Nodes
    plan: StagePlan
    pool: BufferPool
    stores: Stores
    parts: list[Part]
    names: Names
    #: Parameter names in the model's order (the mapping's).
    order: list[str]
    access: Access
    reducer: FullGradients | StagedGradients
    gatherer: NoGather
    #: The update rule's runs of buckets contiguous in memory (arrays: ``param``,
    #: ``grad``, each state, ``low``), per run the index of its first rounded element
    #: in its buffer (stochastic rounding's stream position) and its segments of one
    #: parameter group (:func:`zerompi.settings.adam_segments`).
    update_runs: list[Run]
    low_bases: list[int]
    segments: list[list[Segment]]
    #: Per run, the global element (in its dtype's flat parameters) of its first
    #: element (what a rule with states per unit, or that prepares, reads: its runs
    #: are one bucket each).
    update_offsets: list[int]
    #: Per run, per state of the rule: for a state held per unit, its units over the
    #: run's dtype and the run's first entry (:func:`zerompi.blockwise.in_run`); else
    #: None.
    update_units: list[list[tuple[Spans, int] | None]]
    #: Per run, the run-local elements this rank counts in statistics over all ranks
    #: (its shard; at stage 0, its part of the bucket).
    update_counted: list[tuple[int, int]]
    #: What a rule that prepares sees of the model and the ranks (None otherwise).
    world: World | None
    #: Where the rule has per-block states: the end of each update's agreement on the
    #: blocks that parts share (:class:`zerompi.blockwise.Agreement`); else None.
    agreement: Agreement | None
    stats_runs: StatsRuns
    #: Every parameter group's hyperparameters (the rule's config type; changed by
    #: ``set_hyperparameters``) and each parameter's group.
    configs: list[Any]
    member: dict[str, int]
    scaler: LossScale | None
    snapshots: Snapshots | NoSnapshots = field(default_factory=NoSnapshots)
    timings: Timings = field(default_factory=Timings)
    step_count: int = 0
    #: Steps skipped because the averaged gradient was not finite.
    skipped_steps: int = 0
    micro_batches: int = 0
    #: Global L2 norm of the last step's averaged gradient, before clipping
    #: (``nan`` before the first step; ``inf`` or ``nan`` for a skipped step).
    last_grad_norm: float = math.nan
    #: This rank's row of the step's agreement (:func:`zerompi.mpi.agreement.agree_step`).
    row: np.ndarray = field(default_factory=lambda: np.zeros(8))
    closed: bool = False

    @property
    def config(self) -> ZeroConfig:
        return self.settings.config

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def rule(self) -> Rule:
        """The update rule (:mod:`zerompi.rules`)."""
        return self.settings.rule

    @property
    def precisions(self) -> dict[np.dtype, Precision]:
        return self.settings.precisions

    @property
    def shared_memory(self) -> bool:
        """Whether node shared memory is in use (:func:`choose_shared`)."""
        return self.plan.shared_memory

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def describe(self, index: int) -> str:
        """Bucket ``index`` in words, for error messages and the watchdog."""
        bucket = self.layout.buckets[index]
        names = ", ".join(bucket.names[:3]) + (", ..." if len(bucket.names) > 3 else "")
        return f"bucket {index} [{names}]"

    def memory_usage(self) -> dict[str, int]:
        return self.pool.usage()

    def memory_buffers(self) -> dict[str, int]:
        return self.pool.buffers()

    def handed_over(self, found: Found) -> None:
        """An ``opt.gradients`` block ended normally: its parameters are handed over."""
        index, names, whole = found
        with self.timings.reduce:
            self.reducer.handed_over(index, None if whole else names)  # type: ignore[union-attr]

    def discard(self) -> None:
        """Drop every gradient added or accumulated since the last step."""
        self.reducer.discard()
        self.micro_batches = 0

    def close(self) -> None:
        """Collective: finish what is in flight, release the shared-memory segments."""
        if not self.closed:
            self.access.finish(step=False)
            self.reducer.close()
            self.pool.close()
            self.closed = True


def choose_shared(
    asked: bool | None, comm: Comm, nodes: Nodes, plan: Callable[[], Sequence[PlannedBuffer]],
) -> bool:  # fmt: skip
    """Collective: whether an optimizer uses node shared memory (every stage alike).
    ``asked``: ``False`` never; ``True`` wherever it can work (every node the same
    number of ranks); ``None`` (the default) also needs more than one rank per node
    and room in ``/dev/shm`` on every node for what ``plan()`` (the buffer plan with
    shared memory) puts there. Where it was asked for or is the
    default and cannot be used, rank 0 prints one line saying why, and the MPI
    collectives run instead."""
    from .mpi.shm import segment_bytes, shm_dir, shm_free_bytes

    if asked is False or (asked is None and comm.size == 1):
        return False
    if asked is None and nodes.uniform and nodes.size == 1:
        return False  # one rank per node: nothing to share (and no notice needed)
    why = ""
    if not nodes.uniform:
        sizes = sorted({len(m) for m in nodes.members})
        why = f"the nodes have different numbers of ranks ({sizes})"
    elif asked is None:
        need = sum(
            segment_bytes(b.count, b.dtype, nodes.size if b.placement is Placement.NODE_PARTS
                          else 1)
            for b in plan() if b.placement is not Placement.PRIVATE
        )  # fmt: skip
        free = shm_free_bytes() if nodes.local == 0 else None
        short = nodes.local == 0 and (free is None or free < need * 1.05 + (1 << 20))
        if comm.max(int(short)):
            why = (f"{shm_dir()} has too little room on some node (this job needs "
                   f"{need / 2**20:.1f} MiB per node)")  # fmt: skip
    if why and comm.rank == 0:
        print(f"zerompi: not using node shared memory: {why}; the MPI collectives run "
              "instead (shared_memory=False chooses them without this notice)",
              flush=True)  # fmt: skip
    return not why


def _plan(settings: Settings, nodes: Nodes, shared: bool) -> StagePlan:
    low = any(p.low_grads for p in settings.precisions.values())
    config = settings.config
    return stage_plan(config.stage, shared, nodes.count == 1, low, config.gather_buffers)


def _buffers(settings: Settings, layout: Layout, nodes: Nodes, plan: StagePlan,
             buddies: tuple[int, int] | None) -> list[PlannedBuffer]:  # fmt: skip
    """What the engine allocates, in order: the plan's buffers and the snapshots."""
    region = nodes.peers if plan.shared_memory and nodes.count > 1 else None
    rule = settings.rule
    configs, member = settings.configs, settings.member
    out = buffer_plan(layout, plan, settings.config.overlap.enabled, settings.precisions, region,
                      states=rule.states, scratch_blocks=rule.scratch_blocks,
                      workspace=rule.workspace(layout, plan.stage,
                                               lambda name: configs[member[name]]))  # fmt: skip
    if buddies is not None:
        out += snapshot_plan(layout, layout.rank, buddies[1], rule.states, plan.stage)
    return out


def buddies_of(comm: Comm, nodes: Nodes) -> tuple[int, int]:
    """``(buddy, source)`` of this rank's snapshots (:func:`zerompi.elastic.buddy_ranks`)."""
    return buddy_ranks(comm.size, comm.rank, nodes.members if nodes.count > 1 else None)


def build_engine(
    settings: Settings, comm: Comm, layout: Layout,
    params: Mapping[str, np.ndarray | Deferred] | None, handed_over: HandedOver,
    configs: list[Any] | None = None,
) -> Engine:  # fmt: skip
    """Collective: the engine of ``settings`` on ``comm`` (this rank's ``layout``),
    with rank 0's initial values of ``params`` (``None``: a recovery, whose re-shard
    writes every element). ``handed_over`` ends an ``opt.gradients`` block;
    ``configs``: the parameter groups' current Adam settings (a recovery keeps the
    ones the old world trained with last)."""
    config = settings.config
    comm.timeout = settings.timeout
    elastic = config.elastic.enabled
    if elastic:
        elastic_setup(comm)
    else:  # a node heartbeat in shared memory: not with a rank to lose
        enable_heartbeat(comm)
    nodes = nodes_of(comm)  # how the ranks sit on nodes (zerompi.mpi.nodes)
    buddies = buddies_of(comm, nodes) if elastic else None
    shared = choose_shared(
        settings.shared_memory, comm, nodes,
        lambda: _buffers(settings, layout, nodes, _plan(settings, nodes, True), None),
    )  # fmt: skip
    plan = _plan(settings, nodes, shared)
    pool, stores = BufferPool(), {}
    planned = _buffers(settings, layout, nodes, plan, buddies)
    for buf in planned:
        stores.setdefault(buf.kind, {})[buf.master] = pool.allocate(buf, nodes.node)
    rule = settings.rule
    parts = bucket_parts(plan, layout, stores, rule.states)
    order = [name for name, _, _ in settings.specs]
    names = Names(layout, order)
    low_params = any(p.low_params for p in settings.precisions.values())
    flat = stores[Kind.PARAMS]  # full params (0-2, 3 on one node) or the shards (3)
    params_arrays = None
    if plan.full_params:
        params_arrays = names.flat_arrays(flat, "parameter", read_only=low_params)
        for view in params_arrays.values() if low_params else ():
            view.flags.writeable = False  # a rounded copy: writing it would not stick
    node_copy = Kind.PARAMS in plan.node_memory  # one copy per node, that Adam writes
    if params is None:
        pass  # a recovery: zerompi.recovery writes every element from the snapshots
    elif params_arrays is not None and not low_params and not node_copy:
        initialize_whole(comm, params, params_arrays, list(flat.values()))
    else:  # a node's ranks write their regions of its copy (then one fence)
        initialize_by_bucket(comm, layout, parts, params, names.bucket_view,
                             nodes if node_copy else None)  # fmt: skip
    pool.touch()  # the other buffers' pages, now that Deferred copies are released
    # One kernel call per run of buckets contiguous in memory, unless each bucket's
    # gather must start as soon as its part is updated.
    merge = plan.publish is Publish.NONE or (plan.publish is Publish.NODE and nodes.count == 1)
    # A state's units follow its bucket's elements, and a rule that prepares sees its
    # pieces at their global offsets: one bucket per run for either.
    merge = merge and not rule.units and not rule.prepares
    update_runs = runs(parts, ("param", "grad", "states", "low"), merge)
    lows = [a for k in (Kind.PARAMS, Kind.PARAMS_LOW) for a in stores.get(k, {}).values()]
    member = dict(settings.member)
    timings = Timings()
    engine = Engine(
        settings=settings, comm=comm, layout=layout, nodes=nodes, plan=plan, pool=pool,
        stores=stores, parts=parts, names=names, order=order,
        access=_access(plan, params_arrays, comm, layout, parts, stores, nodes, names, timings,
                       config.overlap.enabled),
        reducer=None,  # type: ignore[arg-type]  # (made below: it calls back the engine)
        gatherer=_publisher(plan, comm, nodes, layout, parts),
        update_runs=update_runs,
        low_bases=[low_base(run.arrays[-1], lows) for run in update_runs],
        segments=adam_segments(layout, config.stage, update_runs, member),
        update_offsets=[held(layout, config.stage, run.first)[0] for run in update_runs],
        update_units=[_run_units(rule, layout, config.stage, run) for run in update_runs],
        update_counted=[_counted(layout, config.stage, run) for run in update_runs],
        world=None,
        agreement=Agreement(comm, layout, rule.block) if rule.block else None,
        stats_runs=StatsRuns(runs(parts, ("stats",), merge=True), len(parts)),
        configs=list(configs if configs is not None else settings.configs), member=member,
        scaler=settings.scaler, timings=timings,
    )  # fmt: skip
    engine.reducer = _reducer(engine, planned, handed_over, params_arrays)
    if rule.prepares:  # (the configs by parameter follow set_hyperparameters: a view)
        engine.world = World(layout, config.stage, _ConfigOf(engine), comm.sum_inplace,
                             comm.exchange, comm.broadcast, {},
                             stores.get(Kind.WORKSPACE, {}))  # fmt: skip
    if elastic:
        assert buddies is not None
        from .mpi.ulfm import Exchange

        engine.snapshots = Snapshots(
            config.elastic.snapshot_every, comm, layout,
            snapshot_views(plan, layout, stores, rule.states), *buddies,
            {k.label: stores[k][np.dtype(np.uint8)]
             for k in (Kind.SNAPSHOT_OWN, Kind.SNAPSHOT_HELD, Kind.SNAPSHOT_NEXT)},
            Exchange(comm), rule.states, config.stage,
        )  # fmt: skip
    comm.describe = engine.describe
    comm.step = 1
    return engine


def _access(
    plan: StagePlan, params: FlatArrays | None, comm: Comm, layout: Layout, parts: list[Part],
    stores: Stores, nodes: Nodes, names: Names, timings: Timings, overlap: bool,
) -> Access:  # fmt: skip
    """The plan's parameter access (:mod:`zerompi.handover`)."""
    if plan.access is AccessKind.RESIDENT:
        assert params is not None
        return Resident(params)
    if plan.access is AccessKind.NODE_COPY:
        assert params is not None
        return NodeCopy(params, comm, layout)
    if plan.access is AccessKind.CALLER_GATHERS:
        return CallerGathers()
    shared = Kind.PARAM_BUCKET in plan.node_memory  # the layers once per node
    layers = LayerGather(comm, layout, stores[Kind.PARAM_BUCKET], gather_slots(overlap),
                         lambda i: parts[i].gather_source, nodes if shared else None)  # fmt: skip
    return Gathered(layers, names, timings.gather)


def _publisher(
    plan: StagePlan, comm: Comm, nodes: Nodes, layout: Layout, parts: list[Part]
) -> NoGather:
    """The plan's publisher of the updated parameters (:mod:`zerompi.gather`)."""
    if plan.publish is Publish.ALLGATHERV:
        return MPIGather(comm, layout, parts)
    if plan.publish is Publish.NODE:
        return NodeGather(comm, nodes, layout, parts)
    return NoGather()


def _reducer(
    engine: Engine, planned: list[PlannedBuffer], handed_over: HandedOver,
    params: FlatArrays | None,
) -> FullGradients | StagedGradients:  # fmt: skip
    """The plan's gradient scheduler and, per bucket, its reduction backend."""
    comm, layout, plan, parts, stores = (
        engine.comm, engine.layout, engine.plan, engine.parts, engine.stores)  # fmt: skip
    nodes, precisions = engine.nodes, engine.precisions
    segments = {b.master: engine.pool.segments[b.name] for b in planned
                if b.placement is Placement.NODE_PARTS}  # the node-shared gradients  # fmt: skip
    node_sum = NodeSum(comm, layout, nodes, segments) if segments else None
    cross = nodes.cross if nodes.count > 1 else None
    peers = nodes.peers if cross is not None else []
    recv = stores.get(Kind.GRAD_RECV, {})

    def split(index: int, recv: Mapping[np.dtype, np.ndarray]) -> Split:
        bucket = layout.buckets[index]
        width = comm.size * layout.max_part(bucket.dtype)
        return Split(comm, bucket, index, parts[index].stats, recv[bucket.dtype], width)

    def node_views(index: int, slots: int) -> list[np.ndarray]:
        bucket = layout.buckets[index]
        sums = stores[Kind.GRAD_NODE][bucket.dtype]
        wide, count = sums.shape[0] // slots, sum(bucket.counts[r] for r in peers)
        return [sums[s * wide : s * wide + count] for s in range(slots)]

    def node_reduce(
        index: int, bases: Sequence[int], fence: bool, after: bool,
        shard: np.ndarray | None = None, clears: bool = True,
    ) -> NodeReduce:  # fmt: skip
        bucket, slots = layout.buckets[index], len(bases)
        assert node_sum is not None
        return NodeReduce(
            comm, bucket, index, parts[index].grad if shard is None else shard, node_sum,
            bases, fence, after, cross, [bucket.counts[r] for r in peers],
            node_views(index, slots) if cross else (), clears,
        )  # fmt: skip

    if plan.full_grads:  # stages 0-1
        grads = engine.names.flat_arrays(stores[Kind.GRADS], "gradient")
        at_step: list[Backend] = []
        per_micro: list[Backend | None] = []
        to_zero: list[np.ndarray] = []
        for index, (bucket, part) in enumerate(zip(layout.buckets, parts, strict=True)):
            kind = plan.reduction(precisions[bucket.dtype])
            per_micro.append(split(index, recv) if kind is Reduce.SPLIT else None)
            if kind is Reduce.SPLIT:  # reduced per micro-batch; stage 0 gathers it back
                final = GatherReduced if plan.stage == 0 else Reduced
                at_step.append(final(comm, bucket, index, part.grad))
            elif kind is Reduce.ALLREDUCE:
                at_step.append(Allreduce(comm, bucket, index, part.grad))
                to_zero.append(part.full_grad)  # type: ignore[arg-type]
            elif kind is Reduce.NODE_SUM and plan.stage == 0:  # its shard, then the others'
                lo, hi = bucket.local(comm.rank)
                shard = part.full_grad[lo:hi]  # type: ignore[index]
                # No zeroing in the sum: every rank's copies overwrite what it would zero,
                # and the whole buffer is zeroed after Adam.
                at_step.append(node_reduce(index, [bucket.start] * REDUCE_WINDOW, index == 0,
                                           False, shard, clears=False))  # fmt: skip
                to_zero.append(part.full_grad)  # type: ignore[arg-type]
            elif kind is Reduce.NODE_SUM:  # (the sums zeroed what they read, but its own)
                at_step.append(node_reduce(index, [bucket.start] * REDUCE_WINDOW,
                                           index == 0, False))  # fmt: skip
                to_zero.append(part.grad)
            else:
                at_step.append(ReduceScatter(comm, bucket, index, part.grad))
                to_zero.append(part.full_grad)  # type: ignore[arg-type]
        micro = per_micro if any(b is not None for b in per_micro) else []
        gather = None
        if plan.stage == 0 and node_sum is not None:  # the others' regions, from their buffers
            gather = NodeCopies(comm, layout, nodes, node_sum.segments,
                                [p.full_grad for p in parts])  # type: ignore[misc]  # fmt: skip
        return FullGradients(comm, parts, grads, at_step, micro, to_zero,  # type: ignore[arg-type]
                             gather)  # fmt: skip
    slots = staging_slots(engine.config.overlap.enabled)
    kinds = [plan.reduction(precisions[b.dtype]) for b in layout.buckets]
    # One slot, summed within one node only: used from both ends, a fence only where
    # a bucket is written over the one before it (reducer.staging_offsets), not after
    # every sum.
    ends = (reducer.ENDS and slots == 1 and cross is None and node_sum is not None
            and all(k is Reduce.NODE_SUM for k in kinds))  # fmt: skip
    offsets = staging_offsets(layout, slots, ends)
    staged: list[Backend] = []
    for index, kind in enumerate(kinds):
        if kind is Reduce.NODE_SUM:
            bases = [row[index] for row in offsets]
            staged.append(node_reduce(index, bases, True, slots == 1 and not ends))
        elif kind is Reduce.SPLIT:
            staged.append(split(index, recv))
        else:
            staged.append(ReduceScatter(comm, layout.buckets[index], index, parts[index].grad))

    def make_full() -> tuple[FlatArrays, dict[np.dtype, np.ndarray], list[Backend]]:
        """Stage 2's full gradient buffers (``opt.grads``), allocated on first use."""
        full, own_recv = {}, {}
        for buf in full_grads_plan(layout, precisions, plan.shared_memory):
            store = full if buf.kind is Kind.GRADS_FULL else own_recv
            store[buf.master] = engine.pool.allocate(buf)
        engine.pool.touch()  # (zero-filled now: the model adds into them)
        regions = own_recv or recv  # (shared memory has no other receive region)
        backends: list[Backend] = [
            split(i, regions) if precisions[b.dtype].low_grads
            else ReduceScatter(comm, b, i, parts[i].grad)
            for i, b in enumerate(layout.buckets)
        ]  # fmt: skip
        return engine.names.flat_arrays(full, "gradient"), full, backends

    return StagedGradients(
        comm, layout, parts, engine.names, stores[Kind.GRAD_BUCKET], offsets, staged,
        handed_over, make_full if plan.full_grads_on_demand else None,
        nodes.node.fence if ends else None,
    )  # fmt: skip


def _run_units(rule: Rule, layout: Layout, stage: int, run: Run) -> list[tuple[Spans, int] | None]:
    """Per state of ``rule``, for ``run`` (one bucket: runs are not merged for such a
    rule): the state's units and the run's first entry, or None for a per-element
    state."""
    first, count = held(layout, stage, run.first)
    dtype = layout.buckets[run.first].dtype
    out: list[tuple[Spans, int] | None] = []
    for kind in rule.states:
        if kind.units:
            spans = spans_of(kind, layout, dtype)
            out.append((spans, spans.touched(first, count)[0]))
        else:
            out.append(None)
    return out


def _counted(layout: Layout, stage: int, run: Run) -> tuple[int, int]:
    """The run-local elements of ``run`` this rank counts in statistics over all
    ranks: at stage 0 (every rank updates every element) its part of each bucket,
    which only a run of one bucket can say; else all of them."""
    n = run.arrays[0].shape[0]
    if stage != 0:
        return 0, n
    if run.first != run.last:  # merged buckets: not a rule that counts (it would not merge)
        return 0, 0
    return layout.buckets[run.first].local(layout.rank)


class _ConfigOf(Mapping[str, Any]):
    """Each parameter's group config by name, read from the engine when asked (so a
    change of ``set_hyperparameters`` shows)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getitem__(self, name: str) -> Any:
        return self.engine.configs[self.engine.member[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.engine.member)

    def __len__(self) -> int:
        return len(self.engine.member)
