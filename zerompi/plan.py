"""What differs between stages, as data: a :class:`StagePlan` and, per bucket, a
:class:`Part` saying where its gradient, parameters and moments live on this rank.

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

(The MPI path. With node shared memory, :func:`stage_plan`'s ``node_kinds`` and
``shared_kinds``: one parameter copy per node in stages 1-2 and in 3 on one node,
stage 3's gathered layers once per node over several; stage 1's full gradient
buffers and the staging buckets of 2-3 summed within a node; see
:mod:`zerompi.mpi.nodes` and :mod:`zerompi.nodesum`.)

The step never asks which stage it runs: it reduces (a :mod:`zerompi.reducer`), reads
each bucket's :class:`Part`, runs Adam on ``part.param`` with ``part.grad`` and the
moments, and lets a :mod:`zerompi.gather` gatherer publish the result. The parts are
views computed once, here, so a step does no per-bucket lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .partition import Layout

if TYPE_CHECKING:
    from .buffers import PlannedBuffer
    from .mpi.collectives import Comm
    from .mpi.nodes import Nodes

Store = Mapping[np.dtype, np.ndarray]


#: The kinds of state a checkpoint (and an elastic snapshot) holds, in file order.
STATE_KINDS = ("params", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StagePlan:
    """How one stage keeps and moves its data."""

    stage: int
    #: Every rank holds every parameter (stages 0-2); else its shards (3).
    full_params: bool
    #: The model adds into full gradient buffers, reduced at ``step()`` (stages 0-1);
    #: else gradients are handed over bucket by bucket and reduced as they arrive.
    full_grads: bool
    #: ``"allreduce"`` (stage 0) or ``"reduce_scatter"``.
    reduce: str
    #: After Adam: ``"none"`` (0, and 3 which gathers on use), ``"allgatherv"`` (1-2
    #: over MPI) or ``"node"`` (1-2 with one node-shared copy of the parameters:
    #: Adam writes it in place, only other nodes' parts are gathered, by MPI).
    gather: str
    #: Buffers in node shared memory, one part per rank that the node's ranks read
    #: (stages 2-3's staging buckets: the reduction within a node reads them).
    shared_kinds: tuple[str, ...]
    #: Buffers of which each node holds one copy that all its ranks map (stages
    #: 1-2's parameters).
    node_kinds: tuple[str, ...] = ()
    #: Stage 3 without a node copy: zerompi's own gather buffers for ``gathered()``;
    #: ``False`` where the caller gathers into its own memory (``gather_into``: the
    #: torch adapter's per-module storages), so they are not allocated.
    layer_buffers: bool = True

    @property
    def shared_memory(self) -> bool:
        return bool(self.shared_kinds or self.node_kinds)


def stage_plan(
    stage: int, shared_memory: bool, one_node: bool = False, low_grads: bool = False,
    layer_buffers: bool = True,
) -> StagePlan:  # fmt: skip
    """The plan of ``stage``. With ``shared_memory``:

    * the parameters are one copy per node at stages 1-2, and at stage 3 on
      ``one_node`` too (the node's ranks' shards together are the whole model, so the
      node holds what it would hold sharded, and a layer is read in place); stage 3
      over several nodes keeps its gathered layers once per node instead;
    * the gradients live in node shared memory, summed within the node there and
      across nodes by MPI: the staging buckets of stages 2-3, and stage 1's full
      buffers unless they are 16-bit (``low_grads``: reduced per micro-batch by MPI)."""
    shared = shared_memory and stage >= 1
    node_copy = shared and (stage <= 2 or one_node)
    return StagePlan(
        stage=stage,
        full_params=stage <= 2 or node_copy,
        full_grads=stage <= 1,
        reduce="allreduce" if stage == 0 else "reduce_scatter",
        gather="node" if node_copy else ("none" if stage in (0, 3) else "allgatherv"),
        shared_kinds=("grad_bucket",) if shared and stage >= 2 else (
            ("grads",) if shared and stage == 1 and not low_grads else ()),
        # stage 3 over several nodes: the gathered layers, one copy per node
        node_kinds=("params",) if node_copy else (("param_bucket",) if shared else ()),
        layer_buffers=layer_buffers,
    )


def choose_shared(
    asked: bool | None, stage: int, comm: Comm, nodes: Nodes,
    plan: Callable[[], Sequence[tuple[PlannedBuffer, Comm | None, bool]]],
) -> bool:  # fmt: skip
    """Collective: whether an optimizer of ``stage`` uses node shared memory.
    ``asked``: ``False`` never; ``True`` wherever it can work (every node the same
    number of ranks); ``None`` (the default) also needs more than one rank per node,
    a stage above 0 and room in ``/dev/shm`` on every node for what ``plan()`` (the buffer
    plan with shared memory, and where each buffer goes) puts there. Where it was
    asked for or is the default and cannot be used, rank 0 prints one line saying
    why, and the MPI collectives run instead."""
    from .mpi.shm import segment_bytes, shm_dir, shm_free_bytes

    if asked is False or stage == 0 or (asked is None and comm.size == 1):
        return False
    if asked is None and nodes.uniform and nodes.size == 1:
        return False  # one rank per node: nothing to share (and no notice needed)
    why = ""
    if not nodes.uniform:
        sizes = sorted({len(m) for m in nodes.members})
        why = f"the nodes have different numbers of ranks ({sizes})"
    elif asked is None:
        need = sum(
            segment_bytes(b.count, b.dtype, nodes.size if per_rank else 1)
            for b, shared, per_rank in plan() if shared is not None
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
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    scratch: np.ndarray
    #: The whole bucket of parameters (stages 0-2), what a gather fills; else None.
    full_param: np.ndarray | None
    #: The whole bucket of the full gradient buffer (stages 0-1), what is reduced.
    full_grad: np.ndarray | None
    #: Where Adam writes the updated ``param`` rounded to the parameter dtype, when
    #: that is narrower than the master's (the model's copy: part of ``full_param`` in
    #: stages 0-2, the 16-bit shard that stage 3 gathers from); else None.
    low: np.ndarray | None = None


def shard_of(store: Store, layout: Layout, index: int) -> np.ndarray:
    """This rank's shard of bucket ``index`` in a shard-sized buffer."""
    bucket = layout.buckets[index]
    lo = bucket.shard_offset
    return store[bucket.dtype][lo : lo + bucket.counts[layout.rank]]


