"""ZeroOptimizer: plain data parallelism (stage 0) and ZeRO stages 1-3 against the
unsharded reference.

Every collective test takes the ``comm`` fixture, so one ``mpiexec -n 4`` runs it on
communicators of sizes 1 to 4, some uneven. Rank ``r``'s gradient at step ``s`` is a
deterministic function of ``(s, r)``; the reference optimizer steps on the mean over
ranks of the same gradients, which every rank computes on its own. On a communicator
of one rank the sharded optimizer must reproduce the reference bit for bit; on more,
within float32 1e-6 / float64 1e-12 relative error (``helpers.rel_error``).

The optimizer is driven in one of five ``MODES``: stages 0-2 adding into
``opt.grads`` as a plain backward pass would, and stages 2 and 3 handing gradients
over group by group in reverse order through ``opt.gathered`` / ``opt.gradients``
(the streamed API that keeps stage 2-3 gradients at ``1/W``). Stage 3 has no
``opt.params``: its parameters are checked as the backward pass gathers them (the
values after the previous step) and with ``opt.full_params()``.

Gradients are multiples of 1/8 with a sign that depends only on the element, so the
sum over ranks is exact whatever order MPI adds them in and never cancels to (nearly)
zero: Adam's update ``m / (sqrt(v) + eps)`` turns a rounding residue of 1e-9 where the
exact value is 0 into a step of order ``lr``, which no tolerance can absorb. With these
gradients every stage equals the reference bit for bit at every world size (the sum
is exact, and the optimizer then computes what the reference computes, operation by
operation). One test uses generic random gradients instead, within a tolerance.

Verdicts that could differ between ranks are agreed on with the collective helpers;
each test makes the same number of them on every rank, whatever its sub-communicator,
and mostly just one at the end (problems are collected first), which keeps the suite
fast when ``mpiexec -n 4`` oversubscribes the cores. For the same reason the widest
tables pair each case with one communicator (cycling through all four) instead of
running every case on every communicator.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pytest
from helpers import assert_all, rel_error
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from zerompi import ZeroOptimizer, shard_counts
from zerompi.adam import BLOCK
from zerompi.mpi.agreement import CollectiveError
from zerompi.reference import ReferenceAdam, average

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
RTOL = {F32: 1e-6, F64: 1e-12}
CATEGORIES = (
    "optimizer_states",
    "gradient_partitions",
    "parameter_partitions",
    "communication_buffers",
    "scratch",
    "snapshots",  # elastic=True only (tests/test_elastic.py)
)
COMMS = ["world", "self", "split", "reversed"]  # the ``comm`` fixture's communicators

#: name -> (shape, dtype), in the model's order.
Spec = dict[str, tuple[tuple[int, ...], np.dtype]]

#: Assorted shapes in groups (layers): matrices, vectors, a tiny vector, a scalar, a
#: 3-D tensor, one element. Small buckets leave some ranks owning nothing in some
#: buckets; a group is never split across buckets.
SHAPES: dict[str, tuple[int, ...]] = {
    "l1.w": (7, 5),
    "l1.b": (5,),
    "tiny": (2,),
    "scalar": (),
    "l2.w": (3, 4, 2),
    "l2.one": (1,),
    "w3": (13,),
}

#: Mixed precision in one model, dtypes interleaved in the mapping's order.
MIXED: Spec = {
    "w": ((6, 4), F32),
    "d": ((9,), F64),
    "b": ((3,), F32),
    "s": ((), F64),
    "t": ((1,), F32),
}

VARIANTS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-2},
    "adamw": {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
    "adam_l2": {"lr": 1e-2, "weight_decay": 0.05},
}

#: How a test drives the optimizer: (stage, api). ``"grads"`` adds every gradient into
#: ``opt.grads`` (stages 0-2; stage 2 then holds a full staging buffer);
#: ``"streamed"`` hands them over group by group in reverse order inside
#: ``opt.gathered(group)`` / ``opt.gradients(group)``, as a backward pass does.
MODES: dict[str, tuple[int, str]] = {
    "stage0": (0, "grads"),
    "stage1": (1, "grads"),
    "stage2": (2, "grads"),
    "stage2-streamed": (2, "streamed"),
    "stage3": (3, "streamed"),
}


# -- deterministic data ------------------------------------------------------------------


def spec_of(shapes: Mapping[str, tuple[int, ...]], dtype: Any) -> Spec:
    return {name: (shape, np.dtype(dtype)) for name, shape in shapes.items()}


def make_params(spec: Spec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: np.asarray(rng.standard_normal(s), dtype=d) for n, (s, d) in spec.items()}


_GRADS: dict[tuple, dict[str, np.ndarray]] = {}


def _key(spec: Spec) -> tuple:
    return tuple((n, s, d.str) for n, (s, d) in spec.items())


def rank_grads(spec: Spec, step: int, rank: int, exact: bool = True) -> dict[str, np.ndarray]:
    """Rank ``rank``'s gradient at ``step`` (cached, read-only). If ``exact``: multiples
    of 1/8 of magnitude 1/8 to 3 and a sign fixed per element, else standard normal."""
    key = ("rank", _key(spec), step, rank, exact)
    if key not in _GRADS:
        out = {}
        for i, (name, (shape, dtype)) in enumerate(spec.items()):
            rng = np.random.default_rng([step, rank, i, int(exact)])
            if exact:
                sign = np.where(np.random.default_rng(i).random(shape) < 0.5, -1, 1)
                values = sign * rng.integers(1, 25, size=shape) / 8
            else:
                values = rng.standard_normal(shape)
            out[name] = np.asarray(values, dtype=dtype)
            out[name].flags.writeable = False
        _GRADS[key] = out
    return _GRADS[key]


def mean_grads(spec: Spec, step: int, size: int, exact: bool = True) -> dict[str, np.ndarray]:
    """The mean over ``size`` ranks of :func:`rank_grads`, in each parameter's dtype."""
    key = ("mean", _key(spec), step, size, exact)
    if key not in _GRADS:
        per_rank = [rank_grads(spec, step, r, exact) for r in range(size)]
        out = {}
        for name, (_, dtype) in spec.items():
            total = np.sum(np.stack([g[name] for g in per_rank]), axis=0)
            out[name] = np.asarray(total / size, dtype=dtype)
            out[name].flags.writeable = False
        _GRADS[key] = out
    return _GRADS[key]


