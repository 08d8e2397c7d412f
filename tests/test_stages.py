"""The four stages' streaming semantics, against the unsharded reference.

What differs between stages is what a rank keeps and when it communicates (see
``zerompi.plan``, ``zerompi.reducer``); what must not differ is the result, bit for
bit (the gradients are exactly representable, so their sum is exact). These tests drive the
optimizer the way a model does, through ``opt.gathered`` / ``opt.gradients``, in
orders a backward pass may take: a bucket handed over in pieces with other buckets
in between, one parameter handed over twice, a group never handed over. They also
pin down stage 3's gather buffer lifecycle, the errors of misuse, ``Deferred``
parameters, ``memory_usage()`` per stage and the bytes each stage moves.

The model ``TINY`` has groups of 1 to 8 elements in both dtypes, so on 2 to 4 ranks
some ranks own nothing of most buckets. Like ``test_reference`` (with the helpers of
``helpers.py``): gradients are multiples of 1/8, so every sum is exact; bit-identical
to the reference on one rank, float32 1e-6 / float64 1e-12 relative error on more;
one collective verdict per test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MODES,
    VARIANTS,
    Spec,
    assert_all,
    backward,
    bucket_members,
    bucket_sizes,
    compare,
    current_params,
    forward,
    group_of,
    groups_of,
    make_params,
    raises,
    rank_grads,
    spec_of,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import Deferred, ZeroOptimizer, shard_counts
from zerompi.buffers import Kind
from zerompi.mpi.agreement import CollectiveError
from zerompi.reduction import NodeReduce
from zerompi.reference import ReferenceAdam

STAGES = [0, 1, 2, 3]
LARGE = 1 << 20  # one bucket per dtype in stages 0-2

#: Groups (layers) of 1 to 8 elements, float32 and float64 interleaved. Per dtype,
#: units in order: float32 a(8) b(1) g(2) d(6), float64 c(5) e(2). Buckets: at
#: bucket_elems=1 one per group; at 3 [a] [b g] [d] [c] [e]; at LARGE one per dtype;
#: stage 3 always one per group.
TINY: Spec = {
    "a.w": ((3, 2), F32),
    "a.b": ((2,), F32),
    "b.w": ((1,), F32),
    "c.w": ((2, 2), F64),
    "c.b": ((), F64),
    "g.w": ((2,), F32),
    "e.w": ((1,), F64),
    "e.b": ((1,), F64),
    "d.w": ((5,), F32),
    "d.b": ((1,), F32),
}
GROUPS = list(dict.fromkeys(group_of(n) for n in TINY))  # a b c g e d
HYPER = VARIANTS["adam_l2"]  # weight decay: a zero gradient still moves the parameters


def expand(names: Sequence[str], spec: Spec = TINY) -> list[str]:
    """Parameter names for a mix of parameter and group names."""
    return [n for name in names for n in spec if n == name or group_of(n) == name]


# -- hand-over scripts ---------------------------------------------------------------------

#: One micro-batch: hand-overs in order, each ``(names, seed)``: ``opt.gradients(*names)``
#: adds the gradients of ``rank_grads(TINY, seed, rank)`` for those names.
Micro = list[tuple[tuple[str, ...], int]]
#: ``script(step)``: the micro-batches of a step (the same on every rank; the values
#: differ per rank through ``rank_grads``).
Script = Callable[[int], list[Micro]]


def reference_grads(script: Script, step: int, size: int) -> dict[str, np.ndarray]:
    """What the reference steps on: every rank's hand-overs summed (exactly: multiples
    of 1/8), divided by ranks x micro-batches as the optimizer does."""
    micro = script(step)
    totals = {n: np.zeros(shape, dtype) for n, (shape, dtype) in TINY.items()}
    for rank in range(size):
        for handovers in micro:
            for names, seed in handovers:
                grads = rank_grads(TINY, seed, rank)
                for n in expand(names):
                    totals[n] += grads[n]
    return {n: t / (size * len(micro)) for n, t in totals.items()}


def hand_over(opt: ZeroOptimizer, names: tuple[str, ...], grads: Mapping[str, np.ndarray],
              api: str = "block", turn: int = 0) -> None:  # fmt: skip
    """Add ``grads`` of ``names`` through ``opt.gradients`` (``api="block"``),
    ``opt.add_gradients`` (``"add"``: a parameter's first hand-over of a micro-batch
    overwrites its staging region), the two taking turns (``"mixed"``), or ``"late"``:
    ``add`` until the ranks agreed at the first step's end that none entered a block
    (:meth:`zerompi.reducer.StagedGradients._agree`), then blocks on odd ranks; or
    ``"rank"``: blocks on odd ranks from the start, ``add`` on even ones."""
    agreed = getattr(opt.engine.reducer, "full_mode", None) is not None
    if api in ("late", "rank") and opt.comm.rank % 2 and (agreed or api == "rank"):
        api = "block"
    if api in ("add", "late", "rank") or (api == "mixed" and turn % 2):
        opt.add_gradients({n: grads[n] for n in expand(names)})
        return
    with opt.gradients(*names) as g:
        for n, view in g.items():
            view[...] += grads[n]


#: How scripted hand-overs reach the optimizer (:func:`hand_over`).
APIS = ["block", "add", "mixed"]


def play(opt: ZeroOptimizer, ref: ReferenceAdam, script: Script, steps: int,
         api: str = "block") -> list[str]:  # fmt: skip
    """Run ``script`` for ``steps`` steps (``accumulate()`` after each micro-batch when
    a step has several) and the reference on the same gradients. Params compared after
    every step in stages 0-2 and after the last in stage 3 (``full_params()``)."""
    comm = opt.comm
    problems = []
    for step in range(steps):
        micro = script(step)
        for handovers in micro:
            for turn, (names, seed) in enumerate(handovers):
                hand_over(opt, names, rank_grads(TINY, seed, comm.rank), api, turn)
            if len(micro) > 1:
                opt.accumulate()
        opt.step()
        ref.step(reference_grads(script, step, comm.size))
        if opt.stage < 3 or step == steps - 1:
            params = current_params(opt)
            for name, want in ref.params.items():
                problems += compare(params[name], want, True, f"step {step} {name!r}")
    return problems


def reverse_groups(seed: int) -> Micro:
    """A backward pass: every group once, in reverse order."""
    return [((group,), seed) for group in reversed(GROUPS)]


BUCKETS = {0: [3], 1: [3], 2: [3, LARGE], 3: [1]}  # bucket_elems is moot in stage 3


def run_script(comm: MPI.Intracomm, stage: int, script: Script, steps: int = 2,
               api: str = "block") -> list[str]:  # fmt: skip
    """``script`` against the reference, with two staging slots (``overlap``: a bucket
    may still be reducing while the next fills, or while the same bucket is handed
    over again) and with one, each through MPI and through node shared memory."""
    problems = []
    variants = [(True, False)]
    if stage >= 2:
        variants += [(False, False), (True, True), (False, True)]
    for bucket_elems in BUCKETS[stage]:
        for overlap, shared in variants:
            params = make_params(TINY, seed=stage)
            opt = ZeroOptimizer(
                params, comm=comm, stage=stage, bucket_elems=bucket_elems, overlap=overlap,
                shared_memory=shared, **HYPER,
            )  # fmt: skip
            ref = ReferenceAdam(params, **HYPER)
            what = f"bucket_elems={bucket_elems} overlap={overlap} shared_memory={shared}"
            if opt.shared_memory != (shared and opt.nodes.uniform):  # used where it works
                problems.append(f"{what}: opt.shared_memory is {opt.shared_memory}")
            problems += [f"{what}: {p}" for p in play(opt, ref, script, steps, api)]
            opt.close()
    return problems


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_with_reductions_in_flight(comm: MPI.Intracomm, stage: int, api: str) -> None:
    """Buckets handed over (their reductions started, not completed), then
    ``zero_grad()``: they are completed and discarded; the step sees only what comes
    after (the shards the discarded reductions wrote are overwritten, not added to).
    Then a step, a ``zero_grad()`` and a partial hand-over again before the next."""
    problems = []
    for overlap in (True, False):
        params = make_params(TINY, seed=5)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, overlap=overlap,
                            **HYPER)  # fmt: skip
        ref = ReferenceAdam(params, **HYPER)
        for turn, (names, seed) in enumerate(reverse_groups(3)[:4]):
            hand_over(opt, names, rank_grads(TINY, seed, comm.rank), api, turn)
        opt.zero_grad()
        problems += [f"overlap={overlap}: {p}" for p in play(opt, ref, lambda s: [
            reverse_groups(7 + s)], 2, api)]  # fmt: skip
        opt.zero_grad()
        for turn, (names, seed) in enumerate(reverse_groups(4)[1:3]):
            hand_over(opt, names, rank_grads(TINY, seed, comm.rank), api, turn)
        opt.zero_grad()
        problems += [f"overlap={overlap}, after: {p}" for p in play(opt, ref, lambda s: [
            reverse_groups(9 + s)[2:]], 1, api)]  # fmt: skip
    verdict(problems, f"stage {stage}")


# -- 1. every stage, every layout: the reference --------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_stage_matches_the_reference(comm: MPI.Intracomm, mode: str) -> None:
    """Two steps of a full backward pass (streamed: in reverse group order inside
    ``gathered`` + ``gradients``), for bucket sizes that give one bucket per group, a
    few merged groups, and one bucket per dtype: ranks owning nothing of a bucket
    take part in every collective with a count of zero."""
    stage, api = MODES[mode]
    problems = []
    for bucket_elems in (1, 3, LARGE) if stage < 3 else (1,):
        params = make_params(TINY, seed=20)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems, **HYPER)
        ref = ReferenceAdam(params, **HYPER)
        found = train(opt, ref, TINY, 2, api=api)
        problems += [f"bucket_elems={bucket_elems}: {p}" for p in found]
    verdict(problems, mode)


# -- 2. hand-over orders --------------------------------------------------------------------

#: Buckets handed over piecemeal: a parameter of one bucket, then of another (another
#: dtype, too), then back; group and parameter names mixed. Every bucket's pieces are
#: flushed (reduce-scattered) when the hand-over switches away, and summed.
PIECEMEAL: Micro = [
    (("a.w",), 0),
    (("c.w",), 0),
    (("d",), 0),
    (("a.b",), 0),
    (("b.w",), 0),
    (("c.b",), 0),
    (("g.w",), 0),
    (("e.b",), 0),
    (("e.w",), 0),
]


def piecemeal(step: int) -> list[Micro]:
    shifted = [(names, seed + 10 * step) for names, seed in PIECEMEAL]
    if step == 0:
        return [shifted]
    return [shifted, [(names, seed + 1) for names, seed in shifted[::-1]]]  # 2 micro-batches


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stage", STAGES)
def test_partial_hand_over_then_switching_buckets(
    comm: MPI.Intracomm, stage: int, api: str
) -> None:
    verdict(run_script(comm, stage, piecemeal, api=api), f"stage {stage} {api}")


def twice(step: int) -> list[Micro]:
    """``a.w`` handed over twice while its bucket is open (``a.b`` still pending),
    then every group once more; ``d.w`` and ``e`` again after their buckets were
    complete (and reduce-scattered). All of it adds up."""
    seed = 10 * step
    micro = [(("a.w",), seed + 1), (("a.w",), seed + 2), (("a.b",), seed + 3)]
    micro += [*reverse_groups(seed), (("d.w",), seed + 4), (("e",), seed + 5)]
    return [micro]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stage", STAGES)
def test_the_same_parameter_handed_over_twice_sums(
    comm: MPI.Intracomm, stage: int, api: str
) -> None:
    verdict(run_script(comm, stage, twice, api=api), f"stage {stage} {api}")


def skipping(step: int) -> list[Micro]:
    """Step 0: everything. Step 1: ``b`` (one element) and ``c`` (a float64 group)
    never handed over, ``a`` only in part (``a.w``): the reference gets zeros there. The
    stage 2-3 gradient shards were used as scratch by step 0: they must be zeroed,
    not reused."""
    if step == 0:
        return [reverse_groups(0)]
    return [[((g,), 1) for g in reversed(GROUPS) if g not in ("b", "c", "a")] + [(("a.w",), 1)]]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_group_never_handed_over_has_zero_gradient(
    comm: MPI.Intracomm, stage: int, api: str
) -> None:
    verdict(run_script(comm, stage, skipping, api=api), f"stage {stage} {api}")


@pytest.mark.parametrize("stage", [2, 3])
def test_sums_stop_zeroing_when_no_rank_uses_blocks(comm: MPI.Intracomm, stage: int) -> None:
    """Within a node a sum zeroes what it reads only while some rank may add into a
    block: after the first step the ranks agree, and with ``add_gradients`` alone on
    every rank the sums stop writing zeros (each hand-over overwrites its stale
    region). Ranks that then enter blocks (odd ranks, ``"late"``) zero their own
    regions; where odd ranks use blocks from the start (``"rank"``) every rank keeps
    zeroing. Every script still matches the reference, over micro-batches, pieces of
    buckets, parameters handed over twice or never."""
    problems = []
    one = comm.size == 1  # no odd rank
    for api, clears in (("block", True), ("add", False), ("late", False), ("rank", not one)):
        params = make_params(TINY, seed=stage)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=3, **HYPER)
        ref = ReferenceAdam(params, **HYPER)
        problems += play(opt, ref, piecemeal, 1, api)
        summed = [b for b in opt.engine.reducer.backends if isinstance(b, NodeReduce)]
        if opt.shared_memory and not summed:
            problems.append(f"{api}: no sum within a node")
        if any(b.clears != clears for b in summed):
            problems.append(f"{api}: clears {[b.clears for b in summed]}, want {clears}")
        opt.close()
    for script, api in ((piecemeal, "late"), (piecemeal, "rank"), (twice, "late"),
                        (skipping, "rank")):  # fmt: skip
        problems += run_script(comm, stage, script, steps=3, api=api)
    verdict(problems, f"stage {stage}")


def test_stage_2_full_grads_and_streamed_hand_over_add_up(comm: MPI.Intracomm) -> None:
    """Stage 2 with both APIs in one micro-batch: ``opt.grads`` for some groups, the
    streamed hand-over for the others (and ``a`` through both)."""
    params = make_params(TINY, seed=21)
    opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=3, **HYPER)
    ref = ReferenceAdam(params, **HYPER)
    problems = []
    for step in range(2):
        grads = rank_grads(TINY, step, comm.rank)
        for name in expand(["a", "c", "d"]):
            opt.grads[name][...] += grads[name]
        for group in ("a", "b", "g", "e"):
            hand_over(opt, (group,), grads)
        opt.step()
        want = reference_grads(
            lambda s: [[(("a", "c", "d"), s), (("a",), s), (("b", "g", "e"), s)]],
            step,
            comm.size,
        )
        ref.step(want)
        for name, value in ref.params.items():
            problems += compare(opt.params[name], value, True, f"step {step} {name!r}")
    verdict(problems)


# -- 3. stage 3: the gather buffer ------------------------------------------------------------


class Boom(Exception):
    pass


def enter(cm: Any) -> None:
    with cm:
        pass


def test_stage_3_gathers_one_bucket_at_a_time(comm: MPI.Intracomm) -> None:
    """The gather buffer holds one bucket for the duration of a ``gathered`` block:
    nesting raises RuntimeError on every rank (before any collective), and after the
    block (left normally, by an exception, or followed by ``step()``) nothing is
    gathered and the next ``gathered`` works. No buffer comes or goes."""
    params = make_params(TINY, seed=22)
    opt = ZeroOptimizer(params, comm=comm, stage=3, **HYPER)
    ref = ReferenceAdam(params, **HYPER)
    buffers = opt.memory_buffers()
    exact = comm.size == 1
    problems = []

    def released(when: str) -> None:
        if opt.engine.access.in_use is not None:
            problems.append(f"{when}: bucket {opt.engine.access.in_use} still gathered")

    def check(p: Mapping[str, np.ndarray], names: Sequence[str], when: str) -> None:
        if sorted(p) != sorted(expand(names)):
            problems.append(f"{when}: gathered {sorted(p)}, want {sorted(expand(names))}")
        for name in p:
            problems.extend(compare(p[name], ref.params[name], exact, f"{when}: {name!r}"))

    released("after construction")
    with opt.gathered("a") as p:
        check(p, ["a"], "gathered('a')")
        for inner in (("c",), ("a.w",), ("a",)):
            _, wrong = raises(
                RuntimeError, "cannot nest", lambda i=inner: enter(opt.gathered(*i)), f"{inner}"
            )
            problems += [f"nested gathered{inner} inside gathered('a'): {w}" for w in wrong]
        check(p, ["a"], "gathered('a') after the failed nesting")
    released("after a block")
    with opt.gathered("c.b", "c.w") as p:
        check(p, ["c"], "gathered('c.b', 'c.w') after the block")
    try:
        with opt.gathered("d"):
            raise Boom
    except Boom:
        pass
    released("after a block left by an exception")
    with opt.gathered("e.w") as p:
        check(p, ["e.w"], "gathered('e.w') after the exception")
    for step in range(2):
        forward(opt, TINY)
        backward(opt, rank_grads(TINY, step, comm.rank), "streamed")
        opt.step()
        ref.step(reference_grads(lambda s: [reverse_groups(s)], step, comm.size))
        released(f"after step {step}")
    with opt.gathered("b") as p, opt.gradients("b"):  # gradients() may nest in gathered()
        check(p, ["b"], "gathered('b') after the steps")
    opt.zero_grad()  # completes the reduction that handing 'b' over started
    released("at the end")
    if opt.memory_buffers() != buffers:
        problems.append(f"buffers changed: {opt.memory_buffers()} vs {buffers}")
    verdict(problems)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gathered_may_nest_below_stage_3(stage: int) -> None:
    """Stages 0-2 keep full parameters: ``gathered`` yields the persistent views and
    communicates nothing, so blocks may nest."""
    opt = ZeroOptimizer(make_params(TINY, seed=23), comm=MPI.COMM_WORLD, stage=stage)
    problems = []
    opt.comm.pop_traffic()
    with opt.gathered("a") as outer, opt.gathered("a.w", "c") as inner:
        if outer["a.w"] is not opt.params["a.w"] or inner["c.b"] is not opt.params["c.b"]:
            problems.append("gathered() does not yield the persistent views")
    if opt.comm.pop_traffic():
        problems.append("gathered() communicated")
    verdict(problems, f"stage {stage}")


# -- 4. misuse -----------------------------------------------------------------------------


def test_stage_3_has_no_params_or_grads() -> None:
    """Stage 3 keeps only shards: ``opt.params`` / ``opt.grads`` raise AttributeError
    saying what to use instead."""
    opt = ZeroOptimizer(make_params(TINY, seed=24), comm=MPI.COMM_WORLD, stage=3)
    problems = []
    wanted = {"params": ("stage 3", "gathered", "full_params()"), "grads": ("stage 3", "gradients")}
    for attr, words in wanted.items():
        exc, wrong = raises(AttributeError, words[0], lambda a=attr: getattr(opt, a), attr)
        problems += wrong
        problems += [
            f"opt.{attr}: {exc} does not mention {w!r}" for w in words if w not in str(exc)
        ]
        if hasattr(opt, attr):
            problems.append(f"hasattr(opt, {attr!r}) is true")
    verdict(problems)


SPANNING = [("a", "c"), ("a.w", "b.w"), ("d.b", "a"), ("e", "c.w")]


@pytest.mark.parametrize("stage", STAGES)
def test_names_spanning_two_buckets(stage: int) -> None:
    """With one bucket per group, ``gathered`` (stage 3) and ``gradients`` (stages
    2-3) take the names of one bucket at a time: ValueError on every rank, naming the
    buckets, and nothing is left half done (a step afterwards matches the
    reference). Stages 0-1 (and stage 2's ``gathered``) accept any names."""
    comm = MPI.COMM_WORLD
    params = make_params(TINY, seed=25)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, **HYPER)
    ref = ReferenceAdam(params, **HYPER)
    problems = []
    for names in SPANNING:
        for what, limit in (("gathered", 3), ("gradients", 2)):
            cm = lambda w=what, n=names: enter(getattr(opt, w)(*n))  # noqa: E731
            if stage >= limit:
                problems += raises(ValueError, "span 2 buckets", cm, f"{what}{names}")[1]
                continue
            try:
                cm()
            except Exception as exc:
                problems.append(f"{what}{names}: {type(exc).__name__}: {exc}")
    problems += train(opt, ref, TINY, 1, api="streamed")
    verdict(problems, f"stage {stage}")


