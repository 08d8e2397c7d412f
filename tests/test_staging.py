"""Stages 2-3's staging with one slot (``overlap=False``) on one node: the slot used
from both ends (:func:`zerompi.reducer.staging_offsets`). Buckets handed over one after
the other alternate between its bottom and its top, so a bucket is written while the
node's ranks may still read the one before, with no node fence in between, unless the
two do not fit side by side; then exactly one fence first. The results equal the
reference's, bit for bit, through both hand-over APIs; and the bookkeeping of what is
zero already (the sums clear what they read) agrees with a plain mask."""

from __future__ import annotations

from itertools import pairwise

import helpers
import numpy as np
import pytest
from helpers import assert_all, make_params, spec_of, train
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.reducer import add_span, take, zero_except
from zerompi.reference import ReferenceAdam

F32 = np.dtype(np.float32)
#: One parameter per group: at stage 3 (and at stage 2 with ``bucket_elems=1``) one
#: bucket each, handed over last to first: 9+1, 1+8, 8+3 (over 9), 3+9, then the
#: next step's first bucket after the last (9+2 over 9).
SHAPES = {"a.w": (2,), "b.w": (9,), "c.w": (3,), "d.w": (8,), "e.w": (1,), "f.w": (9,)}
HYPER = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def test_spans_agree_with_a_mask() -> None:
    """take/add_span/zero_except against a boolean mask of the known-zero elements,
    over many random sequences (one seed: every rank draws the same)."""
    rng = np.random.default_rng(0)
    problems = []
    for case in range(300):
        n = int(rng.integers(1, 30))
        mask = np.zeros(n, bool)
        spans: list[tuple[int, int]] = []
        for _ in range(int(rng.integers(1, 12))):
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo, n + 1))
            if rng.random() < 0.5:
                add_span(spans, lo, hi)
                mask[lo:hi] = True
            else:
                inside = take(spans, lo, hi)
                got = np.zeros(hi - lo, bool)
                for a, b in inside:
                    got[a:b] = True
                if not np.array_equal(got, mask[lo:hi]):
                    problems.append(f"case {case}: take({lo}, {hi}) gave {inside}")
                buf = np.ones(hi - lo)
                zero_except(buf, 0, hi - lo, inside)
                if not np.array_equal(buf == 0, ~mask[lo:hi]):
                    problems.append(f"case {case}: zero_except left {buf}")
                mask[lo:hi] = False
            flat = [(a, b) for a, b in spans]
            covered = np.zeros(n, bool)
            for a, b in flat:
                covered[a:b] = True
            if not np.array_equal(covered, mask) or flat != sorted(flat) or any(
                b1 >= a2 for (_, b1), (a2, _) in pairwise(flat)
            ):
                problems.append(f"case {case}: spans {flat} for mask {mask.astype(int)}")
    assert not problems, "\n".join(problems[:5])


def fences_expected(sizes: list[int], steps: int) -> int:
    """Fences before a hand-over: consecutive buckets (last to first, step after
    step) that do not fit side by side in a slot of the largest one's size."""
    order = list(reversed(sizes)) * steps
    width = max(sizes)
    return sum(a + b > width for a, b in pairwise(order))