def add_grads(opt: ZeroOptimizer, grads: Mapping[str, np.ndarray]) -> None:
    """What a backward pass does: add into opt.grads."""
    for name, g in grads.items():
        opt.grads[name][...] += g


def group_of(name: str) -> str:
    """The documented default grouping: the prefix before the last dot."""
    return name.rpartition(".")[0] or name


def groups_of(names: Iterable[str]) -> list[str]:
    """The groups of ``names``, in model order."""
    return list(dict.fromkeys(group_of(n) for n in names))


def backward(
    opt: ZeroOptimizer,
    grads: Mapping[str, np.ndarray],
    api: str,
    seen: dict[str, np.ndarray] | None = None,
) -> None:
    """Hand one micro-batch's gradients over with ``api`` (see ``MODES``). The
    streamed hand-over goes group by group in reverse order, each inside
    ``opt.gathered`` (collective in stage 3) and ``opt.gradients``; ``seen`` collects
    copies of the parameters gathered on the way."""
    if api == "grads":
        add_grads(opt, grads)
        return
    for group in reversed(groups_of(grads)):
        with opt.gathered(group) as p, opt.gradients(group) as g:
            if seen is not None:
                seen.update({name: value.copy() for name, value in p.items()})
            for name, view in g.items():
                view[...] += grads[name]


def current_params(opt: ZeroOptimizer) -> Mapping[str, np.ndarray]:
    """The full parameters: the persistent views in stages 0-2, a collective copy in 3."""
    return opt.full_params() if opt.stage == 3 else opt.params


def paired_cases(table: Iterable[tuple], ids: Callable[..., str]) -> tuple[list, list[str]]:
    """``table``'s rows, each prefixed with one communicator of the ``comm`` fixture
    (cycling through all four), and their ids: for ``indirect=["comm"]``."""
    rows = [(COMMS[i % len(COMMS)], *row) for i, row in enumerate(table)]
    return rows, [f"{row[0]}-{ids(*row[1:])}" for row in rows]


# -- comparisons (local; the verdict is agreed on by the caller) --------------------------


def compare(actual: Any, expected: Any, exact: bool, what: str) -> list[str]:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return [
            f"{what}: shape/dtype {actual.shape} {actual.dtype}, "
            f"want {expected.shape} {expected.dtype}"
        ]
    err = rel_error(actual, expected)
    tol = RTOL[expected.dtype]
    if not np.isfinite(err) or err > tol:
        return [f"{what}: relative error {err:.3e} > {tol:.0e}"]
    if exact and not np.array_equal(actual, expected):
        return [f"{what}: not bit-identical to the reference (relative error {err:.1e})"]
    return []