UNKNOWN = [("nope",), ("a", "nope"), ("a.x",), ("a.",), ("",), ("A",)]


@pytest.mark.parametrize("stage", STAGES)
def test_unknown_names_raise_key_error(stage: int) -> None:
    comm = MPI.COMM_WORLD
    opt = ZeroOptimizer(make_params(TINY, seed=26), comm=comm, stage=stage, bucket_elems=1)
    problems = []
    for names in UNKNOWN:
        bad = next(n for n in names if n not in TINY and n not in GROUPS)
        for what in ("gathered", "gradients"):
            cm = lambda w=what, n=names: enter(getattr(opt, w)(*n))  # noqa: E731
            message = f"{bad!r} is neither a parameter nor a group"
            problems += raises(KeyError, message, cm, f"{what}{names}")[1]
    verdict(problems, f"stage {stage}")


# -- 5. Deferred parameters -------------------------------------------------------------------


def deferred_model(calls: Counter) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """TINY with most parameters ``Deferred`` (counting their ``init`` calls in
    ``calls``), ``c.b`` and ``d.b`` plain arrays, and ``e.w``'s init returning float32
    for a float64 parameter (cast). Also returns the values every rank must end up
    with."""
    values = make_params(TINY, seed=27)
    model: dict[str, Any] = {}
    for name, (shape, dtype) in TINY.items():
        if name in ("c.b", "d.b"):
            model[name] = values[name]
            continue
        made = values[name].astype(F32) if name == "e.w" else values[name]

        def init(name: str = name, made: np.ndarray = made) -> np.ndarray:
            calls[name] += 1
            return made.copy()

        model[name] = Deferred(shape, dtype, init)
        values[name] = made.astype(dtype)
    return model, values


