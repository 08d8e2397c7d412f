"""ZeroOptimizer against the unsharded reference (Kingma & Ba, Loshchilov & Hutter):
every stage, both dtypes, Adam / AdamW / Adam + L2, any bucketing and layout, gradient
accumulation, and stages 1 and 2 against each other. How the tests drive the
optimizer and why the gradients are exact: ``tests/helpers.py``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED,
    MODES,
    SHAPES,
    VARIANTS,
    Spec,
    add_grads,
    assert_all,
    backward,
    compare,
    make_params,
    mean_grads,
    mismatches,
    paired_cases,
    rank_grads,
    spec_of,
    train,
    verdict,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.reference import ReferenceAdam, average

BUCKET_CYCLE = [1, 5, 7, 64, None]  # None: the default bucket size


REFERENCE_CASES, REFERENCE_IDS = paired_cases(
    (
        (variant, mode, dtype, BUCKET_CYCLE[i % len(BUCKET_CYCLE)])
        for i, (mode, dtype, variant) in enumerate(itertools.product(MODES, [F32, F64], VARIANTS))
    ),
    lambda v, m, d, b: f"{v}-{m}-{d.name}-bucket{b}",
)


@pytest.mark.parametrize(
    ("comm", "variant", "mode", "dtype", "bucket_elems"),
    REFERENCE_CASES,
    ids=REFERENCE_IDS,
    indirect=["comm"],
)
def test_matches_reference_over_steps(
    comm: MPI.Intracomm, variant: str, mode: str, dtype: np.dtype, bucket_elems: int | None
) -> None:
    """Four steps of Adam / AdamW / Adam+L2: params after every step, Adam moments
    after the first and the last. Every mode meets every variant, both dtypes, every
    bucket size and every communicator."""
    stage, api = MODES[mode]
    hyper = VARIANTS[variant]
    spec = spec_of(SHAPES, dtype)
    params = make_params(spec)
    extra = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, **hyper, **extra)
    ref = ReferenceAdam(params, **hyper)
    verdict(train(opt, ref, spec, 4, check_state=lambda step: step == 0, api=api))


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_with_random_gradients(comm: MPI.Intracomm, mode: str) -> None:
    """Generic gradients: the rank sum is not exact, only within tolerance. The dtype
    alternates with the mode."""
    stage, api = MODES[mode]
    dtype = [F32, F64][list(MODES).index(mode) % 2]
    hyper = VARIANTS["adamw"]
    spec = spec_of(SHAPES, dtype)
    params = make_params(spec, seed=1)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7, **hyper)
    ref = ReferenceAdam(params, **hyper)
    verdict(train(opt, ref, spec, 3, exact_grads=False, api=api), dtype.name)


@pytest.mark.parametrize("mode", MODES)
def test_mixed_float32_and_float64_params(comm: MPI.Intracomm, mode: str) -> None:
    stage, api = MODES[mode]
    params = make_params(MIXED, seed=2)
    hyper = VARIANTS["adam_l2"]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=4, **hyper)
    ref = ReferenceAdam(params, **hyper)
    problems = []
    for name, (_, dtype) in MIXED.items():
        with opt.gathered(name) as p, opt.gradients(name) as g:
            arrays = [p[name], g[name], *([opt.grads[name]] if api == "grads" else [])]
            if any(a.dtype != dtype for a in arrays):
                problems.append(f"{name} has dtypes {[a.dtype for a in arrays]}, want {dtype}")
    opt.zero_grad()  # the hand-over above was empty; start the real steps afresh
    verdict(problems + train(opt, ref, MIXED, 3, api=api))


shape_st = st.lists(st.integers(min_value=1, max_value=6), min_size=0, max_size=2).map(tuple)


@pytest.mark.parametrize("comm", ["world", "split"], indirect=True)
@settings(max_examples=15)
@given(
    shapes=st.lists(st.tuples(shape_st, st.sampled_from([F32, F64])), min_size=1, max_size=4),
    mode=st.sampled_from(list(MODES)),
    variant=st.sampled_from(list(VARIANTS)),
    bucket_elems=st.integers(min_value=1, max_value=40),
    grouped=st.booleans(),
)
def test_matches_reference_for_any_layout(
    comm: MPI.Intracomm,
    shapes: list[tuple[tuple[int, ...], np.dtype]],
    mode: str,
    variant: str,
    bucket_elems: int,
    grouped: bool,
) -> None:
    """Any small model, any bucket size, any mode; if ``grouped``, consecutive
    parameters of one dtype pair up into groups. The drawn values never depend on the
    rank, so every rank runs the same examples. (Two communicators: this is the
    slowest test.)"""
    spec: Spec = {}
    for i, (shape, dtype) in enumerate(shapes):
        same = i > 0 and shapes[i - 1][1] == dtype and i % 2
        spec[f"g{i - 1 if grouped and same else i}.p{i}"] = (shape, dtype)
    params = make_params(spec, seed=len(shapes))
    stage, api = MODES[mode]
    hyper = VARIANTS[variant]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems, **hyper)
    ref = ReferenceAdam(params, **hyper)
    verdict(train(opt, ref, spec, 2, api=api), f"{spec} {mode} bucket_elems={bucket_elems}")


@pytest.mark.parametrize("n_micro", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation(comm: MPI.Intracomm, mode: str, n_micro: int) -> None:
    """``accumulate()`` after each micro-batch: the step uses the average over
    micro-batches of the mean over ranks (the reference's ``average``). Streamed,
    every micro-batch reduce-scatters each bucket into the accumulated shard."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=3)
    hyper = VARIANTS["adamw"]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=5, **hyper)
    ref = ReferenceAdam(params, **hyper)
    problems = []
    for step in range(2):
        micro_means = []
        for k in range(n_micro):
            backward(opt, rank_grads(spec, 10 * step + k, comm.rank), api)
            opt.accumulate()
            micro_means.append(mean_grads(spec, 10 * step + k, comm.size))
        opt.step()
        ref.step({name: average([m[name] for m in micro_means]) for name in spec})
        if stage < 3 or step == 1:
            problems += mismatches(opt, ref, comm.size == 1, f"step {step}", state=step == 1)
    verdict(problems)