@pytest.mark.parametrize("api", ["streamed", "add"])
@pytest.mark.parametrize("stage", [2, 3])
def test_one_slot_used_from_both_ends(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, stage: int, api: str
) -> None:
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=41)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, overlap=False,
                        shared_memory=None, **HYPER)  # fmt: skip
    ref = ReferenceAdam(params, **HYPER)
    reducer = opt.engine.reducer
    on_one_node = opt.shared_memory and opt.nodes.count == 1
    problems = []
    if (reducer.ends_fence is not None) != bool(on_one_node):
        problems.append(f"ends used: {reducer.ends_fence is not None}, one node with "
                        f"node memory: {on_one_node}")  # fmt: skip
    fenced = []
    if reducer.ends_fence is not None:
        real = reducer.ends_fence
        reducer.ends_fence = lambda: fenced.append(1) or real()
        sizes = [b.size for b in opt.engine.layout.buckets]
        if sizes != [2, 9, 3, 8, 1, 9]:
            problems.append(f"buckets {sizes}")
    if api == "add":  # one call per parameter: copied where its region is stale

        def added(opt, grads, api, seen=None):  # type: ignore[no-untyped-def]
            for name in reversed(list(grads)):
                with opt.gathered(name) as p:
                    if seen is not None:
                        seen.update({n: v.copy() for n, v in p.items()})
                opt.add_gradients({name: grads[name]})

        monkeypatch.setattr(helpers, "backward", added)
    problems += train(opt, ref, spec, 3, api="streamed")
    if reducer.ends_fence is not None and len(fenced) != fences_expected(
        [2, 9, 3, 8, 1, 9], 3
    ):
        problems.append(f"{len(fenced)} fences before a hand-over, want "
                        f"{fences_expected([2, 9, 3, 8, 1, 9], 3)}")  # fmt: skip
    if on_one_node and api == "streamed":  # blocks add into zeros: the sums zero them
        dirty = [(s, i) for s, row in enumerate(reducer.views) for i, v in enumerate(row)
                 if v.any()]  # fmt: skip
        if dirty:
            problems.append(f"staging (end, bucket) {dirty} not zero after the step")
    opt.close()
    assert_all(not problems, "\n".join(problems[:5]))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_add_gradients_times_what_a_block_times(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """``opt.add_gradients`` times, in the ``reduce_scatter`` phase, what a block
    times (opening the staging, the hand-over and its reduction) and not its copies
    and adds into the staging or the full buffers, which are the model's writes into a
    block: every write into the buffers happens outside the phase, and the hand-over
    of stages 2-3 inside it."""
    import zerompi.reducer as reducer_module

    params = make_params(spec_of({"a.w": (5, 3), "a.b": (4,), "b.w": (6,)}, np.float32), 2)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, lr=0.1)
    phase = opt.engine.timings.reduce
    inside = {"phase": False}
    writes: list[bool] = []
    handovers: list[bool] = []

    class Tracked(type(phase)):  # type: ignore[misc]
        __slots__ = ()

        def __enter__(self):  # type: ignore[no-untyped-def]
            inside["phase"] = True
            return super().__enter__()

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            inside["phase"] = False
            return super().__exit__(*exc)

    phase.__class__ = Tracked

    class Np:  # zerompi.reducer's numpy, its buffer writes recorded
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(np, name)

        def copyto(self, *a, **k):  # type: ignore[no-untyped-def]
            writes.append(inside["phase"])
            return np.copyto(*a, **k)

        def add(self, *a, **k):  # type: ignore[no-untyped-def]
            writes.append(inside["phase"])
            return np.add(*a, **k)

    monkeypatch.setattr(reducer_module, "np", Np())
    if stage >= 2:
        real = type(opt.engine.reducer).handed_over

        def handed_over(self, *a):  # type: ignore[no-untyped-def]
            handovers.append(inside["phase"])
            return real(self, *a)

        monkeypatch.setattr(type(opt.engine.reducer), "handed_over", handed_over)
    rng = np.random.default_rng(comm.rank)
    for _ in range(2):
        for name in reversed(list(params)):
            grad = rng.standard_normal(params[name].shape).astype(np.float32)
            with opt.gathered(name):  # (stage 3: the layer is gathered in a backward)
                opt.add_gradients({name: grad})
        opt.step()
    opt.close()
    problems = []
    if not writes or any(writes):
        problems.append(f"writes inside the phase: {writes}")
    if stage >= 2 and (not handovers or not all(handovers)):
        problems.append(f"hand-overs outside the phase: {handovers}")
    assert_all(not problems, "\n".join(problems))