@pytest.mark.parametrize("stage", STAGES)
def test_deferred_init_runs_on_rank_0_only(comm: MPI.Intracomm, stage: int) -> None:
    calls: Counter = Counter()
    model, values = deferred_model(calls)
    opt = ZeroOptimizer(model, comm=comm, stage=stage, bucket_elems=3)
    counts = comm.allgather(dict(calls))
    problems = []
    deferred = sorted(n for n, v in model.items() if isinstance(v, Deferred))
    if counts[0] != dict.fromkeys(deferred, 1):
        problems.append(f"rank 0 called init {counts[0]}, want each of {deferred} once")
    problems += [f"rank {r} called init {c}" for r, c in enumerate(counts) if r and c]
    params = current_params(opt)
    for name, want in values.items():
        problems += compare(params[name], want, True, f"{name!r}")
    verdict(problems, f"stage {stage}")


def wrong_shape() -> np.ndarray:
    return np.zeros(5)


def boom_init() -> np.ndarray:
    raise ZeroDivisionError("no data for c.w")


BAD_INITS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "wrong shape",
        wrong_shape,
        CollectiveError,
        "init of parameter 'c.w' returned ndarray of shape (5,), expected an array of shape (2, 2)",
    ),
    ("a list", lambda: [[0.0, 0.0], [0.0, 0.0]], CollectiveError, "returned list of shape None"),
    ("raises", boom_init, CollectiveError, "no data for c.w"),
    ("complex", lambda: np.zeros((2, 2), complex), TypeError, "Cannot cast"),
]


