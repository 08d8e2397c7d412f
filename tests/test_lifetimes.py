"""Lifetimes and numerics: nothing zerompi hands out can crash the interpreter, nothing
after ``close()`` trains, shared memory leaves nothing behind, and the edge cases of
the gradient norm behave as the nonfinite policy and torch's clipping say.

* An array taken from ``opt.params`` before ``close()`` stays valid (and right)
  after it, shared memory included: segments are file mappings that live as long as
  any view of them.
* ``step()``, ``accumulate()``, ``gradients()``, ``gathered()``, ``zero_grad()`` after
  ``close()`` raise before touching any state.
* Shared memory is created owner-only (0600) and exclusively, and unlinked as soon as
  every rank mapped it: nothing named stays in ``/dev/shm`` even while the job runs.
* A finite float64 gradient whose sum of squares overflows is non-finite for the
  ``nonfinite`` policy; clipping scales by ``min(1, max_norm / (norm + 1e-6))``.
* ``ZEROMPI_NODE_SIZE`` forces the multi-node fallback of ``shared_memory=True``.
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI

import zerompi.handover
from zerompi import ZeroOptimizer
from zerompi.mpi import shm
from zerompi.reference import ReferenceAdam


def _model() -> dict[str, np.ndarray]:
    return {"a.w": np.arange(6, dtype=np.float32), "b.w": np.ones(5, np.float32)}


def _train(opt: ZeroOptimizer, value: float = 1.0) -> None:
    for name in ("b", "a"):
        with opt.gathered(name), opt.gradients(name) as g:
            for view in g.values():
                view[...] += value
    opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_views_outlive_close_and_training_after_it_raises(
    comm: MPI.Intracomm, stage: int, shared: bool
) -> None:
    opt = ZeroOptimizer(_model(), comm=comm, stage=stage, shared_memory=shared, lr=0.5)
    _train(opt)
    views = dict(opt.params) if stage < 3 else {}
    with opt.gathered("a") as gathered:
        kept = gathered["a.w"]  # stage 3: the gather buffer itself
    expected = opt.full_params()
    opt.close()
    problems = []
    for name, view in views.items():  # read after close: valid memory, same values
        if not np.array_equal(view, expected[name]):
            problems.append(f"{name}: a view taken before close() reads {view}")
    float(np.sum(kept))  # must not crash either
    step_count = opt.step_count
    for what, call in (
        ("step", opt.step),
        ("accumulate", opt.accumulate),
        ("zero_grad", opt.zero_grad),
        ("gradients", lambda: opt.gradients("a").__enter__()),
        ("gathered", lambda: opt.gathered("a").__enter__()),
    ):
        try:
            call()
            problems.append(f"{what}() after close() did not raise")
        except RuntimeError as exc:
            if "after close()" not in str(exc):
                problems.append(f"{what}(): {exc}")
    if opt.step_count != step_count:
        problems.append("step_count changed by a refused step")
    after = opt.full_params()  # inspection still works
    if any(not np.array_equal(after[n], expected[n]) for n in expected):
        problems.append("full_params() after close() differs")
    assert_all(not problems, "; ".join(problems))


def test_debug_poisons_a_released_stage_3_gather(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An array kept past its ``gathered`` block shows the next layer's values; with
    ``ZEROMPI_DEBUG=1`` it shows NaN instead, so the mistake cannot go unnoticed.
    (On one node with shared memory a layer is read in place from the node's copy,
    which must not be poisoned: there the gathers, and this check, do not apply.)"""
    monkeypatch.setattr(zerompi.handover, "DEBUG", True)
    opt = ZeroOptimizer(_model(), comm=comm, stage=3, shared_memory=False)
    with opt.gathered("a") as p:
        kept = p["a.w"]
        inside = kept.copy()
    assert_all(np.array_equal(inside, np.arange(6)) and bool(np.isnan(kept).all()),
               f"inside {inside}, after {kept}")  # fmt: skip


