"""Mixed precision (``param_dtype``, ``reduce_dtype``, loss scaling) against the
unsharded reference.

The reference applies the same roundings: gradients are small multiples of 1/8,
exactly representable in bfloat16 and float16 and summed exactly in float32, so the
master copy (``full_params()``, in the arrays' own dtype) equals the reference's
float32 Adam (bit for bit on one rank, 1e-6 relative on more, as in
``test_reference``) and the model's copy (``opt.params`` / ``opt.gathered``) is the
master rounded to nearest even, bit for bit, at every world size and stage, over
MPI and shared memory. The kernel tests check every compiled variant's rounding
against numpy's float16 and ml_dtypes' bfloat16 casts.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from helpers import WORLD, assert_all, raises
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.adam import VARIANTS, AdamConfig, adam_step, round_low
from zerompi.precision import LossScale, bfloat16
from zerompi.reference import ReferenceAdam

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16, F16, F32 = bfloat16(), np.dtype(np.float16), np.dtype(np.float32)
KERNELS = [("numpy", None)] + [("c", v) for v in VARIANTS]

# -- 1. rounding: bit-identical to numpy's and ml_dtypes' casts ------------------------------


def samples(dtype: np.dtype, n: int = 200_000) -> np.ndarray:
    """Random bit patterns (every class of value), normal values of every magnitude,
    and the edge cases of both 16-bit formats."""
    rng = np.random.default_rng(7)
    width = np.uint32 if dtype == np.float32 else np.uint64
    bits = rng.integers(0, np.iinfo(width).max, n, dtype=width, endpoint=True).view(dtype)
    scaled = rng.standard_normal(n) * 10.0 ** rng.integers(-12, 8, n)
    edges = [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        65504,
        65519.99,
        65520,
        65536,
        6.1e-5,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        1e-10,
        3.4e38,
        -1.5,
        1.00390625,
        1.01171875,
        1 + 2**-9 + 2**-30,
    ]
    with np.errstate(all="ignore"):
        return np.concatenate([bits, scaled.astype(dtype), np.array(edges, dtype)])


@pytest.mark.parametrize(("kernel", "variant"), KERNELS)
@pytest.mark.parametrize("master", [np.float32, np.float64])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_rounding_matches_numpy_casts(
    kernel: str, variant: str | None, master: type, low: str
) -> None:
    """Round to nearest even, every value but NaN's payload (a NaN stays a NaN)."""
    low_dt = BF16 if low == "bfloat16" else F16
    src = samples(np.dtype(master))
    got = np.zeros(src.size, low_dt)
    round_low(src, got, kernel=kernel, variant=variant)
    with np.errstate(all="ignore"):
        want = src.astype(low_dt)
    nan = np.isnan(src)
    same = got.view(np.uint16) == want.view(np.uint16)
    assert same[~nan].all(), src[~nan & ~same][:5]
    assert np.isnan(got[nan].astype(np.float32)).all()


@pytest.mark.parametrize(("kernel", "variant"), KERNELS)
@pytest.mark.parametrize("master", [np.float32, np.float64])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_adam_writes_the_rounded_copy_in_its_pass(
    kernel: str, variant: str | None, master: type, low: str
) -> None:
    """``adam_step(..., low=)`` updates like without it and writes exactly the rounded
    parameters; every kernel gives the same bits."""
    low_dt = BF16 if low == "bfloat16" else F16
    rng = np.random.default_rng(3)
    n = 10_007
    p0, g0 = (rng.standard_normal(n).astype(master) for _ in range(2))
    config = AdamConfig(lr=1e-2, weight_decay=0.1, decoupled=True)
    runs = {}
    for with_low in (False, True):
        p, g, m, v = p0.copy(), g0.copy(), np.zeros(n, master), np.zeros(n, master)
        out = np.zeros(n, low_dt) if with_low else None
        adam_step(p, g, m, v, 1, config, np.zeros(4096, master), 2.0, kernel=kernel,
                  variant=variant, low=out)  # fmt: skip
        runs[with_low] = (p, m, v, out)
    for a, b in zip(runs[False][:3], runs[True][:3], strict=True):
        assert np.array_equal(a, b)
    p, out = runs[True][0], runs[True][3]
    assert out is not None and np.array_equal(out.view(np.uint16), p.astype(low_dt).view(np.uint16))