@pytest.mark.parametrize("stage", [1, 2])
def test_step_without_accumulate_counts_one_micro_batch(comm: MPI.Intracomm, stage: int) -> None:
    spec = spec_of(SHAPES, F64)
    params = make_params(spec, seed=4)
    plain = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7)
    explicit = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7)
    ok = True
    for step in range(3):
        grads = rank_grads(spec, step, comm.rank, exact=False)
        add_grads(plain, grads)
        plain.step()
        add_grads(explicit, grads)
        explicit.accumulate()
        explicit.step()
        ok = ok and all(np.array_equal(plain.params[n], explicit.params[n]) for n in spec)
    assert_all(ok, "step() alone differs from accumulate(); step()")


@pytest.mark.parametrize("shared", [False, None])
@pytest.mark.parametrize("n_micro", [1, 3])
def test_stage_1_and_stage_2_agree(comm: MPI.Intracomm, n_micro: int, shared: bool | None) -> None:
    """Same gradients, same result: bit-identical with one micro-batch over MPI (both
    reduce-scatter the same buffer once), within tolerance with several (stage 1 sums
    micro-batches before the reduction, stage 2 after) and with node shared memory
    (stage 1 sums its full buffers in rank order within the node, stage 2's
    ``opt.grads`` take MPI's reduce-scatter: another order of the same sums). Generic
    random gradients."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=5)
    hyper = VARIANTS["adam_l2"]
    opts = [ZeroOptimizer(params, comm=comm, stage=s, bucket_elems=5, shared_memory=shared,
                          **hyper) for s in (1, 2)]  # fmt: skip
    exact = n_micro == 1 and not opts[0].shared_memory
    problems = []
    for step in range(3):
        for opt in opts:
            for k in range(n_micro):
                add_grads(opt, rank_grads(spec, 10 * step + k, comm.rank, exact=False))
                if n_micro > 1:
                    opt.accumulate()
            opt.step()
        problems += [
            f"step {step}: param {n!r} stage 2 differs from stage 1"
            for n in spec
            if exact and not np.array_equal(opts[0].params[n], opts[1].params[n])
        ]
    s1, s2 = (opt.gather_state() for opt in opts)
    for name in spec:
        pairs = [
            ("param", opts[0].params[name], opts[1].params[name]),
            ("exp_avg", s1["exp_avg"][name], s2["exp_avg"][name]),
            ("exp_avg_sq", s1["exp_avg_sq"][name], s2["exp_avg_sq"][name]),
        ]
        for label, a, b in pairs:
            problems += compare(b, a, exact, f"stage 2 vs stage 1 {label}[{name!r}]")
    verdict(problems)
