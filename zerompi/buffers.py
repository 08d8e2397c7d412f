"""Every flat buffer zerompi holds is allocated here, and counted here.

One small interface (:class:`BufferPool`) hands out named, category-tagged numpy
arrays and reports the bytes it holds per category. Keeping allocation in one
place is what makes ``memory_usage()`` exact rather than estimated, and is the seam
where buffers go into node-shared memory (``shared=``, :mod:`zerompi.mpi.shm`), so
that ranks on one node reduce through memory instead of messages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .adam import BLOCK
from .precision import Precision, is_half

if TYPE_CHECKING:
    from .mpi.collectives import Comm
    from .mpi.nodes import Nodes
    from .mpi.shm import SharedSegment
    from .partition import Layout
    from .plan import StagePlan

#: Byte alignment of every buffer: a cache line, and enough for any SIMD kernel.
ALIGNMENT = 64

#: Categories of the reference's ``ZeROState.memory_usage``, plus kernel scratch and
#: the in-memory snapshots of an elastic optimizer (:mod:`zerompi.elastic`).
CATEGORIES = (
    "optimizer_states",
    "gradient_partitions",
    "parameter_partitions",
    "communication_buffers",
    "scratch",
    "snapshots",
)


class PlannedBuffer(NamedTuple):
    """One buffer of an optimizer's plan: ``count`` elements of ``dtype``, for the
    parameters whose master dtype is ``group`` (``None``: ``dtype``)."""

    kind: str  # what it holds: "params", "grads", "exp_avg", ...
    dtype: np.dtype
    count: int
    category: str  # one of CATEGORIES
    group: np.dtype | None = None

    @property
    def master(self) -> np.dtype:
        """The master dtype of the parameters it serves: the optimizer's store key."""
        return self.dtype if self.group is None else self.group

    @property
    def name(self) -> str:
        """The pool name, e.g. ``"grad_bucket.float32"`` (``"params.float32.bfloat16"``
        for bfloat16 copies of float32 parameters)."""
        if self.master == self.dtype:
            return f"{self.kind}.{self.dtype.name}"
        return f"{self.kind}.{self.master.name}.{self.dtype.name}"

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


#: Staging slots of stages 2-3 with ``overlap``: one bucket is reduced while the next
#: one's gradients are being added.
OVERLAP_SLOTS = 2

def gather_slots(overlap: bool) -> int:
    """Stage 3's gather buffers: two with ``overlap`` (the next layer's gather moves
    while the model uses the current one, :mod:`zerompi.prefetch`), else one."""
    return 2 if overlap else 1


#: Stage 0-1 reductions in flight at once in ``step()`` (:mod:`zerompi.reducer`):
#: bucket i+2 starts when bucket i is complete. Starting all of them at once measured
#: as slow as one collective on the whole buffer (2.5x slower than bucket by bucket at
#: 64M parameters): MPICH works on all of them together and the working set leaves
#: the cache. Also the receive regions a 16-bit reduction of stages 0-1 needs.
REDUCE_WINDOW = 2