def mismatches(
    opt: ZeroOptimizer, ref: ReferenceAdam, exact: bool, what: str, state: bool = True
) -> list[str]:
    """Params (and, if ``state``, the gathered Adam moments) vs the reference, and
    whether every rank of the communicator holds the same parameters. Collective on
    the optimizer's communicator in stage 3, or if ``state``."""
    problems = []
    params = current_params(opt)
    for name, want in ref.params.items():
        problems += compare(params[name], want, exact, f"{what} param {name!r}")
    if state:
        moments = opt.gather_state()
        for key, ref_moments in (("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
            for name, want in ref_moments.items():
                problems += compare(moments[key][name], want, exact, f"{what} {key}[{name!r}]")
        blob = b"".join(np.ascontiguousarray(p).tobytes() for p in params.values())
        if any(b != blob for b in opt.comm.allgather(blob)):
            problems.append(f"{what}: ranks of the communicator hold different parameters")
    return problems


def verdict(problems: list[str], context: str = "") -> None:
    """Collective: fail on every rank if any rank found a problem."""
    head = f"{context}:\n" if context else ""
    assert_all(not problems, head + "\n".join(problems[:12]))


def train(
    opt: ZeroOptimizer,
    ref: ReferenceAdam,
    spec: Spec,
    steps: int,
    exact_grads: bool = True,
    check_state: Callable[[int], bool] = lambda step: False,
    api: str = "grads",
) -> list[str]:
    """``steps`` steps of the optimizer and the reference on the same gradients,
    handed over with ``api``; params compared after every step (stage 3: as the next
    backward pass gathers them, and after the last step), Adam moments where
    ``check_state(step)`` and after the last step."""
    comm = opt.comm
    exact = exact_grads  # exactly representable sums: bit for bit at every world size
    problems = []
    for step in range(steps):
        seen: dict[str, np.ndarray] | None = {} if opt.stage == 3 else None
        backward(opt, rank_grads(spec, step, comm.rank, exact_grads), api, seen)
        if seen is not None:  # what the backward pass used: the params after the last step
            for name, want in ref.params.items():
                got = seen.get(name)
                if got is None:
                    problems.append(f"step {step}: {name!r} was not gathered")
                else:
                    problems += compare(got, want, exact, f"before step {step}: {name!r}")
        opt.step()
        ref.step(mean_grads(spec, step, comm.size, exact_grads))
        state = check_state(step) or step == steps - 1
        if opt.stage < 3 or state:
            problems += mismatches(opt, ref, exact, f"step {step}", state)
    return problems


# -- 1. sharded Adam / AdamW vs the reference ---------------------------------------------

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
def test_hyperparameters_changed_between_steps(comm: MPI.Intracomm, mode: str) -> None:
    """A schedule: ``set_hyperparameters`` between steps (the learning rate, then
    weight decay, betas and eps too) takes effect from the next step, exactly as the
    reference changed alike; a warm-up from ``lr=0`` moves the moments, not the
    parameters (as torch's Adam does)."""
    stage, api = MODES[mode]
    hyper = VARIANTS["adamw"]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=3)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7, **hyper)
    ref = ReferenceAdam(params, **hyper)
    schedule = [{"lr": 0.0}, {"lr": 5e-3}, {"lr": 2e-3, "weight_decay": 0.2},
                {"lr": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}]  # fmt: skip
    names = {"lr": "lr", "weight_decay": "wd", "beta1": "b1", "beta2": "b2", "eps": "eps"}
    problems = []
    for step, change in enumerate(schedule):
        opt.set_hyperparameters(**change)
        for key, value in change.items():
            setattr(ref, names[key], value)
        backward(opt, rank_grads(spec, step, comm.rank), api, None)
        opt.step()
        ref.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, ref, True, f"step {step} after {change}", step == 3)
    if opt.hyperparameters()["lr"] != 1e-3:
        problems.append(f"hyperparameters() says lr {opt.hyperparameters()['lr']}")
    verdict(problems)