@pytest.mark.parametrize("stage", STAGES)
def test_deferred_init_failure_raises_on_every_rank(comm: MPI.Intracomm, stage: int) -> None:
    """A bad ``init`` (of a float64 parameter: in stage 3, after the float32 buckets
    were broadcast) fails on rank 0 only; every rank raises, naming rank 0, instead
    of hanging in the broadcast. The communicator is still in step afterwards."""
    problems = []
    base = make_params(TINY, seed=28)
    for what, init, exc_type, match in BAD_INITS:
        model = {**base, "c.w": Deferred((2, 2), F64, init)}
        build = lambda m=model: ZeroOptimizer(m, comm=comm, stage=stage, bucket_elems=3)  # noqa: E731
        exc, wrong = raises(exc_type, match, build, what)
        problems += wrong
        if exc is not None and not str(exc).endswith(f"(on rank 0 of {comm.size})"):
            problems.append(f"{what}: {exc} does not name rank 0 of {comm.size}")
    opt = ZeroOptimizer(base, comm=comm, stage=stage, bucket_elems=3, **HYPER)
    problems += train(opt, ReferenceAdam(base, **HYPER), TINY, 1, api="streamed")
    verdict(problems, f"stage {stage}")


@pytest.mark.parametrize("param_dtype", [None, "float16"])
@pytest.mark.parametrize("stage", STAGES)
def test_deferred_release_runs_on_every_rank_once_its_value_is_held(
    comm: MPI.Intracomm, stage: int, param_dtype: str | None
) -> None:
    """``Deferred.release`` (how ``zerompi.torch`` frees a module's own copy while
    the optimizer is built): called once per parameter on every rank, on rank 0 after
    its ``init``; the values are still rank 0's. Both initialization paths: whole
    buffers (stages 0-2) and bucket by bucket (stage 3, a rounded copy)."""
    calls: Counter = Counter()
    model, values = deferred_model(calls)
    released: list[tuple[str, int]] = []
    for name, value in model.items():
        if isinstance(value, Deferred):
            mark = lambda n=name: released.append((n, calls[n]))  # noqa: E731
            model[name] = Deferred(value.shape, value.dtype, value.init, mark)
    opt = ZeroOptimizer(model, comm=comm, stage=stage, bucket_elems=3, param_dtype=param_dtype)
    deferred = sorted(n for n, v in model.items() if isinstance(v, Deferred))
    problems = []
    if sorted(n for n, _ in released) != deferred:
        problems.append(f"rank {comm.rank} released {released}, want each of {deferred} once")
    inits = {n: c for n, c in released}
    if comm.rank == 0 and inits != dict.fromkeys(deferred, 1):
        problems.append(f"rank 0 released before init: {inits}")
    if comm.rank and any(inits.values()):
        problems.append(f"rank {comm.rank} called init: {inits}")
    params = current_params(opt)
    for name, want in values.items():
        if param_dtype is None:
            problems += compare(params[name], want, True, f"{name!r}")
        elif not np.allclose(np.asarray(params[name], want.dtype), want, rtol=1e-3, atol=1e-4):
            problems.append(f"{name!r}: {params[name]} is not {want} rounded to {param_dtype}")
    verdict(problems, f"stage {stage}, param_dtype {param_dtype}")


