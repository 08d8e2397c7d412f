"""The C allocator's policy for the process: keep the memory a training step frees
for the next step instead of giving it back to the kernel.

Every step of a torch model allocates the same large tensors again (autograd's
gradients, the embedding's dense gradient, activations' gradients) and frees them.
glibc's ``malloc`` serves a large request with its own ``mmap`` and gives it back
with ``munmap`` on ``free`` (and trims the heap's free top), so the next step's
tensors fault in fresh pages, which the kernel zeroes: measured here at 2.35 us per
4 KiB page, 155 ms per 256 MB, and 40,000-67,000 such faults in each step of the
bench's 64M GPT (``scripts/malloc_ab.py`` prints both). With :func:`keep_freed`
(glibc's ``M_MMAP_MAX=0``: every request from the heap; ``M_TRIM_THRESHOLD`` of
:data:`TRIM_THRESHOLD`: its free top is kept) a step after the first faults none:
what it frees is what the next one reuses. The cost: memory freed stays in the
process (its resident size stays near its peak), which is what a training process
does anyway between steps. jemalloc or tcmalloc (``LD_PRELOAD``) keep freed memory as
well; where the C library is not glibc this module does nothing.
"""

from __future__ import annotations

import ctypes
import platform

#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: Bytes of free heap top kept before glibc trims it: ``mallopt``'s largest (an int).
TRIM_THRESHOLD = 2**31 - 1
#: glibc's own values, which :func:`give_back` restores (fixed ones: glibc's default
#: threshold moves with the largest block freed, and a ``mallopt`` stops that).
DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024

#: Whether :func:`keep_freed` is in effect in this process.
keeping = False


def _libc() -> ctypes.CDLL | None:
    """The process's C library, if it is glibc (the only one with these settings)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed() -> bool:
    """Make this process's ``malloc`` keep what is freed for the next requests;
    ``False`` where it cannot (not glibc), else ``True``. Idempotent."""
    global keeping
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    keeping = keeping or ok
    return ok


def give_back() -> bool:
    """Undo :func:`keep_freed`: large requests ``mmap``-ed again and the free heap
    top trimmed, starting with what is free now (``malloc_trim``). ``False`` where
    the C library is not glibc."""
    global keeping
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    libc.malloc_trim(0)
    keeping = False
    return True