def test_shared_memory_is_owner_only_and_unlinked(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[tuple[str, int]] = []
    real_unlink = shm._unlink

    def spy(path: str) -> None:  # the creator's unlink: look at the file first
        if os.path.exists(path):
            created.append((os.path.basename(path), stat.S_IMODE(os.stat(path).st_mode)))
        real_unlink(path)

    monkeypatch.setattr(shm, "_unlink", spy)
    opt = ZeroOptimizer(_model(), comm=comm, stage=2, shared_memory=True)
    _train(opt)
    left = [f for f in os.listdir(shm.shm_dir()) if any(f == c for c, _ in created)]
    problems = [f"{name}: mode {mode:o}" for name, mode in created if mode != 0o600]
    if comm.rank == 0 and comm.size > 1 and not created:
        problems.append("rank 0 created no segment")
    if left:
        problems.append(f"still in {shm.shm_dir()}: {left}")
    opt.close()
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("node_size", [1, 2])
def test_node_size_forces_the_multi_node_fallback(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, node_size: int
) -> None:
    """``ZEROMPI_NODE_SIZE=L``: consecutive groups of L world ranks are one "node".
    ``shared_memory=True`` takes the hierarchical path when the communicator's nodes
    all have the same number of ranks, else the MPI path (with a notice), and
    matches the reference either way."""
    monkeypatch.setenv("ZEROMPI_NODE_SIZE", str(node_size))
    nodes = comm.allgather(MPI.COMM_WORLD.Get_rank() // node_size)
    sizes = {nodes.count(n) for n in set(nodes)}
    params = _model()
    opt = ZeroOptimizer(params, comm=comm, stage=2, shared_memory=True, lr=0.5)
    ref = ReferenceAdam(params, lr=0.5)
    _train(opt)
    ref.step({n: np.ones_like(p) for n, p in params.items()})
    ok = opt.shared_memory == (len(sizes) == 1) and opt.nodes.count == len(set(nodes)) and all(
        np.array_equal(opt.params[n], ref.params[n]) for n in params
    )
    assert_all(ok, f"shared_memory={opt.shared_memory}, {opt.nodes}, node sizes {sizes}")


@pytest.mark.parametrize("policy", ["skip", "raise"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_an_overflowing_norm_is_not_finite(
    comm: MPI.Intracomm, policy: str, max_norm: float | None
) -> None:
    """float64 gradients of 1e200: every element finite, the sum of squares not. The
    step is skipped (or raises) on every rank with the state untouched and the
    micro-batch count reset, so the next step trains normally."""
    params = {"w": np.zeros(4)}
    opt = ZeroOptimizer(params, comm=comm, stage=2, max_norm=max_norm, nonfinite=policy)
    with opt.gradients("w") as g:
        g["w"][...] = 1e200
    opt.accumulate()
    problems = []
    try:
        opt.step()
        if policy == "raise":
            problems.append("no FloatingPointError")
    except FloatingPointError as exc:
        if policy == "skip" or "overflows" not in str(exc):
            problems.append(f"FloatingPointError: {exc}")
    if opt.skipped_steps != 1 or opt.step_count != 0 or not math.isinf(opt.last_grad_norm):
        problems.append(f"skipped {opt.skipped_steps}, step {opt.step_count}, "
                        f"norm {opt.last_grad_norm}")  # fmt: skip
    if np.any(opt.full_params()["w"]):
        problems.append("parameters changed")
    with opt.gradients("w") as g:  # one micro-batch, no accumulate(): counted afresh
        g["w"][...] = 1.0
    opt.step()
    if opt.step_count != 1 or not math.isclose(opt.last_grad_norm, 2.0):
        problems.append(f"next step: {opt.step_count}, norm {opt.last_grad_norm}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_follows_torch_at_the_boundary(comm: MPI.Intracomm, stage: int) -> None:
    """torch's ``clip_grad_norm_`` scales by ``min(1, max_norm / (norm + 1e-6))``: a
    norm equal to ``max_norm`` is scaled (by a hair), which ``norm > max_norm`` would
    not do. With a large eps the scale shows in the parameters."""
    params = {"w": np.full(4, 0.5)}
    hyper = {"lr": 0.1, "eps": 10.0}  # a large eps: Adam cannot cancel the scale
    norm = 2.0  # four averaged gradients of 1.0
    opt = ZeroOptimizer(params, comm=comm, stage=stage, max_norm=norm, **hyper)
    ref = ReferenceAdam(params, **hyper)
    with opt.gradients("w") as g:
        g["w"][...] = 1.0
    opt.step()
    coef = norm / (norm + 1e-6)
    ref.step({"w": np.full(4, coef)})
    got = opt.full_params()["w"]
    assert_all(np.allclose(got, ref.params["w"], rtol=1e-14, atol=0) and opt.last_grad_norm
               == norm, f"{got} vs {ref.params['w']}")  # fmt: skip
