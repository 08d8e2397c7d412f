"""Where a :class:`zerompi.optimizer.ZeroOptimizer` allocates and wires its buffers:
every flat buffer from the one plan :mod:`zerompi.memory` estimates from (through the
:class:`zerompi.buffers.BufferPool`), the per-bucket views, the initial values, and the
reducer and gatherer of the stage's plan. A mixin of ``ZeroOptimizer``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import FlatArrays
from .buffers import INITIALIZED, OVERLAP_SLOTS, BufferPool, Placed, placed_plan
from .elastic import SLOTS, Snapshots, buddy_ranks, is_restored, snapshot_plan
from .gather import MPIGather, NodeGather, NoGather
from .initial import initialize_by_bucket, initialize_whole
from .mpi.ulfm import Exchange
from .nodesum import NodeSum, StatsRuns
from .plan import StagePlan, bucket_parts, runs, stage_plan
from .precision import low_base
from .reducer import FullReducer, StreamReducer
from .settings import adam_segments

if TYPE_CHECKING:
    from .partition import Deferred


class Allocation:
    """``_allocate`` and the buffer plan (a mixin of ``ZeroOptimizer``)."""

    layout: Any
    stage: int
    comm: Any
    nodes: Any
    plan: StagePlan
    overlap: bool
    precisions: dict[np.dtype, Any]
    shared_memory: bool
    _gather_buffers: bool
    _order: list[str]
    _member: dict[str, int]
    _elastic_args: dict[str, Any] | None
    _snapshots: Any

    def _prepare_handover(self, stores: Mapping[str, Mapping[np.dtype, np.ndarray]]) -> None:
        raise NotImplementedError

    def _view(self, flat: Mapping[np.dtype, np.ndarray], name: str) -> np.ndarray:
        raise NotImplementedError

    def _state_views(self) -> list[tuple[str, int, np.ndarray]]:
        raise NotImplementedError

    def _full_grads(self) -> dict[np.dtype, np.ndarray]:
        raise NotImplementedError

    def _allocate(self, params: Mapping[str, np.ndarray | Deferred]) -> None:
        """Every buffer the optimizer keeps, allocated once, here, from the plan
        :mod:`zerompi.memory` estimates from; then the per-bucket views and the
        reducer and gatherer of this plan."""
        pool = self.pool = BufferPool()
        layout, stage, comm, nodes = self.layout, self.stage, self.comm, self.nodes
        stores: dict[str, dict[np.dtype, np.ndarray]] = {}
        plan = self._plan_buffers(self.shared_memory)
        for buf, shared, per_rank in plan:
            stores.setdefault(buf.kind, {})[buf.master] = pool.zeros(
                buf.name, buf.count, buf.dtype, buf.category, shared, per_rank,
                touch=buf.kind in INITIALIZED,
            )  # fmt: skip
        self._stores = stores
        self._flat = stores["params"]  # full params (0-2) or shard (3)
        self._specs = {spec.name: spec for spec in layout.params}
        self.parts = bucket_parts(self.plan, layout, stores)
        low = any(p.low_params for p in self.precisions.values())
        node_copy = "params" in self.plan.node_kinds  # one copy per node, that Adam writes
        if self.plan.full_params:
            views = {n: self._view(self._flat, n) for n in self._order}
            for view in views.values() if low else ():
                view.flags.writeable = False  # a rounded copy: writing it would not stick
            self._params = FlatArrays(views, "parameter", read_only=low)
        if is_restored(params):
            pass  # a recovery: zerompi.recovery writes every element from the snapshots
        elif self.plan.full_params and not low and not node_copy:
            initialize_whole(comm, params, views, list(self._flat.values()))
        else:  # a node's ranks write their regions of its copy (then one fence)
            initialize_by_bucket(comm, layout, self.parts, params, self._bucket_view,
                                 nodes if node_copy else None)  # fmt: skip
        pool.touch()  # the other buffers' pages, now that Deferred copies are released
        # One kernel call per run of buckets contiguous in memory, unless each
        # bucket's gather must start as soon as its part is updated.
        merge = self.plan.gather == "none" or (self.plan.gather == "node" and nodes.count == 1)
        self._adam_runs = runs(self.parts, ("param", "grad", "exp_avg", "exp_avg_sq", "low"), merge)
        #: Per run, the index of its first rounded element in its buffer: stochastic
        #: rounding's random stream (the same at every step's same position).
        lows = [a for k in ("params", "params_low") for a in stores.get(k, {}).values()]
        self._low_bases = [low_base(run.arrays[4], lows) for run in self._adam_runs]
        self._segments = adam_segments(self.layout, stage, self._adam_runs, self._member)
        self._stats_runs = StatsRuns(runs(self.parts, ("stats",), merge=True), len(self.parts))
        self._prepare_handover(stores)
        segments = {b.master: pool.segments[b.name] for b, *_ in plan
                    if b.kind in self.plan.shared_kinds}  # the node-shared gradients  # fmt: skip
        if self.plan.full_grads:
            self._grads = FlatArrays(
                {n: self._view(stores["grads"], n) for n in self._order}, "gradient"
            )
            self.reducer: FullReducer | StreamReducer = FullReducer(
                comm, layout, self.parts, allreduce=self.plan.reduce == "allreduce",
                recv=stores.get("grad_recv"), nodes=nodes, node_sums=stores.get("grad_node"),
                node_sum=NodeSum(comm, layout, nodes, segments) if segments else None,
            )  # fmt: skip
        else:
            self.reducer = StreamReducer(
                comm, layout, self.parts, stores["grad_bucket"],
                OVERLAP_SLOTS if self.overlap else 1, segments or None,
                self._full_grads if stage == 2 else None, stores.get("grad_recv"),
                nodes, stores.get("grad_node"),
            )  # fmt: skip
        if self.plan.gather == "allgatherv":
            self.gatherer: NoGather = MPIGather(comm, layout, self.parts)
        elif self.plan.gather == "node":
            self.gatherer = NodeGather(comm, nodes, layout, self.parts)
        else:
            self.gatherer = NoGather()
        if self._elastic_args is not None:  # the in-memory snapshots of zerompi.elastic
            self._snapshots = Snapshots(
                self._elastic_args["snapshot_every"], comm, layout,
                [shard for _, _, shard in self._state_views()], *self._buddies(),
                {kind: stores[kind][np.dtype(np.uint8)] for kind in SLOTS}, Exchange(comm),
            )  # fmt: skip

    def _buddies(self) -> tuple[int, int]:
        """``(buddy, source)`` of this rank's snapshots (:func:`zerompi.elastic.buddy_ranks`)."""
        nodes = self.nodes
        return buddy_ranks(self.comm.size, self.comm.rank,
                           nodes.members if nodes.count > 1 else None)  # fmt: skip

    def _stage_plan(self, shared: bool) -> StagePlan:
        low = any(p.low_grads for p in self.precisions.values())
        return stage_plan(self.stage, shared, self.nodes.count == 1, low, self._gather_buffers)

    def _plan_buffers(self, shared: bool) -> list[Placed]:
        plan, nodes = self._stage_plan(shared), self.nodes
        placed = placed_plan(self.layout, self.stage, self.overlap, self.precisions, plan,
                             shared, nodes)  # fmt: skip
        if self._elastic_args is not None:
            snapshots = snapshot_plan(self.layout, self.comm.rank, self._buddies()[1])
            placed += [(buf, None, True) for buf in snapshots]
        return placed