#: Two groups beside group 0 (the constructor's settings): a no-decay group of
#: vectors, and one layer with its own lr, betas and eps. With ``bucket_elems=7`` the
#: groups cut through buckets and through the ranks' shards.
GROUPS = [
    {"params": ["l1.b", "l2.one", "scalar"], "weight_decay": 0.0},
    {"params": ["l2.w"], "lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6},
]


@pytest.mark.parametrize("mode", MODES)
def test_param_groups_have_their_own_settings(comm: MPI.Intracomm, mode: str) -> None:
    """Every parameter steps with its group's settings, bit for bit as a reference
    per group; ``set_hyperparameters(group=...)`` changes that group only; the
    checkpoint's header lists the groups."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=5)
    base = VARIANTS["adamw"]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=7,
                        param_groups=GROUPS, **base)  # fmt: skip
    listed = [set(g["params"]) for g in GROUPS]
    members = [[n for n in params if not any(n in s for s in listed)], *map(sorted, listed)]
    refs = []
    for names, group in zip(members, [{}, *GROUPS], strict=True):
        settings = {**base, **{k: v for k, v in group.items() if k != "params"}}
        refs.append(ReferenceAdam({n: params[n] for n in names}, **settings))
    problems = []
    for step in range(3):
        if step == 2:
            opt.set_hyperparameters(group=2, lr=1e-3)
            refs[2].lr = 1e-3
        backward(opt, rank_grads(spec, step, comm.rank), api, None)
        opt.step()
        mean = mean_grads(spec, step, comm.size)
        for ref in refs:
            ref.step({n: mean[n] for n in ref.params})
    full = opt.full_params()
    for ref in refs:
        for name, want in ref.params.items():
            problems += compare(full[name], want, True, f"{mode}: {name!r}")
    saved = opt.hyperparameters()["param_groups"]
    if [sorted(g["params"]) for g in saved] != members[1:] or saved[1]["lr"] != 1e-3:
        problems.append(f"hyperparameters() lists {saved}")
    verdict(problems)


def test_param_groups_are_checked(comm: MPI.Intracomm) -> None:
    """A parameter in two groups, a name that is no parameter, an unknown setting, a
    group number that does not exist: a clear error on every rank."""
    params = make_params(spec_of(SHAPES, F32))
    problems = []
    for groups, match in (
        ([{"params": ["l1.w"]}, {"params": ["l1.w"], "lr": 1.0}], "already in param_groups[0]"),
        ([{"params": ["nope"]}], "'nope', which is not a parameter"),
        ([{"params": ["l1.w"], "momentum": 0.9}], "unknown setting 'momentum'"),
    ):
        try:
            ZeroOptimizer(params, comm=comm, param_groups=groups)
            problems.append(f"{groups} accepted")
        except (ValueError, TypeError) as exc:
            if match not in str(exc):
                problems.append(f"{groups}: {exc}")
    opt = ZeroOptimizer(params, comm=comm, param_groups=GROUPS)
    try:
        opt.set_hyperparameters(group=3, lr=1.0)
        problems.append("group 3 accepted")
    except ValueError as exc:
        if "no parameter group 3" not in str(exc):
            problems.append(str(exc))
    verdict(problems)


def test_hyperparameters_that_differ_between_ranks_fail_the_step(comm: MPI.Intracomm) -> None:
    """Ranks that set different settings fail every step on every rank, naming the
    rank, before Adam runs (the state is untouched), until they agree again; bad
    settings are refused at once."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec, seed=4)
    opt = ZeroOptimizer(params, comm=comm, stage=2, lr=1e-2)
    problems = []
    for bad, kind in (({"lr": -1.0}, ValueError), ({"momentum": 0.9}, TypeError)):
        try:
            opt.set_hyperparameters(**bad)
            problems.append(f"{bad} accepted")
        except kind:
            pass
    opt.set_hyperparameters(lr=1e-2 * (1 + comm.rank))
    before = opt.full_params()
    for step in range(3):
        if step == 2:
            opt.set_hyperparameters(lr=1e-2)  # the ranks agree again
        backward(opt, rank_grads(spec, step, comm.rank), "streamed", None)
        error = None
        try:
            opt.step()
        except CollectiveError as exc:
            error = str(exc)
        fails = comm.size > 1 and step < 2
        if fails and (error is None or "Adam's settings differ between ranks" not in error):
            problems.append(f"step {step}: no CollectiveError about the settings: {error}")
        if not fails and error is not None:
            problems.append(f"step {step} failed: {error}")
        if step == 1:
            after = opt.full_params()
            if comm.size > 1 and any(not np.array_equal(before[n], after[n]) for n in before):
                problems.append("the parameters changed")
    if opt.step_count != (1 if comm.size > 1 else 3):
        problems.append(f"{opt.step_count} steps taken")
    verdict(problems)


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


# -- 2. gradient accumulation -------------------------------------------------------------


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


# -- 3. params and grads: views into flat storage -----------------------------------------


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


# -- 4. memory_usage ----------------------------------------------------------------------


def bucket_members(spec: Spec, bucket_elems: int, stage: int) -> dict[np.dtype, list[list[str]]]:
    """Parameter names per bucket, per dtype, from the documented layout and without
    the engine's Layout: per dtype, runs of consecutive parameters of one group are
    units that are never split; stage 3 gives each unit a bucket of its own, stages
    0-2 pack consecutive units greedily up to ``bucket_elems`` (a larger unit alone)."""
    size_of = {n: int(np.prod(s, dtype=np.int64)) for n, (s, _) in spec.items()}
    out: dict[np.dtype, list[list[str]]] = {}
    for dtype in dict.fromkeys(d for _, d in spec.values()):
        units: list[list[str]] = []
        for name, (_, d) in spec.items():
            if d == dtype:
                if units and group_of(units[-1][-1]) == group_of(name):
                    units[-1].append(name)
                else:
                    units.append([name])
        buckets: list[list[str]] = []
        for unit in units:
            current = sum(size_of[n] for n in buckets[-1]) if buckets else 0
            if not buckets or stage == 3 or current + sum(size_of[n] for n in unit) > bucket_elems:
                buckets.append([])
            buckets[-1].extend(unit)
        out[dtype] = buckets
    return out


def bucket_sizes(spec: Spec, bucket_elems: int, stage: int) -> dict[np.dtype, list[int]]:
    """Elements per bucket, per dtype (see :func:`bucket_members`)."""
    size_of = {n: int(np.prod(s, dtype=np.int64)) for n, (s, _) in spec.items()}
    members = bucket_members(spec, bucket_elems, stage)
    return {d: [sum(size_of[n] for n in b) for b in bs] for d, bs in members.items()}


def expected_usage(
    spec: Spec,
    size: int,
    rank: int,
    bucket_elems: int,
    stage: int,
    full_grads: bool = False,
    slots: int = 2,
) -> tuple[dict[str, int], int]:
    """Bytes per category: parameters full (stage 3: the shard), gradients full
    (stages 2-3: the shard), Adam moments the shard (stage 0: full), ``slots``
    staging buckets of the largest bucket's size in stages 2-3 (2 with ``overlap``,
    1 without) and as many gather buckets in stage 3 (prefetch), per dtype; ``full_grads``: the full
    staging buffer stage 2 allocates for ``opt.grads``. Also returns an upper bound
    for the Adam kernel's scratch."""
    usage = dict.fromkeys(CATEGORIES, 0)
    scratch_bound = 0
    for dtype, buckets in bucket_sizes(spec, bucket_elems, stage).items():
        item = dtype.itemsize
        full = sum(buckets) * item
        shard = sum(shard_counts(b, size)[0][rank] for b in buckets) * item
        biggest = max(buckets) * item
        usage["parameter_partitions"] += shard if stage == 3 else full
        usage["gradient_partitions"] += full if stage <= 1 else shard
        usage["optimizer_states"] += 2 * (full if stage == 0 else shard)
        usage["communication_buffers"] += {0: 0, 1: 0, 2: slots, 3: 2 * slots}[stage] * biggest
        if full_grads:
            usage["communication_buffers"] += full
        scratch_bound += min(BLOCK * item, max(full if stage == 0 else shard, item))
    return usage, scratch_bound


def usage_problems(usage: dict[str, int], want: dict[str, int], bound: int) -> list[str]:
    problems = []
    if set(usage) != set(CATEGORIES) or not all(type(v) is int for v in usage.values()):
        problems.append(f"categories {usage}")
    for cat, value in want.items():
        if cat != "scratch" and usage.get(cat) != value:
            problems.append(f"{cat} {usage.get(cat)} bytes, want {value}")
    if not 0 < usage.get("scratch", 0) <= bound:
        problems.append(f"scratch {usage.get('scratch')}, want in (0, {bound}]")
    return problems


@pytest.mark.parametrize("mode", MODES)
def test_memory_usage_is_exact(comm: MPI.Intracomm, mode: str) -> None:
    """``memory_usage()`` equals the documented layout to the byte, before and after
    training; summed over ranks, what a stage shards is stored exactly once (no
    duplication, no padding). Stage 2 holds a full staging buffer only once
    ``opt.grads`` has been used."""
    stage, api = MODES[mode]
    spec = {**MIXED, "big": ((37, 3), F32)}
    params = make_params(spec)
    total = sum(p.nbytes for p in params.values())
    copies = {  # how many times the world stores each category
        "optimizer_states": 2 * (comm.size if stage == 0 else 1),
        "gradient_partitions": comm.size if stage <= 1 else 1,
        "parameter_partitions": comm.size if stage <= 2 else 1,
    }
    problems = []
    for bucket_elems in (1, 7, 1 << 22):
        what = f"bucket_elems={bucket_elems}"
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems,
                            shared_memory=False)  # per-rank copies; node copies: test_stages
        want, bound = expected_usage(spec, comm.size, comm.rank, bucket_elems, stage)
        usage = opt.memory_usage()
        problems += [f"{what}: {p}" for p in usage_problems(usage, want, bound)]
        sums = comm.allreduce(np.array([usage.get(cat, 0) for cat in copies]))
        for (cat, n), got in zip(copies.items(), sums, strict=True):
            if got != n * total:
                problems.append(f"{what}: {cat} sum to {got} over ranks, want {n} x {total}")
        # Training allocates nothing further, except stage 2's full gradient for opt.grads.
        backward(opt, rank_grads(spec, 0, comm.rank), api)
        opt.accumulate()
        opt.step()
        full_grads = stage == 2 and api == "grads"
        want, bound = expected_usage(spec, comm.size, comm.rank, bucket_elems, stage, full_grads)
        after = opt.memory_usage()
        problems += [f"{what} after training: {p}" for p in usage_problems(after, want, bound)]
        if full_grads:
            buffers = opt.memory_buffers()
            for dtype in (F32, F64):
                name = f"grads_full.{dtype.name}"
                size = sum(p.nbytes for p in params.values() if p.dtype == dtype)
                if buffers.get(name) != size:
                    problems.append(f"{what}: buffer {name} {buffers.get(name)}, want {size}")
        elif after != usage:
            problems.append(f"{what}: usage changed in training: {after} vs {usage}")
    verdict(problems, mode)