@pytest.mark.parametrize(("kernel", "variant"), KERNELS)
@pytest.mark.parametrize("out_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("add", [False, True])
def test_accumulate_matches_numpys_mixed_add(
    kernel: str, variant: str | None, out_dtype: type, low: str, add: bool
) -> None:
    """The 16-bit reduction's inner loop: every 16-bit pattern (subnormals, inf,
    NaN) upcast exactly and added in the wide dtype, as numpy does it."""
    from zerompi.adam import accumulate

    low_dt = BF16 if low == "bfloat16" else F16
    rng = np.random.default_rng(11)
    bits = np.concatenate([np.arange(1 << 16), rng.integers(0, 1 << 16, 1 << 15)]).astype(np.uint16)
    part = bits.view(low_dt)
    base = rng.standard_normal(bits.size).astype(out_dtype)
    with np.errstate(all="ignore"):
        want = base.copy()
        if add:
            np.add(want, part, out=want)
        else:
            np.copyto(want, part)
        got = base.copy()
        accumulate(got, part, add, kernel=kernel, variant=variant)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), bits[~same][:5]


# -- 2. the optimizer against the reference ----------------------------------------------------

SHAPES = {"a.w": (5, 3), "a.b": (3,), "b.w": (4,), "c.w": (7,), "d.w": (1,)}
GROUPS = ["d", "c", "b", "a"]  # backward order
HYPER = {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}

#: (stage, api, shared memory): api "blocks" hands gradients over with opt.gradients
#: inside opt.gathered, "grads" adds into opt.grads (stages 0-2).
SETUPS = [(0, "grads", False), (0, "blocks", False), (1, "grads", False), (1, "blocks", False),
          (2, "blocks", False), (2, "blocks", True), (2, "grads", False), (2, "grads", True),
          (3, "blocks", False), (3, "blocks", True)]  # fmt: skip
PRECISIONS = [("bfloat16", None), (None, "bfloat16"), ("bfloat16", "bfloat16"),
              ("float16", "float16"), ("bfloat16", "float16")]  # fmt: skip
CASES = list(itertools.product(SETUPS, PRECISIONS))