def test_deferred_release_failure_raises_on_every_rank(comm: MPI.Intracomm) -> None:
    """A ``release`` that raises on the last rank only: every rank raises, naming it,
    at stages 2 and 3 (the two initialization paths); the communicator stays in step."""
    problems = []
    base = make_params(TINY, seed=29)
    last = comm.size - 1

    def release() -> None:
        if comm.rank == last:
            raise OSError("cannot free c.w")

    for stage in (2, 3):
        model = {**base, "c.w": Deferred((2, 2), F64, lambda: base["c.w"].copy(), release)}
        build = lambda m=model, s=stage: ZeroOptimizer(m, comm=comm, stage=s, bucket_elems=3)  # noqa: E731
        exc, wrong = raises(CollectiveError, "cannot free c.w", build, f"stage {stage}")
        problems += wrong
        if exc is not None and not str(exc).endswith(f"(on rank {last} of {comm.size})"):
            problems.append(f"stage {stage}: {exc} does not name rank {last} of {comm.size}")
    opt = ZeroOptimizer(base, comm=comm, stage=3, bucket_elems=3, **HYPER)
    problems += train(opt, ReferenceAdam(base, **HYPER), TINY, 1, api="streamed")
    verdict(problems, "release failure")


# -- 6. memory and traffic per stage ---------------------------------------------------------