def buffer_plan(
    layout: Layout, stage: int, overlap: bool = True,
    precisions: Mapping[np.dtype, Precision] | None = None, shared_memory: bool = False,
    region: Sequence[int] | None = None,
) -> list[PlannedBuffer]:  # fmt: skip
    """Every buffer a ``ZeroOptimizer`` of ``stage`` allocates at construction on the
    rank of ``layout``, in allocation order: the one description that the optimizer
    allocates from and :mod:`zerompi.memory` estimates from. With ``shared_memory``
    the parameters of stages 1-2 (and of stage 3 on one node, ``region`` ``None``)
    are one copy per node (``node_kinds`` of :func:`zerompi.plan.stage_plan`), and
    stages 1-3 reduce within a node through node shared memory (the staging buckets
    of 2-3; stage 1's full gradient buffers, unless 16-bit); over
    several nodes ``region`` (the ranks whose shards this rank sums within its node,
    :attr:`zerompi.mpi.nodes.Nodes.peers`) sizes the buffer of those sums, one per
    staging slot (stage 1: per reduction in flight), that the cross-node
    reduce-scatter sends.

    Per master dtype ``M`` (the arrays' own), with ``P``/``R`` the parameter and
    reduce dtypes (:mod:`zerompi.precision`; ``M`` by default): the parameters the
    model reads in ``P`` (full in stages 0-2; in 3 the shard, kept in ``M``, plus its
    ``P`` copy when ``P`` differs); the master copy in ``M`` when ``P`` differs (all
    of it in stage 0, the shard in 1-2); the gradients the model adds into, in ``R``
    (full in 0-1; 2-3 stage them in buckets, two with ``overlap``, else one); the
    reduced gradient in ``M`` (the shard in 2-3, and in 0-1 when ``R`` differs: the
    shard in 1, all in 0); where ``R`` is 16-bit and the reduction goes through MPI,
    a receive buffer per staging bucket for every rank's part; one bucket of
    parameter gathering in ``P`` per gather slot (3: two with ``overlap``); the two
    Adam moments in ``M`` over what Adam runs on (everything in stage 0, the shard
    otherwise) and the Adam kernel's scratch block.
    """
    plan: list[PlannedBuffer] = []
    # Stage 3 shards the parameters, except on one node with shared memory (no region
    # across nodes): there the node's one copy is what the shards would add up to.
    sharded = stage == 3 and not (shared_memory and region is None)
    # Over several nodes the node's sums of this rank's region go across nodes.
    node_sums = shared_memory and region is not None and len(region) > 1
    low_any = any(p.low_grads for p in (precisions or {}).values())

    def widest(dtype: np.dtype) -> int:  # elements of the widest region of a bucket
        return max(
            (sum(b.counts[r] for r in region or ()) for b in layout.buckets if b.dtype == dtype),
            default=0,
        )

    for dtype, size in layout.sizes.items():
        prec = precisions[dtype] if precisions else Precision(dtype, dtype, dtype)
        p_dt, r_dt = prec.param, prec.reduce
        shard = layout.shard_sizes[dtype]
        local = size if stage == 0 else shard  # what Adam runs on
        slots = OVERLAP_SLOTS if overlap else 1

        def add(kind: str, dt: np.dtype, count: int, category: str, g: np.dtype = dtype) -> None:
            plan.append(PlannedBuffer(kind, dt, count, category, g))

        if sharded:
            add("params", dtype, shard, "parameter_partitions")
            if prec.low_params:
                add("params_low", p_dt, shard, "parameter_partitions")
        else:
            add("params", p_dt, size, "parameter_partitions")
            if prec.low_params:
                add("master", dtype, local, "parameter_partitions")
        if stage <= 1:
            add("grads", r_dt, size, "gradient_partitions")
            if prec.low_grads:
                add("grads_reduced", dtype, local, "gradient_partitions")
            elif stage == 1 and node_sums and not low_any:  # node sums, per window slot
                add("grad_node", dtype, widest(dtype) * REDUCE_WINDOW, "communication_buffers")
        else:
            add("grads", dtype, shard, "gradient_partitions")
            add("grad_bucket", r_dt, layout.max_bucket(dtype) * slots, "communication_buffers")
            if node_sums:
                add("grad_node", dtype, widest(dtype) * slots, "communication_buffers")
        if is_half(r_dt) and not (shared_memory and stage >= 2):
            parts = (slots if stage >= 2 else REDUCE_WINDOW) * layout.world_size
            add("grad_recv", r_dt, parts * layout.max_part(dtype), "communication_buffers")
        if sharded:
            add("param_bucket", p_dt, layout.max_bucket(dtype) * gather_slots(overlap),
                "communication_buffers")  # fmt: skip
        for kind in ("exp_avg", "exp_avg_sq"):
            add(kind, dtype, local, "optimizer_states")
        add("scratch", dtype, min(BLOCK, max(local, 1)), "scratch")
    return plan


#: A planned buffer, the node communicator it is shared over (``None``: private) and
#: whether each rank has a part of it (else it is the node's one copy).
Placed = tuple[PlannedBuffer, "Comm | None", bool]


def placed_plan(
    layout: Layout, stage: int, overlap: bool, precisions: Mapping[np.dtype, Precision],
    plan: StagePlan, shared: bool, nodes: Nodes,
) -> list[Placed]:  # fmt: skip
    """:func:`buffer_plan` with where each buffer lives: in node shared memory (the
    plan's ``shared_kinds``: a part per rank; ``node_kinds``: one copy per node) or
    in this rank's own memory."""
    region = nodes.peers if shared and nodes.count > 1 else None
    bufs = buffer_plan(layout, stage, overlap, precisions, shared, region)
    node = nodes.node if shared else None
    return [
        (b, node if b.kind in plan.shared_kinds + plan.node_kinds else None,
         b.kind not in plan.node_kinds)
        for b in bufs if plan.layer_buffers or b.kind != "param_bucket"
    ]  # fmt: skip