def params_of(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def grad_of(name: str, rank: int, micro: int, step: int) -> np.ndarray:
    """Small multiples of 1/8: exact in bfloat16/float16, their sums exact."""
    shape = SHAPES[name]
    base = np.arange(int(np.prod(shape))).reshape(shape) + 3 * rank + micro + 2 * step
    return ((base % 7 - 3) / 8).astype(np.float32)


def hand_over(opt: ZeroOptimizer, api: str, rank: int, micro: int, step: int, scale: float) -> None:
    if api == "grads":
        for name in SHAPES:
            opt.grads[name][...] += grad_of(name, rank, micro, step) * scale
        return
    for group in GROUPS:
        with opt.gathered(group), opt.gradients(group) as g:
            for name in g:
                g[name][...] += grad_of(name, rank, micro, step) * scale


def mean_grads(
    size: int, micros: int, step: int, dtype: type = np.float32
) -> dict[str, np.ndarray]:
    return {
        name: (
            sum(
                grad_of(name, r, m, step).astype(np.float64)
                for r in range(size)
                for m in range(micros)
            )
            / (size * micros)
        ).astype(dtype)
        for name in SHAPES
    }


def model_copy(opt: ZeroOptimizer) -> dict[str, np.ndarray]:
    """The parameters as the model sees them (collective in stage 3)."""
    out = {}
    for group in reversed(GROUPS):
        with opt.gathered(group) as p:
            out.update({n: a.copy() for n, a in p.items()})
    return out


def check(opt: ZeroOptimizer, ref: ReferenceAdam, low: np.dtype, what: str) -> list[str]:
    problems = []
    master, seen = opt.full_params(), model_copy(opt)
    exact = opt.comm.size == 1
    for name, want in ref.params.items():
        got = master[name]
        if got.dtype != want.dtype:
            problems.append(f"{what}: master {name} is {got.dtype}")
            continue
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if (exact and not np.array_equal(got, want)) or err > 1e-6:
            problems.append(f"{what}: master {name} differs from the reference by {err:.2e}")
        rounded = got.astype(low)
        if seen[name].dtype != low or not np.array_equal(
            seen[name].view(np.uint16 if low.itemsize == 2 else low),
            rounded.view(np.uint16 if low.itemsize == 2 else low),
        ):
            problems.append(
                f"{what}: the model's copy of {name} is not the master rounded to {low}"
            )
    return problems


@pytest.mark.parametrize(
    ("setup", "precision"),
    CASES,
    ids=[f"stage{s}-{a}-{'shm' if m else 'mpi'}-{p}-{r}" for (s, a, m), (p, r) in CASES],
)
def test_matches_the_reference_with_roundings(
    comm: MPI.Intracomm, setup: tuple[int, str, bool], precision: tuple[str | None, str | None]
) -> None:
    """Three steps (the second with two micro-batches) in small buckets, so that on 2-4
    ranks some own nothing of most buckets."""
    assert_all(*reference_case(comm, *setup, *precision))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float64_masters_and_one_staging_bucket(comm: MPI.Intracomm, stage: int) -> None:
    """float64 arrays (a float64 master, rounded straight to 16 bits) and
    ``overlap=False`` (one staging bucket, one receive region)."""
    problems = []
    for precision in (("bfloat16", "float16"), ("float16", "bfloat16"), ("float32", None)):
        ok, text = reference_case(comm, stage, "blocks", stage >= 2, *precision,
                                  master=np.dtype(np.float64), overlap=False)  # fmt: skip
        problems += [] if ok else [f"{precision}: {text}"]
    assert_all(not problems, "; ".join(problems))


def reference_case(
    comm: MPI.Intracomm, stage: int, api: str, shm: bool, param_dtype: str | None,
    reduce_dtype: str | None, master: np.dtype = F32, overlap: bool = True,
) -> tuple[bool, str]:  # fmt: skip
    """Local: train three steps against the reference; (no problem, what they are)."""
    params = {n: a.astype(master) for n, a in params_of().items()}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=4, shared_memory=shm,
                        param_dtype=param_dtype, reduce_dtype=reduce_dtype, loss_scale=1.0,
                        overlap=overlap, **HYPER)  # fmt: skip
    ref = ReferenceAdam(params, **HYPER)
    names = {"bfloat16": BF16, "float16": F16, "float32": F32}
    low = names[param_dtype] if param_dtype else master
    problems = check(opt, ref, low, "initial")
    for step, micros in enumerate((1, 2, 1)):
        for micro in range(micros):
            hand_over(opt, api, comm.rank, micro, step, 1.0)
            if micros > 1:
                opt.accumulate()
        opt.step()
        ref.step(mean_grads(comm.size, micros, step, master))
        problems += check(opt, ref, low, f"step {step}")
    return not problems, "; ".join(problems[:4])