def stage_usage(
    stage: int, dtype: np.dtype, buckets: list[int], size: int, rank: int, slots: int = 2
) -> dict:
    """Bytes per category (scratch aside) from the bucket sizes and ``shard_counts``;
    ``slots`` staging buckets (2 with ``overlap``, the default)."""
    item = dtype.itemsize
    full = sum(buckets) * item
    shard = sum(shard_counts(b, size)[0][rank] for b in buckets) * item
    biggest = max(buckets) * item
    return {
        0: {"parameter_partitions": full, "gradient_partitions": full,
            "optimizer_states": 2 * full, "communication_buffers": 0},
        1: {"parameter_partitions": full, "gradient_partitions": full,
            "optimizer_states": 2 * shard, "communication_buffers": 0},
        2: {"parameter_partitions": full, "gradient_partitions": shard,
            "optimizer_states": 2 * shard, "communication_buffers": slots * biggest},
        3: {"parameter_partitions": shard, "gradient_partitions": shard,
            "optimizer_states": 2 * shard, "communication_buffers": 2 * slots * biggest},
    }[stage]  # fmt: skip


#: Per stage, the categories held as shards: summed over ranks they are the full size.
SHARDED = {
    0: [],
    1: ["optimizer_states"],
    2: ["optimizer_states", "gradient_partitions"],
    3: ["optimizer_states", "gradient_partitions", "parameter_partitions"],
}


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("stage", STAGES)
def test_memory_usage_per_stage(comm: MPI.Intracomm, stage: int, dtype: np.dtype) -> None:
    """Stage 0: everything full. 1: parameters and gradients full, Adam moments
    sharded. 2: parameters full, gradients and moments sharded, plus two staging
    buckets of the largest bucket's size (one with overlap=False). 3: everything
    sharded, plus the staging and as many gather buckets. Sharded categories sum over
    ranks to the model exactly: no padding."""
    spec = spec_of({n: s for n, (s, _) in TINY.items()}, dtype)
    params = make_params(spec, seed=29)
    full = sum(p.nbytes for p in params.values())
    problems = []
    cases = [(7, True), (LARGE, True), (LARGE, False)] if stage < 3 else [(LARGE, True)]
    if stage == 3:
        cases.append((LARGE, False))
    for bucket_elems, overlap in cases:
        opt = ZeroOptimizer(
            params, comm=comm, stage=stage, bucket_elems=bucket_elems, overlap=overlap,
            shared_memory=False,  # per-rank copies (node copies: tests/test_nodes.py)
        )
        buckets = bucket_sizes(spec, bucket_elems, stage)[dtype]
        slots = 2 if overlap else 1
        want = stage_usage(stage, dtype, buckets, comm.size, comm.rank, slots)
        usage = opt.memory_usage()
        what = f"bucket_elems={bucket_elems} overlap={overlap}"
        problems += [
            f"{what}: {cat} {usage.get(cat)} bytes, want {value}"
            for cat, value in want.items()
            if usage.get(cat) != value
        ]
        comm_buffers = {
            n: b for n, b in opt.memory_buffers().items() if "bucket" in n or "full" in n
        }
        names = {2: ["grad_bucket"], 3: ["grad_bucket", "param_bucket"]}.get(stage, [])
        biggest = max(buckets) * dtype.itemsize
        sizes = {"grad_bucket": slots * biggest, "param_bucket": slots * biggest}  # prefetch
        if comm_buffers != {f"{n}.{dtype.name}": sizes[n] for n in names}:
            problems.append(f"{what}: communication buffers {comm_buffers}")
        sums = comm.allreduce(np.array([usage[cat] for cat in SHARDED[stage]], dtype=np.int64))
        for cat, total in zip(SHARDED[stage], sums, strict=True):
            factor = 2 if cat == "optimizer_states" else 1
            if total != factor * full:
                problems.append(f"{what}: {cat} sum to {total} over ranks, want {factor * full}")
    verdict(problems, f"stage {stage} {dtype.name}")


def traffic_totals(comm: MPI.Intracomm, traffic: list[dict[str, dict[str, int]]]) -> Counter:
    """Bytes sent and received per op: ``traffic`` (this rank's ``pop_traffic()``
    results) summed over its items and over the ranks of ``comm``."""
    out: Counter = Counter()
    for rank_traffic in comm.allgather(traffic):
        for popped in rank_traffic:
            for op, entry in popped.items():
                for key, value in entry.items():
                    out[op, key] += value
    return out


def streamed_backward(
    opt: ZeroOptimizer, spec: Spec, grads: Mapping[str, np.ndarray], traffic: list
) -> list[bool]:
    """The streamed backward pass, popping the traffic into ``traffic`` after each
    group; returns, per group, whether a reduce-scatter happened during its hand-over."""
    reduced = []
    for group in reversed(groups_of(spec)):
        with opt.gathered(group), opt.gradients(group) as g:
            for name, view in g.items():
                view[...] += grads[name]
        traffic.append(opt.comm.pop_traffic())
        reduced.append("reduce_scatter" in traffic[-1])
    return reduced


def completed_buckets(spec: Spec, bucket_elems: int, stage: int) -> list[bool]:
    """Per group of a reverse pass: whether its hand-over completes a bucket."""
    members = [b for bs in bucket_members(spec, bucket_elems, stage).values() for b in bs]
    done: set[str] = set()
    out = []
    for group in reversed(groups_of(spec)):
        done.add(group)
        bucket = next(b for b in members if group in map(group_of, b))
        out.append(all(group_of(n) in done for n in bucket))
    return out


#: (model, bucket_elems) whose buckets a backward pass in reverse group order completes
#: one after the other: TINY with one bucket per group, and TINY in float32 alone with
#: buckets [a] [b c] [g e] [d]. (With TINY's interleaved dtypes, bucket_elems=3 puts
#: b and g in one float32 bucket with the float64 c between them: a reverse pass
#: reduce-scatters that bucket twice, half empty each time. Correct, but more bytes.)
TRAFFIC_MODELS: list[tuple[Spec, int]] = [
    (TINY, 1),
    (spec_of({n: s for n, (s, _) in TINY.items()}, F32), 7),
]