def bucket_parts(plan: StagePlan, layout: Layout, stores: Mapping[str, Store]) -> list[Part]:
    """Every bucket's :class:`Part` over the optimizer's buffers (``stores`` by kind,
    then master dtype: ``params``, ``grads``, ``exp_avg``, ``exp_avg_sq``,
    ``scratch``, and with mixed precision ``master``, ``params_low``,
    ``grads_reduced``; see :func:`zerompi.buffers.buffer_plan`)."""
    parts = []
    params, grads = stores["params"], stores["grads"]
    master, params_low = stores.get("master", {}), stores.get("params_low", {})
    reduced = stores.get("grads_reduced", {})
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
            elif "grads" in plan.shared_kinds:  # summed into its place: peers read the rest
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
        exp_avg = stores["exp_avg"][dtype][moments]
        exp_avg_sq = stores["exp_avg_sq"][dtype][moments]
        scratch = stores["scratch"][dtype]
        part = Part(
            index, grad, stats, param, exp_avg, exp_avg_sq, scratch, full_param, full_grad, low
        )  # type: ignore[arg-type]
        parts.append(part)
    return parts


class Run(NamedTuple):
    """Consecutive buckets whose arrays continue one another in memory, so one kernel
    call covers them all (stage 3's one-layer buckets: one Adam call per dtype, not
    one per layer). ``last`` is the index of its last bucket."""

    last: int
    arrays: tuple[np.ndarray, ...]
    scratch: np.ndarray  # the kernel's scratch block of the run's dtype


def _continues(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.ctypes.data + a.nbytes == b.ctypes.data


def runs(parts: list[Part], fields: tuple[str, ...], merge: bool) -> list[Run]:
    """The parts' ``fields`` (e.g. ``("param", "grad", "exp_avg", "exp_avg_sq")``)
    grouped into runs of buckets that continue one another in every field (only
    with ``merge``; else one run per bucket), each field joined into one view."""
    out: list[Run] = []
    for part in parts:
        arrays = tuple(getattr(part, f) for f in fields)
        if merge and out and all(
            _continues(a, b) for a, b in zip(out[-1].arrays, arrays, strict=True)
        ):
            joined = tuple(
                None if a is None else
                as_strided(a, shape=(a.size + b.size,), strides=(a.itemsize,), writeable=True)
                for a, b in zip(out[-1].arrays, arrays, strict=True)
            )  # same buffer, continuing: one longer view of it  # fmt: skip
            out[-1] = Run(part.index, joined, part.scratch)
        else:
            out.append(Run(part.index, arrays, part.scratch))
    return out

