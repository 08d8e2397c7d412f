"""The arrays the optimizer hands out: ``opt.params`` and ``opt.grads`` are views of
its flat buffers, writing them changes what it steps on, gradients are zero after a
step and after ``zero_grad()``, assignments copy and check, and the initial values are
rank 0's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED,
    SHAPES,
    add_grads,
    make_params,
    rank_grads,
    spec_of,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.reference import ReferenceAdam


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_params_and_grads_are_views_into_flat_buffers(comm: MPI.Intracomm) -> None:
    params = make_params(MIXED, seed=6)
    opt = ZeroOptimizer(params, comm=comm)
    problems = []
    if list(opt.params) != list(MIXED) or list(opt.grads) != list(MIXED):
        problems.append(f"iteration order {list(opt.params)}, want {list(MIXED)}")
    if len(opt.params) != len(MIXED) or len(opt.grads) != len(MIXED):
        problems.append("len(opt.params) / len(opt.grads) is wrong")
    for arrays, what in ((opt.params, "params"), (opt.grads, "grads")):
        for name, (shape, dtype) in MIXED.items():
            view = arrays[name]
            if arrays[name] is not view:
                problems.append(f"{what}[{name!r}] is a new object on every access")
            if not (isinstance(view, np.ndarray) and view.shape == shape and view.dtype == dtype):
                problems.append(f"{what}[{name!r}] is {type(view)} {getattr(view, 'shape', '')}")
                continue
            if not (view.flags.c_contiguous and view.flags.writeable and not view.flags.owndata):
                problems.append(f"{what}[{name!r}] is not a writeable view")
            if np.shares_memory(view, params[name]):
                problems.append(f"{what}[{name!r}] aliases the caller's array")
        # Parameters of one dtype are packed back to back, in the mapping's order.
        for dtype in (F32, F64):
            group = [arrays[n] for n, (_, d) in MIXED.items() if d == dtype]
            for a, b in itertools.pairwise(group):
                if address(b) != address(a) + a.nbytes:
                    problems.append(f"{what} of {dtype} are not adjacent in one flat buffer")
    for name in MIXED:
        if np.shares_memory(opt.params[name], opt.grads[name]):
            problems.append(f"param and grad {name!r} share memory")
    verdict(problems)


@pytest.mark.parametrize("stage", [1, 2])
def test_writing_params_changes_what_the_optimizer_steps_on(
    comm: MPI.Intracomm, stage: int
) -> None:
    params = make_params(MIXED, seed=7)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=5)
    new = make_params(MIXED, seed=8)  # the same on every rank
    for i, (name, value) in enumerate(new.items()):
        if i % 2:
            opt.params[name][...] = value  # write through the view
        else:
            opt.params[name] = value.copy()  # assignment copies into the view
    held = {name: opt.params[name] for name in MIXED}  # taken before any step
    ref = ReferenceAdam(new)
    problems = train(opt, ref, MIXED, 2)
    for name, view in held.items():
        if view is not opt.params[name] or not np.array_equal(view, opt.params[name]):
            problems.append(f"a view of {name!r} taken before step() is stale")
    verdict(problems)


@pytest.mark.parametrize("stage", [1, 2])
def test_grads_are_zero_after_step(comm: MPI.Intracomm, stage: int) -> None:
    spec = spec_of(SHAPES, F32)
    opt = ZeroOptimizer(make_params(spec), comm=comm, stage=stage, bucket_elems=5)
    problems = []
    for step, n_micro in enumerate([0, 1, 2]):  # 0: step() without accumulate()
        add_grads(opt, rank_grads(spec, step, comm.rank))
        for k in range(n_micro):
            opt.accumulate()
            if stage == 2 and any(np.any(g) for g in opt.grads.values()):
                problems.append("stage 2: opt.grads not zeroed by accumulate()")
            if k + 1 < n_micro:
                add_grads(opt, rank_grads(spec, 10 * step + k, comm.rank))
        opt.step()
        problems += [f"step {step}: grad {n} not zero" for n, g in opt.grads.items() if np.any(g)]
    verdict(problems)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_discards_added_and_accumulated_gradients(
    comm: MPI.Intracomm, stage: int
) -> None:
    spec = spec_of(SHAPES, F64)
    params = make_params(spec, seed=9)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7)
    ref = ReferenceAdam(params)
    opt.zero_grad()  # before anything: harmless
    # Garbage: one accumulated micro-batch and one merely added, then discarded.
    add_grads(opt, rank_grads(spec, 100, comm.rank))
    opt.accumulate()
    add_grads(opt, rank_grads(spec, 101, comm.rank))
    opt.zero_grad()
    problems = [f"grad {n} not zero after zero_grad()" for n, g in opt.grads.items() if np.any(g)]
    # The real steps: one micro-batch each, averaged over ranks only (the count was reset).
    verdict(problems + train(opt, ref, spec, 2))


def test_assigning_arrays_copies_and_checks() -> None:
    """The mappings' ``__setitem__`` (local checks, identical on every rank)."""
    opt = ZeroOptimizer(make_params(MIXED), comm=MPI.COMM_WORLD)
    problems = []
    for which, noun in (("params", "parameter"), ("grads", "gradient")):
        arrays = getattr(opt, which)
        view = arrays["w"]
        value = np.full((6, 4), 0.75, dtype=F32)
        arrays["w"] = value
        value[...] = -1.0  # the optimizer took a copy
        if arrays["w"] is not view or not np.all(view == 0.75):
            problems.append(f"{which}: assignment did not copy into the existing view")
        arrays["s"] = np.asarray(2.5, dtype=F64)
        if float(arrays["s"]) != 2.5:
            problems.append(f"{which}: 0-d assignment failed")
        cases: list[tuple[type[Exception], str, str, object]] = [
            (ValueError, "w", "(6, 4)", np.zeros((4, 6), F32)),  # wrong shape
            (ValueError, "w", "(6, 4)", np.zeros(24, F32)),  # right size, wrong shape
            (ValueError, "w", "float64", np.zeros((6, 4), F64)),  # wrong dtype
            (ValueError, "s", "float32", np.asarray(1.0, dtype=F32)),  # wrong dtype, 0-d
            (TypeError, "w", "numpy array", np.zeros((6, 4), F32).tolist()),
            (TypeError, "s", "numpy array", 1.0),
            (TypeError, "s", "numpy array", np.float64(1.0)),  # a numpy scalar is no array
            (TypeError, "w", "numpy array", None),
            (KeyError, "nope", "nope", np.zeros(1, F32)),
        ]
        for exc_type, name, detail, bad in cases:
            try:
                arrays[name] = bad
            except exc_type as exc:
                text = str(exc)
                if exc_type is not KeyError and f"{noun} {name!r}" not in text:
                    problems.append(f"{which}[{name!r}] = {bad!r:.30}: {text} names no {noun}")
                if detail not in text:
                    problems.append(f"{which}[{name!r}] = {bad!r:.30}: {text} lacks {detail!r}")
            except Exception as exc:
                problems.append(f"{which}[{name!r}] = {bad!r:.30}: {type(exc).__name__} {exc}")
            else:
                problems.append(f"{which}[{name!r}] = {bad!r:.30} was accepted")
        if not np.all(view == 0.75):
            problems.append(f"{which}: a rejected assignment changed the view")
    verdict(problems)


def test_initial_params_are_broadcast_from_rank_0(comm: MPI.Intracomm) -> None:
    base = make_params(MIXED, seed=10)
    mine = {n: np.asarray(p + comm.rank, dtype=p.dtype) for n, p in base.items()}
    snapshot = {n: p.copy() for n, p in mine.items()}
    opt = ZeroOptimizer(mine, comm=comm, bucket_elems=3)
    problems = [
        f"{n}: not rank 0's value" for n in base if not np.array_equal(opt.params[n], base[n])
    ]
    problems += [
        f"the caller's {n} was modified" for n in mine if not np.array_equal(mine[n], snapshot[n])
    ]
    for p in mine.values():
        p += 100.0  # the optimizer holds its own copy
    problems += [
        f"{n} follows the caller's array"
        for n in base
        if not np.array_equal(opt.params[n], base[n])
    ]
    verdict(problems + train(opt, ReferenceAdam(base), MIXED, 1))