def full_grads_plan(
    layout: Layout, precisions: Mapping[np.dtype, Precision] | None = None,
    shared_memory: bool = False,
) -> list[PlannedBuffer]:  # fmt: skip
    """The full-size gradient buffers (in the reduce dtype) a stage-2 optimizer adds
    the first time ``opt.grads`` is used (the non-streamed hand-over; see
    ``ZeroOptimizer.grads``), and, for 16-bit gradients where the staging buckets
    reduce through shared memory (so :func:`buffer_plan` has none), one receive
    region for their reduction over MPI."""
    reduce = {d: precisions[d].reduce if precisions else d for d in layout.sizes}
    plan = [
        PlannedBuffer("grads_full", reduce[dtype], size, "communication_buffers", dtype)
        for dtype, size in layout.sizes.items()
    ]
    for d in layout.sizes if shared_memory else ():
        if is_half(reduce[d]):
            count = layout.world_size * layout.max_part(d)
            plan.append(PlannedBuffer("grad_recv", reduce[d], count, "communication_buffers", d))
    return plan


def node_share(nbytes: int, ranks: int, local: int) -> int:
    """The bytes of a node's one copy of ``nbytes`` counted for its rank ``local`` of
    ``ranks``: the shares of a node's ranks add up to ``nbytes`` exactly."""
    return nbytes // ranks + (local < nbytes % ranks)


def aligned_empty(count: int, dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised 1-D array of ``count`` elements whose data starts on an
    ``ALIGNMENT``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift : shift + nbytes].view(dtype)


#: The buffer kinds that initialization writes (the parameters, in every form); the
#: others' pages are touched after it (:meth:`BufferPool.touch`).
INITIALIZED = ("params", "master", "params_low")


class BufferPool:
    """Named flat buffers by category. ``usage()`` is the optimizer's memory."""

    def __init__(self) -> None:
        #: name -> (category, array, bytes counted for this rank: its share of a
        #: node-shared array, else all of it)
        self._buffers: dict[str, tuple[str, np.ndarray, int]] = {}
        #: Shared-memory segments by buffer name (released by :meth:`close`).
        self.segments: dict[str, SharedSegment] = {}
        #: Private buffers allocated with ``touch=False``, zero-filled by :meth:`touch`.
        self._untouched: list[np.ndarray] = []

    def zeros(
        self,
        name: str,
        count: int,
        dtype: np.dtype | type,
        category: str,
        shared: Comm | None = None,
        per_rank: bool = True,
        touch: bool = True,
    ) -> np.ndarray:
        """Allocate a zero-filled buffer ``name`` of ``count`` elements; with
        ``shared`` (collective), in a shared-memory segment over that communicator
        (the ranks of one node), whose peers' parts are ``self.segments[name].peers``;
        with ``per_rank=False`` too, one array every rank of ``shared`` maps (the
        node's one copy), of which :meth:`usage` counts this rank's share. A private
        buffer with ``touch=False`` is neither filled nor held until :meth:`touch`
        (its contents are undefined until then)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown buffer category {category!r}; expected one of {CATEGORIES}")
        if name in self._buffers:
            raise ValueError(f"buffer {name!r} is already allocated")
        if shared is not None:
            from .mpi.shm import SharedSegment

            segment = SharedSegment(shared, count, dtype, name, per_rank)
            self.segments[name] = segment
            array = segment.local
        else:
            array = aligned_empty(count, dtype)
        share = array.nbytes
        if shared is not None and not per_rank:
            # posix_fallocate gave zeroed pages, held already: no rank writes the
            # node's copy here (that would race with another rank's first writes).
            share = node_share(array.nbytes, shared.size, shared.rank)
        elif shared is None and not touch:
            self._untouched.append(array)
        else:
            array.fill(0)  # touch every page now, so the memory is really held
        self._buffers[name] = (category, array, share)
        return array

    def touch(self) -> None:
        """Zero-fill the buffers allocated with ``touch=False``: from here on their
        memory is really held, as :meth:`usage` says."""
        for array in self._untouched:
            array.fill(0)
        self._untouched = []

    def close(self) -> None:
        """Release the shared-memory segments: this pool no longer reaches the peers'
        parts. Every buffer handed out stays valid and accounted (its mapping lives
        as long as any view of it)."""
        for segment in self.segments.values():
            segment.release()
        self.segments = {}

    def free(self, name: str) -> None:
        """Drop the pool's reference to buffer ``name``."""
        del self._buffers[name]

    def usage(self) -> dict[str, int]:
        """Bytes held per category by this rank (every category present, zero if
        unused): a node-shared buffer counts this rank's share, so the node's ranks'
        figures add up to what the node holds."""
        totals: dict[str, int] = defaultdict(int)
        for category, _, share in self._buffers.values():
            totals[category] += share
        return {category: totals[category] for category in CATEGORIES}

    def buffers(self) -> dict[str, int]:
        """Bytes per named buffer counted for this rank (its share of a node-shared
        one), in allocation order."""
        return {name: share for name, (_, _, share) in self._buffers.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._buffers
