"""Every flat buffer zerompi holds is allocated here, and counted here.

One small interface (:class:`BufferPool`) hands out named, category-tagged numpy
arrays and reports the bytes it holds per category. Keeping allocation in one
place is what makes ``memory_usage()`` exact rather than estimated, and is the seam
where buffers go into node-shared memory (:class:`Placement`, :mod:`zerompi.mpi.shm`),
so that ranks on one node reduce through memory instead of messages.

What a buffer holds is a :class:`Kind`, which carries its memory category, whether
initialization writes it, and how it is placed when the stage's plan puts it in node
memory (:func:`zerompi.plan.buffer_plan` says which kinds go there). This module
knows nothing of stages or plans.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from .mpi.collectives import Comm
    from .mpi.shm import SharedSegment

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


class Placement(Enum):
    """Where a buffer's memory is."""

    #: This rank's own memory.
    PRIVATE = "private"
    #: Node shared memory, one part per rank of the node, each rank reading its
    #: peers' parts (the gradients a node sums within itself).
    NODE_PARTS = "node parts"
    #: Node shared memory, one array that every rank of the node maps (the node's
    #: one copy of the parameters, or of stage 3's gathered layers).
    NODE_COPY = "node copy"


class Kind(Enum):
    """What a buffer holds: its pool name, its memory category, how it is placed
    in node memory, and whether initialization writes it (its pages are touched
    then; every other buffer's after the initial values are in)."""

    PARAMS = ("params", "parameter_partitions", Placement.NODE_COPY, True)
    PARAMS_LOW = ("params_low", "parameter_partitions", Placement.PRIVATE, True)
    MASTER = ("master", "parameter_partitions", Placement.PRIVATE, True)
    GRADS = ("grads", "gradient_partitions", Placement.NODE_PARTS, False)
    GRADS_REDUCED = ("grads_reduced", "gradient_partitions", Placement.PRIVATE, False)
    GRAD_NODE = ("grad_node", "communication_buffers", Placement.PRIVATE, False)
    GRAD_BUCKET = ("grad_bucket", "communication_buffers", Placement.NODE_PARTS, False)
    GRAD_RECV = ("grad_recv", "communication_buffers", Placement.PRIVATE, False)
    GRADS_FULL = ("grads_full", "communication_buffers", Placement.PRIVATE, False)
    PARAM_BUCKET = ("param_bucket", "communication_buffers", Placement.NODE_COPY, False)
    SCRATCH = ("scratch", "scratch", Placement.PRIVATE, False)
    #: What an update rule's step works in beyond its states and scratch (Muon's
    #: exchanged matrices and Newton-Schulz products: :meth:`zerompi.rules.Rule.workspace`).
    WORKSPACE = ("workspace", "scratch", Placement.PRIVATE, False)
    SNAPSHOT_OWN = ("snapshot_own", "snapshots", Placement.PRIVATE, False)
    SNAPSHOT_HELD = ("snapshot_held", "snapshots", Placement.PRIVATE, False)
    SNAPSHOT_NEXT = ("snapshot_next", "snapshots", Placement.PRIVATE, False)

    def __init__(self, label: str, category: str, shared: Placement, initialized: bool) -> None:
        #: The pool name's prefix (``"grad_bucket"``).
        self.label = label
        #: One of :data:`CATEGORIES`.
        self.category = category
        #: Its placement when the plan puts it in node memory.
        self.shared = shared
        #: Whether initialization writes it (the parameters, in every form).
        self.initialized = initialized


@dataclass(frozen=True)
class StateKind:
    """A state of the optimizer's update rule (Adam's ``exp_avg``, SGD's
    ``momentum_buffer``, 8-bit Adam's codes and scales): a private buffer over what the
    rule updates, per element (of the master dtype, or ``dtype``) or per block, zero
    at the start. The rule declares its states
    (:attr:`zerompi.rules.Rule.states`); the plan, the checkpoints, the snapshots and
    the estimator take them from there, as they take a :class:`Kind`."""

    label: str
    #: The stored dtype's name (``"uint8"``: 8-bit codes); ``None``: the master dtype.
    dtype: str | None = None
    #: What it has an entry per: ``"element"``; ``"block"`` of :attr:`block` elements
    #: of the master dtype's flat parameters, cut from their start (an 8-bit state's
    #: scales); ``"row"`` or ``"column"`` of every matrix (the last two dimensions of
    #: a parameter with two or more; Adafactor's factored second moments);
    #: ``"vector"``: element of a parameter with fewer than two. A rank holds the
    #: entries of every unit (block, matrix, element) its part touches, so ranks whose
    #: parts share one hold a copy each (see :mod:`zerompi.blockwise`).
    per: str = "element"
    #: Elements per block, for ``per="block"``.
    block: int = 0
    category: str = "optimizer_states"
    shared: Placement = Placement.PRIVATE
    initialized: bool = False

    def __post_init__(self) -> None:
        if self.per not in ("element", "block", "row", "column", "vector"):
            raise ValueError(f"StateKind {self.label!r}: per={self.per!r} is not one of "
                             "element, block, row, column, vector")  # fmt: skip
        if (self.per == "block") != (self.block > 0):
            raise ValueError(f"StateKind {self.label!r}: block={self.block} with per="
                             f"{self.per!r} (a block size goes with per='block' only)")  # fmt: skip

    @property
    def units(self) -> bool:
        """Whether it is held per unit (block, matrix, vector element), not per element."""
        return self.per != "element"

    def storage(self, master: np.dtype) -> np.dtype:
        """The dtype of its buffer for parameters of ``master`` dtype."""
        return master if self.dtype is None else np.dtype(self.dtype)


#: What a buffer holds: one of the fixed kinds, or a state of the update rule.
AnyKind = Kind | StateKind


class PlannedBuffer(NamedTuple):
    """One buffer of an optimizer's plan: ``count`` elements of ``dtype``, for the
    parameters whose master dtype is ``group`` (``None``: ``dtype``), placed so."""

    kind: AnyKind
    dtype: np.dtype
    count: int
    group: np.dtype | None = None
    placement: Placement = Placement.PRIVATE

    @property
    def category(self) -> str:
        return self.kind.category

    @property
    def master(self) -> np.dtype:
        """The master dtype of the parameters it serves: the optimizer's store key."""
        return self.dtype if self.group is None else self.group

    @property
    def name(self) -> str:
        """The pool name, e.g. ``"grad_bucket.float32"`` (``"params.float32.bfloat16"``
        for bfloat16 copies of float32 parameters)."""
        if self.master == self.dtype:
            return f"{self.kind.label}.{self.dtype.name}"
        return f"{self.kind.label}.{self.master.name}.{self.dtype.name}"

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


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


#: Buffers by kind, then by the master dtype of the parameters they serve.
Stores = dict[AnyKind, dict[np.dtype, np.ndarray]]


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

    def allocate(self, buf: PlannedBuffer, node: Comm | None = None) -> np.ndarray:
        """Collective over ``node`` where ``buf`` is placed in node memory: the
        zero-filled array of planned buffer ``buf`` (see :meth:`zeros`). A private
        buffer that initialization does not write is held (touched) only at
        :meth:`touch`."""
        shared = node if buf.placement is not Placement.PRIVATE else None
        return self.zeros(
            buf.name, buf.count, buf.dtype, buf.category, shared,
            per_rank=buf.placement is not Placement.NODE_COPY, touch=buf.kind.initialized,
        )  # fmt: skip

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