# -- 3. loss scaling ------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dynamic_loss_scale_unscales_backs_off_and_grows(comm: MPI.Intracomm, stage: int) -> None:
    """float16 gradients: the model multiplies by ``opt.loss_scale`` and ``step()``
    divides it out (the result equals the unscaled reference); an overflow on one rank
    skips the step on every rank, state untouched, and halves the scale; after
    ``growth_interval`` good steps it doubles; the history records each change."""
    params = params_of(1)
    scaler = LossScale(init=2.0**10, growth_interval=2)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=4, reduce_dtype="float16",
                        loss_scale=scaler, **HYPER)  # fmt: skip
    ref = ReferenceAdam(params, **HYPER)
    api = "blocks"
    problems = []
    hand_over(opt, api, comm.rank, 0, 0, opt.loss_scale)
    opt.step()
    ref.step(mean_grads(comm.size, 1, 0))
    problems += check(opt, ref, F32, "scaled step")
    before = opt.full_params()
    # an overflow on the last rank only: float16 gradients beyond 65504
    big = np.float16(6e4) if comm.rank == comm.size - 1 else np.float16(0)
    for group in GROUPS:
        with opt.gathered(group), opt.gradients(group) as g, np.errstate(over="ignore"):
            for name in g:
                g[name][...] += big
                g[name][...] += big  # 1.2e5: inf in float16
    opt.step()
    after = opt.full_params()
    if opt.skipped_steps != 1 or opt.step_count != 1:
        problems.append(f"overflow: skipped {opt.skipped_steps}, step_count {opt.step_count}")
    if any(not np.array_equal(before[n], after[n]) for n in before):
        problems.append("overflow: the parameters changed")
    if opt.loss_scale != 2.0**9:
        problems.append(f"overflow: scale {opt.loss_scale}, expected {2.0**9}")
    for step in (1, 2):
        hand_over(opt, api, comm.rank, 0, step, opt.loss_scale)
        opt.step()
        ref.step(mean_grads(comm.size, 1, step))
    problems += check(opt, ref, F32, "after the overflow")
    if opt.loss_scale != 2.0**10:
        problems.append(f"growth: scale {opt.loss_scale} after 2 good steps, expected {2.0**10}")
    # (the step a change follows: the skipped one is attempted again as step 2)
    if scaler.history != [(2, 2.0**10, 2.0**9), (3, 2.0**9, 2.0**10)]:
        problems.append(f"history {scaler.history}")
    assert_all(not problems, "; ".join(problems[:4]))


def test_loss_scale_defaults() -> None:
    """Dynamic from 2**16 for float16 gradients (torch's GradScaler), none otherwise;
    a number is a static scale."""
    params = params_of()
    assert ZeroOptimizer(params, reduce_dtype="float16").loss_scale == 2.0**16
    assert ZeroOptimizer(params, reduce_dtype="bfloat16").engine.scaler is None
    assert ZeroOptimizer(params, param_dtype="float16").engine.scaler is None
    static = ZeroOptimizer(params, loss_scale=128)
    assert static.loss_scale == 128.0 and not static.engine.scaler.dynamic  # type: ignore[union-attr]
    s = LossScale()
    assert (s.scale, s.growth, s.backoff, s.growth_interval) == (2.0**16, 2.0, 0.5, 2000)


# -- 4. what moves, what is refused ------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sixteen_bit_wires_move_half_the_bytes(comm: MPI.Intracomm, stage: int) -> None:
    """The gather's and the reduction's bytes per element halve, exactly as counted."""
    traffic = {}
    for precision in ((None, None), ("bfloat16", "bfloat16")):
        opt = ZeroOptimizer(
            params_of(), comm=comm, stage=stage, bucket_elems=4,
            param_dtype=precision[0], reduce_dtype=precision[1], **HYPER,
        )  # fmt: skip
        opt.comm.pop_traffic()
        hand_over(opt, "blocks", comm.rank, 0, 0, 1.0)
        opt.step()
        traffic[precision] = opt.comm.pop_traffic()
    full, half = traffic[(None, None)], traffic[("bfloat16", "bfloat16")]
    problems = [
        f"{op} {way}: {half.get(op, {}).get(way)} bytes in bfloat16, {full[op][way]} in float32"
        for op in ("reduce_scatter", "allgather") if op in full
        for way in ("sent", "received")
        if 2 * half.get(op, {}).get(way, -1) != full[op][way]
    ]  # fmt: skip
    assert_all(not problems, "; ".join(problems))


