"""Every flat buffer zerompi holds is allocated here, and counted here.

One small interface (:class:`BufferPool`) hands out named, category-tagged numpy
arrays and reports the bytes it holds per category. Keeping allocation in one
place is what makes ``memory_usage()`` exact rather than estimated, and is the seam
where buffers go into node-shared memory (``shared=``, :mod:`zerompi.mpi.shm`), so
that ranks on one node reduce through memory instead of messages.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .adam import BLOCK

if TYPE_CHECKING:
    from .mpi.collectives import Comm
    from .mpi.shm import SharedSegment
    from .partition import Layout

#: Byte alignment of every buffer: a cache line, and enough for any SIMD kernel.
ALIGNMENT = 64

#: Categories of the reference's ``ZeROState.memory_usage``, plus kernel scratch.
CATEGORIES = (
    "optimizer_states",
    "gradient_partitions",
    "parameter_partitions",
    "communication_buffers",
    "scratch",
)


class PlannedBuffer(NamedTuple):
    """One buffer of an optimizer's plan: ``count`` elements of ``dtype``."""

    kind: str  # what it holds: "params", "grads", "exp_avg", ...
    dtype: np.dtype
    count: int
    category: str  # one of CATEGORIES

    @property
    def name(self) -> str:
        """The pool name, e.g. ``"grad_bucket.float32"``."""
        return f"{self.kind}.{self.dtype.name}"

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


#: Staging slots of stages 2-3 with ``overlap``: one bucket is reduced while the next
#: one's gradients are being added.
OVERLAP_SLOTS = 2


def buffer_plan(layout: Layout, stage: int, overlap: bool = True) -> list[PlannedBuffer]:
    """Every buffer a ``ZeroOptimizer`` of ``stage`` allocates at construction on the
    rank of ``layout``, in allocation order: the one description that the optimizer
    allocates from and :mod:`zerompi.memory` estimates from.

    Per dtype: the parameters (full in stages 0-2, the shard in 3), the gradients
    (full in 0-1, the shard in 2-3), gradient staging (2-3: two buckets with
    ``overlap``, else one), one bucket of parameter gathering (3), the two Adam
    moments over what Adam runs on (everything in stage 0, the shard otherwise) and
    the Adam kernel's scratch block.
    """
    plan: list[PlannedBuffer] = []
    for dtype, size in layout.sizes.items():
        shard = layout.shard_sizes[dtype]
        local = size if stage == 0 else shard  # what Adam runs on
        plan.append(
            PlannedBuffer("params", dtype, shard if stage == 3 else size, "parameter_partitions")
        )
        plan.append(
            PlannedBuffer("grads", dtype, size if stage <= 1 else shard, "gradient_partitions")
        )
        if stage >= 2:
            plan.append(
                PlannedBuffer(
                    "grad_bucket",
                    dtype,
                    layout.max_bucket(dtype) * (OVERLAP_SLOTS if overlap else 1),
                    "communication_buffers",
                )
            )
        if stage == 3:
            plan.append(
                PlannedBuffer(
                    "param_bucket", dtype, layout.max_bucket(dtype), "communication_buffers"
                )
            )
        for kind in ("exp_avg", "exp_avg_sq"):
            plan.append(PlannedBuffer(kind, dtype, local, "optimizer_states"))
        plan.append(PlannedBuffer("scratch", dtype, min(BLOCK, max(local, 1)), "scratch"))
    return plan


def full_grads_plan(layout: Layout) -> list[PlannedBuffer]:
    """The full-size gradient buffers a stage-2 optimizer adds the first time
    ``opt.grads`` is used (the non-streamed hand-over; see ``ZeroOptimizer.grads``)."""
    return [
        PlannedBuffer("grads_full", dtype, size, "communication_buffers")
        for dtype, size in layout.sizes.items()
    ]


def aligned_empty(count: int, dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised 1-D array of ``count`` elements whose data starts on an
    ``ALIGNMENT``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift : shift + nbytes].view(dtype)


class BufferPool:
    """Named flat buffers by category. ``usage()`` is the optimizer's memory."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[str, np.ndarray]] = {}
        #: Shared-memory segments by buffer name (released by :meth:`close`).
        self.segments: dict[str, SharedSegment] = {}

    def zeros(
        self,
        name: str,
        count: int,
        dtype: np.dtype | type,
        category: str,
        shared: Comm | None = None,
    ) -> np.ndarray:
        """Allocate a zero-filled buffer ``name`` of ``count`` elements; with
        ``shared`` (collective), in a shared-memory segment over that communicator,
        whose peers' parts are ``self.segments[name].peers``."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown buffer category {category!r}; expected one of {CATEGORIES}")
        if name in self._buffers:
            raise ValueError(f"buffer {name!r} is already allocated")
        if shared is not None:
            from .mpi.shm import SharedSegment

            segment = self.segments[name] = SharedSegment(shared, count, dtype, name)
            array = segment.local
        else:
            array = aligned_empty(count, dtype)
        array.fill(0)  # touch every page now, so the memory is really held
        self._buffers[name] = (category, array)
        return array

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
        """Bytes held per category (every category present, zero if unused)."""
        totals: dict[str, int] = defaultdict(int)
        for category, array in self._buffers.values():
            totals[category] += array.nbytes
        return {category: totals[category] for category in CATEGORIES}

    def buffers(self) -> dict[str, int]:
        """Bytes per named buffer, in allocation order."""
        return {name: array.nbytes for name, (_, array) in self._buffers.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._buffers
