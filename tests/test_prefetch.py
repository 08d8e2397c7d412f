"""Stage 3's prefetch (``zerompi.prefetch``): from the second step on, the next
layer's gather is in flight while the model uses the current one, in the order the
first step used; results equal the blocking gathers' (``overlap=False``) bit for bit,
whatever the order of later steps, and every rank agrees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI
from test_checkpoint import shared_path

import zerompi.prefetch
from zerompi import ZeroOptimizer
from zerompi.reference import ReferenceAdam


@pytest.fixture(autouse=True)
def prefetch_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """These layers are tiny: prefetch them anyway (the threshold is about speed)."""
    monkeypatch.setattr(zerompi.prefetch, "PREFETCH_MIN_ELEMS", 1)

LAYERS = ["l0", "l1", "l2", "l3"]
SHAPES = {"l0.w": (3, 2), "l0.b": (2,), "l1.w": (5,), "l2.w": (1,), "l3.w": (4, 2)}
HYPER = {"lr": 1e-2, "weight_decay": 0.01}


def params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def grad(name: str, rank: int, step: int) -> np.ndarray:
    base = np.arange(int(np.prod(SHAPES[name]))).reshape(SHAPES[name]) + rank + step
    return ((base % 5 - 2) / 8).astype(np.float32)


def one_step(opt: ZeroOptimizer, rank: int, step: int, forward: list[str], backward: list[str]
             ) -> list[bool]:  # fmt: skip
    """Forward gathers ``forward``, backward gathers and hands over ``backward``;
    whether a gather was in flight after each call."""
    ahead = []
    for layer in forward:
        with opt.gathered(layer):
            ahead.append(opt.engine.access.layers.inflight is not None)  # type: ignore[union-attr]
    for layer in backward:
        with opt.gathered(layer), opt.gradients(layer) as g:
            ahead.append(opt.engine.access.layers.inflight is not None)  # type: ignore[union-attr]
            for name in g:
                g[name][...] += grad(name, rank, step)
    opt.step()
    return ahead


ORDERS = {
    "same": lambda step: (LAYERS, LAYERS[::-1]),
    "changes": lambda step: (LAYERS, LAYERS[::-1]) if step % 2 == 0 else (LAYERS[::-1], LAYERS),
    "skips": lambda step: (LAYERS, LAYERS[::-1]) if step == 0 else (LAYERS[1:], LAYERS[::-1]),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_prefetch_matches_blocking_gathers(comm: MPI.Intracomm, order: str) -> None:
    """Four steps with prefetch and without: the same parameters bit for bit, equal
    to the reference; a gather is in flight after every call that follows the first
    step's order (all but the last of a step), and none in the first step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    runs, problems = {}, []
    for overlap in (True, False):
        opt = ZeroOptimizer(params(), comm=comm, stage=3, bucket_elems=1, overlap=overlap,
                            shared_memory=False, **HYPER)  # the gathers (one node reads in place)
        ahead = [one_step(opt, rank, step, *ORDERS[order](step)) for step in range(4)]
        runs[overlap] = opt.full_params()
        if overlap:
            if any(ahead[0]):
                problems.append("a prefetch during the first step")
            if order == "same" and any(a != [True] * 7 + [False] for a in ahead[1:]):
                problems.append(f"prefetch pattern {ahead[1:]}")
        else:
            if any(any(a) for a in ahead):
                problems.append("a prefetch with overlap=False")
    ref = ReferenceAdam(params(), **HYPER)
    for step in range(4):
        total = {n: sum(grad(n, r, step).astype(np.float64) for r in range(size)) for n in SHAPES}
        ref.step({n: (t / size).astype(np.float32) for n, t in total.items()})
    for name in SHAPES:
        if not np.array_equal(runs[True][name], runs[False][name]):
            problems.append(f"{name}: prefetch and blocking gathers differ")
        err = float(np.max(np.abs(runs[True][name] - ref.params[name])))
        if err > 1e-6 or (size == 1 and err):
            problems.append(f"{name}: differs from the reference by {err:.2e}")
    assert_all(not problems, "; ".join(problems))


def test_step_load_and_close_with_a_gather_in_flight(
    comm: MPI.Intracomm, mpi_tmp_path: Path
) -> None:
    """A step whose backward ends early (a gather in flight at ``step()``), a load
    while one is in flight, and ``close()`` with one in flight: each completes it
    first, and the parameters are the blocking run's."""
    rank = comm.Get_rank()
    results = {}
    for overlap in (True, False):
        opt = ZeroOptimizer(params(), comm=comm, stage=3, bucket_elems=1, overlap=overlap,
                            shared_memory=False, **HYPER)  # the gathers (one node reads in place)
        one_step(opt, rank, 0, LAYERS, LAYERS[::-1])
        one_step(opt, rank, 1, LAYERS, LAYERS[:1:-1])  # l3, l2 only: l1 prefetched at step()
        with opt.gathered("l0"):
            pass  # l1 in flight again
        path = shared_path(mpi_tmp_path, comm, f"prefetch-{overlap}")  # one per group
        opt.save(path)
        with opt.gathered("l0"):
            pass
        opt.load(path)  # shards overwritten with a gather in flight
        one_step(opt, rank, 2, LAYERS, LAYERS[::-1])
        with opt.gathered("l0"):
            pass
        results[overlap] = opt.full_params()
        opt.close()
    problems = [n for n in SHAPES if not np.array_equal(results[True][n], results[False][n])]
    assert_all(not problems, f"prefetch changed {problems}")


def test_two_gather_buffers_with_overlap() -> None:
    """Each gather buffer holds the largest layer (l3.w: 8 float32 elements)."""
    opt = ZeroOptimizer(params(), stage=3, bucket_elems=1, shared_memory=False)
    single = ZeroOptimizer(params(), stage=3, bucket_elems=1, overlap=False, shared_memory=False)
    assert opt.memory_buffers()["param_bucket.float32"] == 2 * 4 * 8
    assert single.memory_buffers()["param_bucket.float32"] == 4 * 8


def test_small_layers_are_not_prefetched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the threshold a gather is not worth starting ahead: none is in flight."""
    monkeypatch.setattr(zerompi.prefetch, "PREFETCH_MIN_ELEMS", 9)  # l3.w has 8
    opt = ZeroOptimizer(params(), stage=3, bucket_elems=1, shared_memory=False)
    ahead = [one_step(opt, 0, step, LAYERS, LAYERS[::-1]) for step in range(2)]
    assert not any(ahead[1])