BAD: list[tuple[str, Mapping[str, object], type[Exception], str]] = [
    ("integer param_dtype", {"param_dtype": "int8"}, ValueError, "must be a floating dtype"),
    ("unknown dtype", {"reduce_dtype": "bogus"}, TypeError, "reduce_dtype must be one of"),
    ("wider than the master", {"param_dtype": "float64"}, ValueError, "float64 is wider"),
    ("loss scale word", {"loss_scale": "sometimes"}, ValueError, "loss_scale must be 'dynamic'"),
    ("loss scale zero", {"loss_scale": 0.0}, ValueError, "loss_scale must be finite and > 0"),
    ("raise with dynamic", {"reduce_dtype": "float16", "nonfinite": "raise"}, ValueError,
     "nonfinite='raise' with dynamic loss scaling"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "kwargs", "exc", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_precision_settings_raise_on_every_rank(
    comm: MPI.Intracomm, what: str, kwargs: Mapping[str, object], exc: type[Exception], match: str
) -> None:
    _, problems = raises(exc, match, lambda: ZeroOptimizer(params_of(), comm=comm, **kwargs), what)
    assert_all(not problems, "; ".join(problems))


def test_model_copy_is_read_only() -> None:
    """Writing the rounded copy would not reach the master: refused, with the way out."""
    opt = ZeroOptimizer(params_of(), stage=1, param_dtype="bfloat16")
    with pytest.raises(ValueError, match="rounded copy"):
        opt.params["a.b"] = np.zeros(3, BF16)
    with pytest.raises(ValueError, match="read-only"):
        opt.params["a.b"][...] = 0


# -- 5. checkpoints: the master precision, loadable under any setting ----------------------------


def test_checkpoints_hold_the_master_and_load_under_any_precision(mpi_tmp_path: Path) -> None:
    """Saved by the world at stage 2 in bfloat16/bfloat16 with a dynamic float16-style
    loss scale: the file holds the float32 master and says how it was saved; every
    sub-communicator, at every stage and under every precision setting, loads the
    same master and state, and its model copy is that master rounded; a dynamic loss
    scale comes back."""
    from test_checkpoint import differences, shared_path, snapshot

    from zerompi import checkpoint

    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    subs = {
        "world": WORLD,
        "self": MPI.COMM_SELF,
        "split": WORLD.Split(int(rank == size - 1) if size > 1 else 0, rank),
    }
    problems: list[str] = []
    try:
        path = shared_path(mpi_tmp_path, WORLD, "mixed")
        scaler = LossScale(init=2.0**8, growth_interval=1)
        opt = ZeroOptimizer(params_of(), comm=WORLD, stage=2, bucket_elems=4,
                            param_dtype="bfloat16", reduce_dtype="float16",
                            loss_scale=scaler, **HYPER)  # fmt: skip
        for step in range(2):
            hand_over(opt, "blocks", rank, 0, step, opt.loss_scale)
            opt.step()
        scale = opt.loss_scale  # grown twice
        opt.save(path)
        want = snapshot(opt)
        saved = checkpoint.read_header(path)["optimizer"]
        if (saved["param_dtype"], saved["reduce_dtype"], saved["loss_scale"]) != (
            "bfloat16",
            "float16",
            scale,
        ):
            problems.append(f"header: {saved}")
        problems += differences(checkpoint.read(path), want, "checkpoint.read")
        from zerompi.checkpoint.__main__ import summary

        shown = summary(checkpoint.read_header(path), path)
        if "param_dtype=bfloat16" not in shown or "reduce_dtype=float16" not in shown:
            problems.append(f"inspect does not show the precision: {shown}")
        for name, sub in subs.items():
            for stage in (0, 1, 2, 3):
                for p_dt, r_dt in ((None, None), ("float16", "bfloat16"), ("bfloat16", "float16")):
                    other = ZeroOptimizer(params_of(5), comm=sub, stage=stage, bucket_elems=3,
                                          param_dtype=p_dt, reduce_dtype=r_dt, **HYPER)  # fmt: skip
                    other.load(path)
                    what = f"{name} stage {stage} {p_dt}/{r_dt}"
                    problems += differences(snapshot(other), want, what)
                    low = F16 if p_dt == "float16" else BF16 if p_dt else F32
                    problems += check_copy(other, low, what)
                    if r_dt == "float16" and other.loss_scale != scale:
                        problems.append(f"{what}: loss scale {other.loss_scale}, saved {scale}")
    finally:
        subs["split"].Free()
    assert_all(not problems, "; ".join(problems[:4]))


def check_copy(opt: ZeroOptimizer, low: np.dtype, what: str) -> list[str]:
    """The model's copy is the master rounded to ``low``."""
    master, seen = opt.full_params(), model_copy(opt)
    view = np.uint16 if low.itemsize == 2 else low
    return [
        f"{what}: the model's copy of {n} is not the master rounded"
        for n in master
        if seen[n].dtype != low
        or not np.array_equal(seen[n].view(view), master[n].astype(low).view(view))
    ]


# -- 6. memory: the estimator, the optimizer's accounting and the formula --------------------


@pytest.mark.parametrize(
    "precision", [("bfloat16", "bfloat16"), ("float16", None), (None, "bfloat16")]
)
def test_estimate_equals_the_optimizer_per_precision(
    comm: MPI.Intracomm, precision: tuple[str | None, str | None]
) -> None:
    """``python -m zerompi.memory --param-dtype/--reduce-dtype/--shared-memory`` gives
    the optimizer's ``memory_usage()`` and buffers to the byte, stage 2's lazily
    allocated full gradients included, with float32 and float64 masters."""
    from zerompi.memory import estimate

    specs = [("a.w", (5, 3), F32), ("a.b", (3,), F32), ("h.w", (6,), np.dtype(np.float64)),
             ("b.w", (4,), F32)]  # fmt: skip
    params = {n: np.zeros(s, d) for n, s, d in specs}
    size, rank = comm.Get_size(), comm.Get_rank()
    p_dt, r_dt = precision
    problems = []
    for stage, shm in itertools.product((0, 1, 2, 3), (False, True)):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=4, shared_memory=shm,
                            param_dtype=p_dt, reduce_dtype=r_dt)  # fmt: skip
        options = {"param_dtype": p_dt, "reduce_dtype": r_dt, "shared_memory": opt.shared_memory,
                   "ranks_per_node": max(map(len, opt.nodes.members))}  # fmt: skip
        est = estimate(specs, size, rank, stage, 4, **options)
        if list(est["buffers"].items()) != list(opt.memory_buffers().items()):
            problems.append(f"stage {stage} shm {shm}: {est['buffers']} != {opt.memory_buffers()}")
        if stage == 2:
            opt.grads  # noqa: B018
            full = estimate(specs, size, rank, stage, 4, full_grads=True, **options)
            if full["usage"] != opt.memory_usage():
                problems.append(f"full grads, shm {shm}: {full['usage']} != {opt.memory_usage()}")
    assert_all(not problems, "\n".join(problems[:6]))


def test_formula_per_precision() -> None:
    """Bytes per parameter, replicated + sharded / W, for a float32 master."""
    from zerompi.memory import bytes_per_param
    from zerompi.precision import Precision

    same, bf = Precision(F32, F32, F32), Precision(F32, BF16, BF16)
    assert [bytes_per_param(s, same) for s in range(4)] == [(16, 0), (8, 8), (4, 12), (0, 16)]
    assert [bytes_per_param(s, bf) for s in range(4)] == [(20, 0), (4, 16), (2, 16), (0, 18)]
    params_only = Precision(F32, BF16, F32)
    assert [bytes_per_param(s, params_only) for s in range(4)] == [
        (18, 0),
        (6, 12),
        (2, 16),
        (0, 18),
    ]


# -- 7. the driver ----------------------------------------------------------------------------

DRIVER_CASES = [
    (1, ("--stage", "3", "--param-dtype", "bfloat16", "--reduce-dtype", "bfloat16",
         "--micro-batches", "2")),
    (1, ("--stage", "0", "--param-dtype", "float16", "--reduce-dtype", "float16")),
    (3, ("--stage", "0", "--reduce-dtype", "bfloat16", "--adamw", "--weight-decay", "0.1")),
    (3, ("--stage", "1", "--param-dtype", "bfloat16", "--micro-batches", "3", "--batch", "30")),
    (3, ("--stage", "2", "--param-dtype", "bfloat16", "--reduce-dtype", "float16",
         "--shared-memory")),
    (4, ("--stage", "3", "--param-dtype", "float16", "--reduce-dtype", "bfloat16",
         "--batch", "3")),
]  # fmt: skip


@pytest.mark.mpi_skip
@pytest.mark.same_launch  # the driver's launch: tests/test_driver.py
@pytest.mark.parametrize(
    ("ranks", "args"), DRIVER_CASES, ids=[" ".join(a[1::2]) + f" W={r}" for r, a in DRIVER_CASES]
)
def test_driver_matches_the_reference_with_roundings(
    ranks: int, args: tuple[str, ...], tmp_path: Path
) -> None:
    """``--verify`` against the reference that rounds as the run does: bit for bit
    on one rank; the textbook bytes in the run's dtypes."""
    from test_driver import run_driver

    result, text = run_driver(ranks, tmp_path, "--verify", "--steps", "20", *args)
    assert result["verify_ok"], text
    if ranks == 1:
        assert result["max_abs_diff"] == 0.0, text
    assert result["param_dtype"] == (
        args[args.index("--param-dtype") + 1] if "--param-dtype" in args else "float32"
    )
    if result["micro_batches"] == 1:
        total = sum(result["comm_bytes"].values())
        slack = result["buckets"] if result["stage"] == 0 else 0
        assert abs(total - result["comm_bytes_theory"]) <= slack, (result["comm_bytes"], text)
    if result["batch"] >= 30:
        assert result["loss_last"] < result["loss_first"]


@pytest.mark.mpi_skip
@pytest.mark.same_launch
def test_bfloat16_training_ends_within_2_percent_of_float32(tmp_path: Path) -> None:
    """200 steps of the default model at W=2, stage 2: bfloat16 parameters and
    gradients end within 2 % of the float32 run's loss."""
    from test_driver import run_driver

    f32, _ = run_driver(2, tmp_path, "--steps", "200")
    bf16, text = run_driver(2, tmp_path, "--steps", "200", "--param-dtype", "bfloat16",
                            "--reduce-dtype", "bfloat16")  # fmt: skip
    assert abs(bf16["loss_last"] - f32["loss_last"]) <= 0.02 * f32["loss_last"], text
    assert bf16["comm_bytes_theory"] == f32["comm_bytes_theory"] / 2


@pytest.mark.mpi_skip
def test_float16_overflow_lowers_the_scale_and_training_goes_on(tmp_path: Path) -> None:
    """A loss scale far too high: the first steps overflow, are skipped on every rank
    and halve the scale until the gradients fit; the reference, which follows the
    same scale, agrees bit for bit."""
    from test_driver import run_driver

    result, text = run_driver(2, tmp_path, "--steps", "60", "--verify", "--param-dtype",
                              "float16", "--reduce-dtype", "float16", "--loss-scale",
                              "dynamic:1e12")  # fmt: skip
    scales = result["loss_scales"]
    skipped = result["skipped_steps"]
    assert 0 < skipped < 60, text
    assert scales[: skipped + 1] == [1e12 / 2**k for k in range(skipped + 1)], scales
    assert all(s == scales[skipped] for s in scales[skipped:]), scales
    assert result["verify_ok"] and result["max_abs_diff"] == 0.0, text
    assert result["loss_last"] < result["loss_first"]


# -- 8. stochastic rounding -----------------------------------------------------------------


@pytest.mark.parametrize(("kernel", "variant"), KERNELS)
@pytest.mark.parametrize("master", [np.float32, np.float64])
def test_stochastic_rounding_kernels_agree_and_are_unbiased(
    kernel: str, variant: str | None, master: type
) -> None:
    """Every kernel writes exactly :func:`stochastic_round`'s bits; a value a quarter
    ulp above a bfloat16 rounds up a quarter of the time over many keys."""
    from zerompi.adam import sr_key, stochastic_round

    rng = np.random.default_rng(5)
    n = 5003
    p0, g0 = (rng.standard_normal(n).astype(master) for _ in range(2))
    p, g, m, v = p0.copy(), g0.copy(), np.zeros(n, master), np.zeros(n, master)
    low = np.zeros(n, BF16)
    adam_step(p, g, m, v, 1, AdamConfig(lr=1e-2), np.zeros(4096, master), 1.0, kernel=kernel,
              variant=variant, low=low, stochastic=(sr_key(7), 123))  # fmt: skip
    want = np.zeros(n, BF16)
    stochastic_round(p, want, sr_key(7), 123)
    assert np.array_equal(low.view(np.uint16), want.view(np.uint16))
    x = np.full(4096, 1.0 + 2.0**-9, master)  # bfloat16's ulp at 1 is 2**-7
    ups = 0
    for k in range(64):
        out = np.zeros(x.size, BF16)
        stochastic_round(x, out, sr_key(k), 0)
        ups += int(np.count_nonzero(out.astype(np.float64) > 1.0))
    assert abs(ups / (64 * x.size) - 0.25) < 0.01


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stochastic_rounding_in_the_optimizer(comm: MPI.Intracomm, stage: int) -> None:
    """``rounding="stochastic"``: the master still equals the reference; the model's
    copy is the master rounded down or up to bfloat16 (never further), the same on
    every rank and in a second run; on one rank in stage 1, exactly
    ``stochastic_round`` of the master at the flat index."""
    from zerompi.adam import sr_key, stochastic_round

    params = params_of(3)
    runs = []
    for _ in range(2):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=4,
                            param_dtype="bfloat16", rounding="stochastic", **HYPER)  # fmt: skip
        ref = ReferenceAdam(params, **HYPER)
        for step in range(3):
            hand_over(opt, "blocks", comm.rank, 0, step, 1.0)
            opt.step()
            ref.step(mean_grads(comm.size, 1, step))
        runs.append((opt, ref, model_copy(opt), opt.full_params()))
    opt, ref, seen, master = runs[0]
    problems = check_close(master, ref.params, comm.size == 1)
    for name, m in master.items():
        truncated = m.astype(np.float32).view(np.uint32) >> np.uint32(16)  # toward zero
        got = seen[name].view(np.uint16).astype(np.uint32)
        if not ((got == truncated) | (got == truncated + 1)).all():
            problems.append(f"{name}: not the master rounded down or up to bfloat16")
        if not np.array_equal(seen[name].view(np.uint16), runs[1][2][name].view(np.uint16)):
            problems.append(f"{name}: a second run rounds differently")
    everyone = (
        WORLD.allgather({n: a.view(np.uint16).tobytes() for n, a in seen.items()})
        if comm is WORLD
        else [None]
    )
    if comm is WORLD and any(e != everyone[0] for e in everyone):
        problems.append("ranks see different model copies")
    if comm.size == 1 and stage == 1:
        flat = np.concatenate([master[n].ravel() for n in params])
        want = np.zeros(flat.size, BF16)
        stochastic_round(flat, want, sr_key(3), 0)
        got = np.concatenate([seen[n].ravel() for n in params])
        if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
            problems.append(
                "stage 1 on one rank: not stochastic_round(master, step 3 key, flat index)"
            )
    assert_all(not problems, "; ".join(problems[:4]))


def check_close(
    master: dict[str, np.ndarray], ref: dict[str, np.ndarray], exact: bool
) -> list[str]:
    out = []
    for name, want in ref.items():
        got = master[name]
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if (exact and not np.array_equal(got, want)) or err > 1e-6:
            out.append(f"master {name} differs from the reference by {err:.2e}")
    return out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"param_dtype": "float16", "rounding": "stochastic"},
            "rounding='stochastic' rounds a bfloat16",
        ),
        ({"rounding": "stochastic"}, "pass param_dtype='bfloat16'"),
        ({"param_dtype": "bfloat16", "rounding": "up"}, "rounding must be one of"),
    ],
)
def test_stochastic_rounding_refusals(comm: MPI.Intracomm, kwargs: dict, match: str) -> None:
    _, problems = raises(
        ValueError, match, lambda: ZeroOptimizer(params_of(), comm=comm, **kwargs), "rounding"
    )
    assert_all(not problems, "; ".join(problems))