@pytest.mark.parametrize("mode", MODES)
def test_bytes_moved_per_step(comm: MPI.Intracomm, mode: str) -> None:
    """One step without accumulation moves, averaged over ranks, ``(W-1)/W`` of the
    model per collective pass: 2 passes in stages 1-2 (reduce-scatter, allgather), 3
    in stage 3 (forward gather, backward gather, reduce-scatter). Stage 0's
    allreduce counts the same 2 passes, to a byte per bucket and rank (summed within
    one node: a reduce-scatter and an allgather, exactly). Every byte
    sent is received. Then a step of two micro-batches: stages 2-3 reduce-scatter
    each one, stages 0-1 only the sum. Inspection (``full_params``,
    ``gather_state``) is not training traffic."""
    stage, api = MODES[mode]
    spec, bucket_elems = TRAFFIC_MODELS[list(MODES).index(mode) % 2]
    params = make_params(spec, seed=30)
    model = sum(p.nbytes for p in params.values())
    n_buckets = sum(len(b) for b in bucket_sizes(spec, bucket_elems, stage).values())
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems)
    w = comm.size
    problems = []
    for step, n_micro in enumerate((1, 2)):
        opt.comm.pop_traffic()
        traffic: list[dict[str, dict[str, int]]] = []
        for k in range(n_micro):
            grads = rank_grads(spec, step + k, comm.rank)
            if stage == 3:
                forward(opt, spec)
            if api == "grads":
                backward(opt, grads, api)
            else:  # stages 2-3 reduce-scatter a bucket as soon as its last group is in
                reduced = streamed_backward(opt, spec, grads, traffic)
                flushes = completed_buckets(spec, bucket_elems, stage)
                if reduced != [stage >= 2 and done for done in flushes]:
                    problems.append(f"step {step}: reduce-scatters in the backward {reduced}")
            if n_micro > 1:
                opt.accumulate()
        opt.step()
        traffic.append(opt.comm.pop_traffic())
        if api == "streamed" and stage >= 2 and "reduce_scatter" in traffic[-1]:
            problems.append(f"step {step}: step() reduce-scattered what was handed over")
        totals = traffic_totals(comm, traffic)
        if stage == 0 and not opt.engine.plan.shared_memory:
            want = {("allreduce", "sent"): 2 * (w - 1) * model}
        elif stage == 0:  # summed within one node: its shards, then the others' sums
            layers = False
            want = {("reduce_scatter", "sent"): (w - 1) * model,
                    ("allgather", "sent"): (w - 1) * model}  # fmt: skip
        else:
            reductions = n_micro if stage >= 2 else 1
            layers = stage == 3 and not opt.engine.plan.full_params  # (one node: read in place)
            gathers = 2 * n_micro if layers else 1
            want = {
                ("reduce_scatter", "sent"): reductions * (w - 1) * model,
                ("allgather", "sent"): gathers * (w - 1) * model,
            }
        what = f"step {step} ({n_micro} micro-batches)"
        if {op for op, _ in totals} != {op for op, _ in want}:
            problems.append(f"{what}: ops {sorted(totals)}, want {sorted(want)}")
        for (op, _), value in want.items():
            sent, received = totals[op, "sent"], totals[op, "received"]
            slack = w * n_buckets if op == "allreduce" else 0  # a floor per bucket and rank
            if not value - slack <= sent <= value:
                problems.append(f"{what}: {op} sent {sent} bytes over {w} ranks, want {value}")
            if received != sent:
                problems.append(f"{what}: {op} received {received} != sent {sent}")
        if n_micro == 1 and (stage > 0 or opt.engine.plan.shared_memory):  # the mean
            # over ranks, as the textbook has it
            mean = Fraction(sum(v for (_, key), v in totals.items() if key == "sent"), w)
            passes = 3 if layers else 2
            if mean != Fraction(passes * model * (w - 1), w):
                problems.append(f"{what}: mean bytes sent {mean}, want {passes}*P*(W-1)/W")
    opt.full_params()
    opt.gather_state()
    if opt.comm.pop_traffic():
        problems.append("full_params() / gather_state() counted as training traffic")
    verdict(problems, mode)