# -- 5. training allocates nothing model-sized --------------------------------------------


def forward(opt: ZeroOptimizer, names: Iterable[str]) -> None:
    """A forward pass's use of the parameters: each group gathered in turn."""
    for group in groups_of(names):
        with opt.gathered(group):
            pass


@pytest.mark.parametrize("mode", MODES)
def test_training_allocates_nothing_the_size_of_the_model(comm: MPI.Intracomm, mode: str) -> None:
    """numpy reports its allocations to tracemalloc: the peak during a whole forward
    pass, backward pass and step (after a warm-up) must be far below the model's
    size. In stages 2-3 that covers the streamed hand-over (each bucket
    reduce-scattered through the staging buffer) and stage 3's gathers. Memory, not
    time."""
    stage, api = MODES[mode]
    spec: Spec = {
        "l1.w": ((200, 150), F32),
        "l1.b": ((150,), F32),
        "v": ((17_500,), F32),
        "d": ((2_500,), F64),
        "s": ((), F32),
    }
    params = make_params(spec)
    model_bytes = sum(p.nbytes for p in params.values())
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=12_500)
    grads = [rank_grads(spec, step, comm.rank, exact=False) for step in range(3)]
    peaks = []
    for step in range(3):  # step 0 warms up (stage 2 allocates its full grads for opt.grads)
        tracing = step > 0
        if tracing:
            tracemalloc.start()
        try:
            if api == "streamed":
                forward(opt, spec)
            backward(opt, grads[step], api)
            if step == 2:
                opt.accumulate()  # stages 2-3: the reduce-scatters happen here or before
            opt.step()
            if tracing:
                peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            if tracing:
                tracemalloc.stop()
    # Control: the tracer does see a model-sized numpy allocation.
    tracemalloc.start()
    try:
        np.ones(model_bytes // 8)
        control = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_all(
        control >= model_bytes // 2 and max(peaks) < model_bytes / 10,
        f"peak traced allocation in training: {peaks} bytes, model {model_bytes} bytes "
        f"(control allocation traced as {control} bytes)",
    )


# -- 6. bad input: raised on every rank, naming the value ----------------------------------


def good_params() -> dict[str, np.ndarray]:
    return make_params(MIXED, seed=11)


def raises(
    exc_type: type[Exception], match: str, fn: Callable[[], object], what: str
) -> tuple[BaseException | None, list[str]]:
    """Local: run ``fn``, return the exception and what is wrong with it."""
    try:
        fn()
    except exc_type as exc:
        return exc, [] if match in str(exc) else [f"{what}: {match!r} not in {exc!s}"]
    except Exception as exc:
        return exc, [f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"]
    return None, [f"{what}: expected {exc_type.__name__}, nothing was raised"]


BAD_PARAMS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("int dtype", lambda: {"w": np.arange(6)}, TypeError, "parameter 'w' has dtype int64"),
    ("float16", lambda: {"h": np.zeros(3, np.float16)}, TypeError, "'h' has dtype float16"),
    ("complex", lambda: {"c": np.zeros(3, np.complex128)}, TypeError, "has dtype complex128"),
    ("list", lambda: {"w": [1.0, 2.0]}, TypeError, "or zerompi.Deferred, got list [1.0, 2.0]"),
    ("int", lambda: {"w": 3}, TypeError, "parameter 'w' must be a numpy array or zerompi.Def"),
    ("np scalar", lambda: {"w": np.float32(1)}, TypeError, "'w' must be a numpy array"),
    ("empty mapping", dict, ValueError, "params is empty"),
    (
        "zero-size",
        lambda: {"w": np.zeros((0, 3), F32)},
        ValueError,
        "'w' has no elements (shape (0, 3))",
    ),
    ("not a mapping", lambda: [np.zeros(3, F32)], TypeError, "params must be a mapping"),
    (
        "name not str",
        lambda: {1: np.zeros(3, F32)},
        TypeError,
        "parameter names must be str, got 1",
    ),
    (
        "later param bad",
        lambda: {**good_params(), "z": np.ones(2, np.int32)},
        TypeError,
        "'z' has dtype int32",
    ),
]

BAD_SETTINGS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("stage 4", {"stage": 4}, ValueError, "stage must be one of (0, 1, 2, 3), got 4"),
    ("stage -1", {"stage": -1}, ValueError, "stage must be one of (0, 1, 2, 3), got -1"),
    ("stage '2'", {"stage": "2"}, ValueError, "stage must be one of (0, 1, 2, 3), got '2'"),
    ("stage True", {"stage": True}, ValueError, "stage must be one of (0, 1, 2, 3), got True"),
    ("stage False", {"stage": False}, ValueError, "stage must be one of (0, 1, 2, 3), got False"),
    ("stage 2.0", {"stage": 2.0}, ValueError, "stage must be one of (0, 1, 2, 3), got 2.0"),
    ("stage None", {"stage": None}, ValueError, "stage must be one of (0, 1, 2, 3), got None"),
    ("lr < 0", {"lr": -1e-3}, ValueError, "lr must be >= 0, got -0.001"),
    ("lr -0.5", {"lr": -0.5}, ValueError, "lr must be >= 0, got -0.5"),
    ("lr nan", {"lr": float("nan")}, ValueError, "lr must be finite, got nan"),
    ("lr inf", {"lr": float("inf")}, ValueError, "lr must be finite, got inf"),
    ("lr str", {"lr": "0.1"}, TypeError, "lr must be a real number, got '0.1'"),
    ("lr None", {"lr": None}, TypeError, "lr must be a real number, got None"),
    ("eps 0", {"eps": 0.0}, ValueError, "eps must be > 0, got 0.0"),
    ("eps < 0", {"eps": -1e-8}, ValueError, "eps must be > 0, got -1e-08"),
    ("eps nan", {"eps": float("nan")}, ValueError, "eps must be finite, got nan"),
    ("beta1 1", {"betas": (1.0, 0.999)}, ValueError, "beta1 must be in [0, 1), got 1.0"),
    ("beta1 < 0", {"betas": (-0.5, 0.999)}, ValueError, "beta1 must be in [0, 1), got -0.5"),
    ("beta2 < 0", {"betas": (0.9, -0.1)}, ValueError, "beta2 must be in [0, 1), got -0.1"),
    ("beta2 1.5", {"betas": (0.9, 1.5)}, ValueError, "beta2 must be in [0, 1), got 1.5"),
    ("beta2 nan", {"betas": (0.9, float("nan"))}, ValueError, "beta2 must be finite, got nan"),
    ("betas 1", {"betas": (0.9,)}, ValueError, "betas must be a pair (beta1, beta2), got (0.9,)"),
    ("betas 3", {"betas": (0.9, 0.99, 0.999)}, ValueError, "got (0.9, 0.99, 0.999)"),
    ("betas float", {"betas": 0.9}, ValueError, "betas must be a pair (beta1, beta2), got 0.9"),
    ("betas None", {"betas": None}, ValueError, "betas must be a pair (beta1, beta2), got None"),
    ("wd < 0", {"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0, got -0.1"),
    ("wd nan", {"weight_decay": float("nan")}, ValueError, "weight_decay must be finite, got nan"),
    ("decoupled 1", {"decoupled_weight_decay": 1}, TypeError, "must be a bool, got 1"),
    ("bucket 0", {"bucket_elems": 0}, ValueError, "got 0"),
    ("bucket < 0", {"bucket_elems": -5}, ValueError, "got -5"),
    ("bucket float", {"bucket_elems": 2.5}, TypeError, "got 2.5"),
    ("bucket True", {"bucket_elems": True}, TypeError, "got True"),
]


def test_rejects_bad_input_on_every_rank() -> None:
    """Each case is rejected on every rank of the world, with its own type (TypeError
    stays TypeError; value errors arrive as CollectiveError, a ValueError), and a
    message naming the value and saying it was found on all ranks."""
    world = MPI.COMM_WORLD
    cases = [
        (name, lambda make=make: ZeroOptimizer(make(), comm=world), exc_type, match)  # type: ignore[arg-type]
        for name, make, exc_type, match in BAD_PARAMS
    ] + [
        (name, lambda kw=kw: ZeroOptimizer(good_params(), comm=world, **kw), exc_type, match)
        for name, kw, exc_type, match in BAD_SETTINGS
    ]
    problems = []
    for name, fn, exc_type, match in cases:
        exc, wrong = raises(exc_type, match, fn, name)
        problems += wrong
        suffix = f"(on all {world.size} ranks)" if world.size > 1 else "(on rank 0 of 1)"
        if exc is not None and not str(exc).endswith(suffix):
            problems.append(f"{name}: {exc!s} does not end with {suffix}")
        if exc is not None and exc_type is TypeError and type(exc) is not TypeError:
            problems.append(f"{name}: TypeError arrived as {type(exc).__name__}")
        if exc is not None and exc_type is ValueError and type(exc) is not CollectiveError:
            problems.append(f"{name}: ValueError arrived as {type(exc).__name__}")
    verdict(problems)


def still_usable(comm: MPI.Intracomm) -> list[str]:
    """After a rejected construction the communicator must still be in step: build a
    good optimizer and train one step against the reference."""
    params = good_params()
    opt = ZeroOptimizer(params, comm=comm)
    return train(opt, ReferenceAdam(params), MIXED, 1)


def swap_first_two(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = list(p)
    names[0], names[1] = names[1], names[0]
    return {n: p[n] for n in names}


def rename(p: dict[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {(new if n == old else n): v for n, v in p.items()}


LAYOUT = "the parameter layout (name, shape, dtype, group) differs between ranks"
SETTINGS = (
    "the optimizer settings (stage, hyperparameters, param_groups, bucket_elems) differs "
    "between ranks"
)

#: (id, the rank that differs, its params, its settings, the message, what it names)
ODD_LAYOUTS: list[tuple[str, str, Callable[[], dict], dict[str, Any], str, str]] = [
    ("shape", "last", lambda: {**good_params(), "w": np.zeros((4, 6), F32)}, {}, LAYOUT, "(4, 6)"),
    (
        "shape rank0",
        "first",
        lambda: {**good_params(), "b": np.zeros((1, 3), F32)},
        {},
        LAYOUT,
        "(1, 3)",
    ),
    ("name", "last", lambda: rename(good_params(), "b", "bias"), {}, LAYOUT, "'bias'"),
    ("order", "last", lambda: swap_first_two(good_params()), {}, LAYOUT, "item 0"),
    ("dtype", "last", lambda: {**good_params(), "b": np.zeros(3, F64)}, {}, LAYOUT, "'<f8'"),
    (
        "extra param",
        "last",
        lambda: {**good_params(), "x": np.zeros(2, F32)},
        {},
        LAYOUT,
        "0 has 5 items",
    ),
    (
        "missing param",
        "first",
        lambda: dict(list(good_params().items())[:-1]),
        {},
        LAYOUT,
        "0 has 4 items",
    ),
    ("lr", "last", good_params, {"lr": 2e-3}, SETTINGS, "lr=0.002"),
    ("stage", "last", good_params, {"stage": 2}, SETTINGS, "item 0 is 1 on rank 0 but 2"),
    ("stage rank0", "first", good_params, {"stage": 2}, SETTINGS, "item 0 is 2 on rank 0 but 1"),
    ("stage 0", "last", good_params, {"stage": 0}, SETTINGS, "item 0 is 1 on rank 0 but 0"),
    ("stage 3", "last", good_params, {"stage": 3}, SETTINGS, "item 0 is 1 on rank 0 but 3"),
    ("stage 3 rank0", "first", good_params, {"stage": 3}, SETTINGS, "is 3 on rank 0 but 1"),
    (
        "group",
        "last",
        good_params,
        {"group_of": lambda name: "all"},
        LAYOUT,
        "('w', (6, 4), '<f4', 'all')",
    ),
    ("betas", "last", good_params, {"betas": (0.8, 0.999)}, SETTINGS, "beta1=0.8"),
    ("weight decay", "last", good_params, {"weight_decay": 0.01}, SETTINGS, "weight_decay=0.01"),
    (
        "decoupled",
        "last",
        good_params,
        {"decoupled_weight_decay": True},
        SETTINGS,
        "decoupled=True",
    ),
    (
        "bucket_elems",
        "last",
        good_params,
        {"bucket_elems": 5},
        SETTINGS,
        "item 3 is 4 on rank 0 but 5",
    ),
]


def test_rank_dependent_layout_raises_everywhere(comm: MPI.Intracomm) -> None:
    """One rank differs: every rank raises a CollectiveError (instead of hanging in a
    mismatched collective) naming the first rank unlike rank 0 and the difference. On
    a communicator of one rank nothing can differ and construction succeeds."""
    problems = []
    for name, odd, make, kwargs, message, detail in ODD_LAYOUTS:
        odd_rank = 0 if odd == "first" else comm.size - 1
        mine = make() if comm.rank == odd_rank else good_params()
        settings_ = {"bucket_elems": 4, **(kwargs if comm.rank == odd_rank else {})}
        build = lambda mine=mine, settings_=settings_: ZeroOptimizer(  # noqa: E731
            mine, comm=comm, **settings_
        )
        if comm.size == 1:
            try:
                build()
            except Exception as exc:
                problems.append(f"{name}: alone, {type(exc).__name__}: {exc}")
            continue
        exc, wrong = raises(CollectiveError, message, build, name)
        problems += wrong
        named = f"rank {1 if odd == 'first' else comm.size - 1}"  # first rank unlike rank 0
        if exc is not None and (detail not in str(exc) or named not in str(exc)):
            problems.append(f"{name}: {exc!s} does not name {detail!r} and {named}")
    verdict(problems + still_usable(comm))


#: (id, the rank that fails, its params, its settings, error type, message)
LocalCase = tuple[str, str, Callable[[], object], dict[str, Any], type[Exception], str]
ODD_LOCAL_ERRORS: list[LocalCase] = [
    ("int array rank0", "first", lambda: {**good_params(), "w": np.arange(24).reshape(6, 4)}, {},
     TypeError, "parameter 'w' has dtype int64"),
    ("list last", "last", lambda: {**good_params(), "b": [1.0, 2.0, 3.0]}, {},
     TypeError, "parameter 'b' must be a numpy array"),
    ("zero-size last", "last", lambda: {**good_params(), "b": np.zeros(0, F32)}, {},
     ValueError, "parameter 'b' has no elements"),
    ("empty last", "last", dict, {}, ValueError, "params is empty"),
    ("lr last", "last", good_params, {"lr": -1.0}, ValueError, "lr must be >= 0, got -1.0"),
    ("betas rank0", "first", good_params, {"betas": (1.0, 0.999)}, ValueError,
     "beta1 must be in [0, 1), got 1.0"),
    ("stage rank0", "first", good_params, {"stage": 4}, ValueError,
     "stage must be one of (0, 1, 2, 3), got 4"),
    ("stage last", "last", good_params, {"stage": 2.0}, ValueError,
     "stage must be one of (0, 1, 2, 3), got 2.0"),
    ("bucket last", "last", good_params, {"bucket_elems": 0}, ValueError, "got 0"),
    # float(10**400) overflows: an error outside TypeError/ValueError must not hang either.
    ("huge lr last", "last", good_params, {"lr": 10**400}, ValueError, "lr must be finite"),
]  # fmt: skip


def test_local_error_on_one_rank_raises_everywhere(comm: MPI.Intracomm) -> None:
    """Only one rank's own validation fails; every rank raises that error (a TypeError
    stays a TypeError) naming the rank it came from."""
    problems = []
    for name, odd, make, kwargs, exc_type, match in ODD_LOCAL_ERRORS:
        odd_rank = 0 if odd == "first" else comm.size - 1
        mine = make() if comm.rank == odd_rank else good_params()
        settings_ = kwargs if comm.rank == odd_rank else {}
        build = lambda mine=mine, settings_=settings_: ZeroOptimizer(  # noqa: E731
            mine, comm=comm, **settings_
        )
        exc, wrong = raises(exc_type, match, build, name)
        problems += wrong
        where = f"(on rank {odd_rank} of {comm.size})"
        if exc is not None and not str(exc).endswith(where):
            problems.append(f"{name}: {exc!s} does not end with {where}")
        if exc is not None and exc_type is TypeError and type(exc) is not TypeError:
            problems.append(f"{name}: TypeError arrived as {type(exc).__name__}")
    verdict(problems + still_usable(comm))
