"""Every flat buffer zerompi holds is allocated here, and counted here.

One small interface (:class:`BufferPool`) hands out named, category-tagged numpy
arrays and reports the bytes it holds per category. Keeping allocation in one
place is what makes ``memory_usage()`` exact rather than estimated, and is the seam
where a later backend places buffers in MPI-3 shared-memory windows so that ranks
on one node reduce and gather through memory.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

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

    def zeros(self, name: str, count: int, dtype: np.dtype | type, category: str) -> np.ndarray:
        """Allocate a zero-filled buffer ``name`` of ``count`` elements."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown buffer category {category!r}; expected one of {CATEGORIES}")
        if name in self._buffers:
            raise ValueError(f"buffer {name!r} is already allocated")
        array = aligned_empty(count, dtype)
        array.fill(0)  # touch every page now, so the memory is really held
        self._buffers[name] = (category, array)
        return array

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
