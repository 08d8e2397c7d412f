"""What the tests share: collective assertions (every rank reaches the same verdict,
so none is left waiting), and the deterministic data and drivers that check an
optimizer against the unsharded reference (below)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.reference import ReferenceAdam

WORLD = MPI.COMM_WORLD

#: A prefix for a job command that must not outlive the test process: the command is
#: exec'd with Linux's parent-death signal set (SIGKILL when the test process ends).
#: pytest-timeout's thread method ends a test that runs over its limit with
#: ``os._exit``, where no ``except``/``finally`` kills a job still running: without
#: this, an ``mpiexec`` and its ranks were left spinning (a README quick-start job,
#: started on a loaded machine, still ran minutes after its test process was gone,
#: and slowed every job after it). Elsewhere than Linux: no prefix.
DIES_WITH_TEST = (
    [sys.executable, "-c", "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); "
     "os.execvp(sys.argv[1], sys.argv[1:])"]
    if sys.platform.startswith("linux") else []
)  # fmt: skip


class CollectiveAssertionError(AssertionError):
    """Raised on every rank of COMM_WORLD when an assertion failed on any rank."""


def assert_all(ok: bool, message: str = "") -> None:
    """Collective over COMM_WORLD: fail on every rank if ``ok`` is false on any rank,
    with the messages of the ranks that failed."""
    verdicts = WORLD.allgather(None if ok else (message or "assertion failed"))
    failed = [(r, m) for r, m in enumerate(verdicts) if m is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failed)
        raise CollectiveAssertionError(f"failed on {len(failed)} of {WORLD.size} rank(s):\n{lines}")


def assert_raises_all(
    exc_type: type[BaseException], match: str, fn: Callable[[], Any]
) -> BaseException | None:
    """Collective: ``fn()`` must raise ``exc_type`` whose message contains ``match`` on
    every rank. Never lets an exception escape on one rank only."""
    try:
        fn()
    except exc_type as exc:
        ok = match in str(exc)
        assert_all(ok, f"{exc_type.__name__} raised, but {match!r} not in: {exc}")
        return exc
    except Exception as exc:  # the wrong error, on this rank
        assert_all(False, f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
    else:
        assert_all(False, f"expected {exc_type.__name__}, nothing was raised")
    return None


def rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| (0 for equal arrays)."""
    if expected.dtype.kind == "u":  # codes (8-bit states): no wrapping differences
        actual, expected = actual.astype(np.int64), expected.astype(np.int64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale else diff


def assert_close_all(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str) -> None:
    """Collective: the relative error of ``actual`` is at most ``rtol`` on every rank."""
    ok = actual.shape == expected.shape and actual.dtype == expected.dtype
    err = rel_error(actual, expected) if ok else float("inf")
    assert_all(
        ok and err <= rtol,
        f"{what}: relative error {err:.3e} > {rtol:.1e} (shape {actual.shape} vs "
        f"{expected.shape}, dtype {actual.dtype} vs {expected.dtype})",
    )


# -- driving an optimizer against the reference ----------------------------------------
#
# ZeroOptimizer: plain data parallelism (stage 0) and ZeRO stages 1-3 against the
# unsharded reference.
#
# Every collective test takes the ``comm`` fixture, so one ``mpiexec -n 4`` runs it on
# communicators of sizes 1 to 4, some uneven. Rank ``r``'s gradient at step ``s`` is a
# deterministic function of ``(s, r)``; the reference optimizer steps on the mean over
# ranks of the same gradients, which every rank computes on its own. On a communicator
# of one rank the sharded optimizer must reproduce the reference bit for bit; on more,
# within float32 1e-6 / float64 1e-12 relative error (``helpers.rel_error``).
#
# The optimizer is driven in one of five ``MODES``: stages 0-2 adding into
# ``opt.grads`` as a plain backward pass would, and stages 2 and 3 handing gradients
# over group by group in reverse order through ``opt.gathered`` / ``opt.gradients``
# (the streamed API that keeps stage 2-3 gradients at ``1/W``). Stage 3 has no
# ``opt.params``: its parameters are checked as the backward pass gathers them (the
# values after the previous step) and with ``opt.full_params()``.
#
# Gradients are multiples of 1/8 with a sign that depends only on the element, so the
# sum over ranks is exact whatever order MPI adds them in and never cancels to (nearly)
# zero: Adam's update ``m / (sqrt(v) + eps)`` turns a rounding residue of 1e-9 where the
# exact value is 0 into a step of order ``lr``, which no tolerance can absorb. With these
# gradients every stage equals the reference bit for bit at every world size (the sum
# is exact, and the optimizer then computes what the reference computes, operation by
# operation). One test uses generic random gradients instead, within a tolerance.
#
# Verdicts that could differ between ranks are agreed on with the collective helpers;
# each test makes the same number of them on every rank, whatever its sub-communicator,
# and mostly just one at the end (problems are collected first), which keeps the suite
# fast when ``mpiexec -n 4`` oversubscribes the cores. For the same reason the widest
# tables pair each case with one communicator (cycling through all four) instead of
# running every case on every communicator.

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


RTOL = {F32: 1e-6, F64: 1e-12, np.dtype(np.uint8): 0.0}


#: The ``comm`` fixture's communicators (tests/conftest.py), those of "world", "self",
#: "split" and "reversed" that differ in this world: in a world of one all four are
#: that one rank; under mpiexec "split" holds the last rank alone inside a larger
#: world, what "self" would check.
RUN_COMMS = ["world"] if WORLD.Get_size() == 1 else ["world", "split", "reversed"]


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
#: Matrices (one a stack of two) and vectors, float32 and float64 interleaved: what
#: a rule with states per matrix, or one that assembles matrices, is checked on.
MIXED_MATRICES: Spec = {
    "w": ((6, 4), F32),
    "d": ((9, 2), F64),
    "b": ((3,), F32),
    "s": ((), F64),
    "t": ((2, 2, 3), F32),
}

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
    (cycling through those it runs in this world, :data:`RUN_COMMS`, so every row
    runs), and their ids: for ``indirect=["comm"]``."""
    rows = [(RUN_COMMS[i % len(RUN_COMMS)], *row) for i, row in enumerate(table)]
    return rows, [f"{row[0]}-{ids(*row[1:])}" for row in rows]


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
        if sorted(moments) != sorted(ref.states):
            problems.append(f"{what}: states {sorted(moments)}, want {sorted(ref.states)}")
        for key, ref_moments in ref.states.items():
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
    bitwise: bool | None = None,
) -> list[str]:
    """``steps`` steps of the optimizer and the reference on the same gradients,
    handed over with ``api``; params compared after every step (stage 3: as the next
    backward pass gathers them, and after the last step), Adam moments where
    ``check_state(step)`` and after the last step. Bit for bit with exact gradients,
    unless ``bitwise=False`` (then within the dtype's tolerance)."""
    comm = opt.comm
    # exactly representable sums: bit for bit at every world size
    exact = exact_grads if bitwise is None else bitwise
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


def forward(opt: ZeroOptimizer, names: Iterable[str]) -> None:
    """A forward pass's use of the parameters: each group gathered in turn."""
    for group in groups_of(names):
        with opt.gathered(group):
            pass


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


def shared_path(directory: Any, comm: MPI.Intracomm, name: str) -> str:
    """A file name in ``directory`` (pytest-mpi's ``mpi_tmp_path``) that every rank of
    ``comm`` agrees on, unique per communicator of the ``comm`` fixture."""
    root = comm.bcast(WORLD.rank, root=0)
    return str(directory / f"{name}-w{comm.Get_size()}-r{root}.ckpt")


def estimate_problems(
    comm: MPI.Intracomm, layout: list[tuple[str, tuple[int, ...], Any]], optimizer: str,
    buckets: Iterable[int], param_groups: list[dict[str, Any]] | None = None,
) -> list[str]:  # fmt: skip
    """Collective: for every stage and ``buckets``, where ``zerompi.memory.estimate``
    and the optimizer of ``layout`` (zeros; ``param_groups`` given to both) disagree
    on any buffer or category."""
    from zerompi.memory import estimate

    size, rank = comm.Get_size(), comm.Get_rank()
    problems = []
    for stage in range(4):
        for bucket_elems in buckets:
            params = {n: np.zeros(s, d) for n, s, d in layout}
            opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems,
                                optimizer=optimizer, param_groups=param_groups)  # fmt: skip
            est = estimate(layout, size, rank, stage, bucket_elems, optimizer=optimizer,
                           ranks_per_node=max(map(len, opt.nodes.members)),
                           param_groups=param_groups)  # fmt: skip
            if list(est["buffers"].items()) != list(opt.memory_buffers().items()):
                problems.append(f"{optimizer} stage {stage} bucket {bucket_elems}: "
                                f"{est['buffers']} != {opt.memory_buffers()}")  # fmt: skip
            if est["usage"] != opt.memory_usage():
                problems.append(f"{optimizer} stage {stage}: usage differs")
            opt.close()
    return problems


def marked_processes(mark: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose environment holds ``mark``
    (Linux ``/proc``; a zombie's environment reads empty: not counted). What a test
    that stops a launcher looks for afterwards: nothing it started may be left."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:  # (gone meanwhile, or not ours)
            continue
    return found
