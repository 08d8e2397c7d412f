"""The C allocator's policy (:mod:`zerompi.allocator`): what a step frees is kept for
the next one, so a large tensor allocated again faults in no fresh pages; ``shard()``
sets it unless told not to. Serial: the policy is the process's own."""

from __future__ import annotations

import ctypes
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from zerompi import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
MIB = 2**20


def faults_of_a_fresh_block(nbytes: int = 64 * MIB) -> int:
    """Page faults of ``malloc``-ing ``nbytes`` and writing them, after the same
    block was allocated, written and freed once (a step's tensor, the next step).
    Straight through the C library: numpy would ask for huge pages."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def written() -> int:
        block = libc.malloc(nbytes)
        assert block, "malloc failed"
        ctypes.memset(block, 1, nbytes)
        return block

    libc.free(written())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = written()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(block)
    return faults


@pytest.fixture
def restore():
    """Put the policy back as the test found it."""
    was = allocator.keeping
    yield
    allocator.keep_freed() if was else allocator.give_back()


#: The measurement of :func:`test_kept_memory_is_reused_without_faults`, run in a fresh
#: interpreter: what earlier tests left in this process's heap (a free block as large
#: as the one measured, kept while a test ran with the policy on) must not answer it.
KEPT_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from test_allocator import faults_of_a_fresh_block
from zerompi import allocator
assert allocator.give_back() and not allocator.keeping
given = faults_of_a_fresh_block()
assert allocator.keep_freed() and allocator.keep_freed()  # idempotent
assert allocator.keeping
print(given, faults_of_a_fresh_block())
"""


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's malloc's")
def test_kept_memory_is_reused_without_faults() -> None:
    """In a fresh process: a 64 MiB block given back faults in its pages again; kept,
    it faults in almost none."""
    pages = 64 * MIB // 4096
    proc = subprocess.run([sys.executable, "-c", KEPT_SCRIPT, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    given, kept = map(int, proc.stdout.split())
    assert given >= pages // 2, f"given back: {given} faults for {pages} pages"
    assert kept < pages // 20, f"kept: {kept} faults for {pages} pages"


def test_another_c_library_is_left_alone(monkeypatch: pytest.MonkeyPatch, restore: None) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("musl", ""))
    was = allocator.keeping
    assert allocator.keep_freed() is False
    assert allocator.give_back() is False
    assert allocator.keeping == was


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's malloc's")
@pytest.mark.parametrize("keep", [True, False])
def test_shard_keeps_freed_memory_unless_told_not_to(keep: bool, restore: None) -> None:
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    from zerompi.torch import shard

    allocator.give_back()
    model = torch.nn.Linear(4, 3)
    _, opt = shard(model, comm=MPI.COMM_SELF, keep_memory=keep)
    try:
        assert allocator.keeping is keep
    finally:
        opt.close()