def test_stage_2_grads_used_on_one_rank_only_does_not_hang(comm: MPI.Intracomm) -> None:
    """Reading opt.grads (say, to log a norm) on one rank allocates the full staging
    buffer there only; the ranks must still run the same collectives. The gradient
    added through it on that rank counts, like any other."""
    opt = ZeroOptimizer({"l.w": np.ones(8, np.float32)}, comm=comm, stage=2, lr=0.5)
    if comm.rank == 0:
        opt.grads["l.w"][...] += 2.0 * comm.size
    with opt.gradients("l") as g:
        g["l.w"][...] += 1.0
    opt.step()
    ref = ReferenceAdam({"l.w": np.ones(8, np.float32)}, lr=0.5)
    ref.step({"l.w": np.full(8, (2.0 * comm.size + comm.size) / comm.size, np.float32)})
    got = opt.params["l.w"]
    assert_all(
        bool(np.allclose(got, ref.params["l.w"], rtol=1e-6))
        and opt.memory_buffers().get("grads_full.float32") == 32,
        f"params {got}, want {ref.params['l.w']}; buffers {opt.memory_buffers()}",
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_shared_memory_close(comm: MPI.Intracomm, stage: int) -> None:
    """``close()`` frees the windows (collective) and refuses further hand-overs on
    every rank, keeping the parameters (stage 2 keeps them in a window) readable and
    accounted; the ``with`` form closes on exit; memory is accounted the same as
    without the window; stage 0 shares its gradients over any number of nodes of equal size."""
    params = make_params(TINY, seed=9)
    problems = []
    plain = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=3, shared_memory=False)
    with ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=3,
                       shared_memory=True) as opt:  # fmt: skip
        # the same buffers, but stage 2's parameters are one copy per node, shared out
        used, want = opt.memory_usage(), dict(plain.memory_usage())
        if Kind.PARAMS in opt.engine.plan.node_memory:  # stages 1-2, stage 3 on one node
            total = sum(p.nbytes for p in params.values())
            share = comm.allreduce(used["parameter_partitions"])
            if share != total * opt.nodes.count:
                problems.append(f"node shares {share} vs {total} x {opt.nodes.count} node(s)")
            want["parameter_partitions"] = used["parameter_partitions"]
            want["communication_buffers"] -= sum(  # stage 3 reads the copy: no gathering
                b for n, b in plain.memory_buffers().items() if n.startswith("param_bucket."))
        # over several nodes, the node sums that cross them have buffers of their own
        want["communication_buffers"] += sum(
            b for n, b in opt.memory_buffers().items() if n.startswith("grad_node.")
        )
        if Kind.PARAM_BUCKET in opt.engine.plan.node_memory:  # stage 3, several nodes: the
            # gathered layers are one copy per node, whose shares add up to it
            mine = {n: b for n, b in opt.memory_buffers().items() if n.startswith("param_b")}
            full = {n: b for n, b in plain.memory_buffers().items() if n.startswith("param_b")}
            node = opt.nodes.node.mpi
            for name, nbytes in full.items():
                if node.allreduce(mine[name]) != nbytes:
                    problems.append(f"{name}: the node's shares do not add up to {nbytes}")
            want["communication_buffers"] += sum(mine.values()) - sum(full.values())
        if used != want:
            problems.append(f"usage {used} vs {want}")
        hand_over(opt, ("a",), rank_grads(TINY, 0, comm.rank))
        opt.step()
        before = opt.full_params()
    if not opt.engine.closed or opt.engine.pool.segments:
        problems.append("not closed on exit")
    after = opt.full_params()  # the parameters moved out of the window, still readable
    for name in before:
        if not np.array_equal(before[name], after[name]):
            problems.append(f"{name}: full_params() changed by close()")
        if stage == 2 and not np.array_equal(opt.params[name], after[name]):
            problems.append(f"{name}: opt.params after close() is not the parameters")
    if opt.memory_usage()["parameter_partitions"] != used["parameter_partitions"]:
        problems.append("parameters no longer accounted after close()")
    _, wrong = raises(RuntimeError, "closed", lambda: enter(opt.gradients("a")), "after close")
    problems += wrong
    opt.close()  # twice is harmless
    plain.close()
    low = ZeroOptimizer(params, comm=comm, stage=0, shared_memory=True)
    if low.shared_memory != low.nodes.uniform:  # stage 0: its gradients, on every node
        problems.append(f"stage 0 on {low.nodes.count} node(s): shared {low.shared_memory}")
    low.close()
    verdict(problems, f"stage {stage}")


def test_stage_3_without_gather_buffers_gathers_into_the_caller_s_memory(
    comm: MPI.Intracomm,
) -> None:
    """``gather_buffers=False`` (what the torch adapter asks for): no buffers for
    ``gathered()`` are allocated (its ``param_bucket`` memory is gone from
    ``memory_usage()``, nothing else changes), ``gathered()`` refuses on every rank,
    and ``gather_into`` fills memory of the caller's with each bucket's parameters,
    every group and dtype, empty shards included."""
    params = make_params(TINY, seed=5)
    opt = ZeroOptimizer(params, comm=comm, stage=3, shared_memory=False, gather_buffers=False)
    plain = ZeroOptimizer(params, comm=comm, stage=3, shared_memory=False)
    problems = []
    gathers = sum(b for n, b in plain.memory_buffers().items() if n.startswith("param_bucket."))
    want = dict(plain.memory_usage())
    want["communication_buffers"] -= gathers
    if gathers == 0 or opt.memory_usage() != want:
        problems.append(f"usage {opt.memory_usage()} vs {want} ({gathers} gather bytes)")
    full = plain.full_params()
    for index, bucket in enumerate(opt.layout.buckets):
        out = np.full(bucket.size, np.nan, dtype=bucket.dtype)
        opt.gather_into(index, out)
        want_flat = np.concatenate([full[n].ravel() for n in bucket.names])
        if not np.array_equal(out, want_flat):
            problems.append(f"bucket {index} {bucket.names}: gather_into gave {out}")
    _, wrong = raises(RuntimeError, "gather_buffers=False",
                      lambda: opt.gathered("a").__enter__(), "gathered")  # fmt: skip
    problems += wrong
    opt.close()
    plain.close()
    verdict(problems)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_zeroing_after_the_update_is_timed(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """What ``step()`` does after the update, leaving the gradient buffers zero for the
    next step (stage 0's whole buffer, stage 1's own shard), is in the step's timed
    phases (``reduce_scatter``), so that the benchmark's ``step_ms`` holds it: a
    50 ms stand-in for it shows there."""
    import time

    params = {"w": np.arange(12, dtype=np.float32)}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, lr=0.1)
    real = opt.engine.reducer.consumed
    monkeypatch.setattr(opt.engine.reducer, "consumed", lambda: (time.sleep(0.05), real()))
    with opt.gathered("w"):
        opt.add_gradients({"w": np.ones(12, np.float32)})
    opt.pop_timings()
    opt.step()
    timed = opt.pop_timings()["reduce_scatter"]
    opt.close()
    assert_all(timed >= 0.05, f"reduce_scatter {timed:.4f} s: the 0.05 s after the update missing")
