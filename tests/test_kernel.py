"""The compiled fused Adam kernel against the numpy kernel: bit for bit.

Both kernels promise the reference's IEEE operations in the reference's order, so
they must agree exactly (bit patterns, NaN and infinity included), for every dtype,
weight-decay mode, divisor and length, 0 and vector tails included -- and so must
every compiled variant of the C loops (AVX-512, AVX2, baseline), not only the one
this CPU picks; a variant the CPU cannot run is skipped, saying so. Local and
deterministic, so the same on every rank: the serial run alone runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from zerompi import adam
from zerompi.adam import AdamConfig, adam_step

#: Local and the same on every rank: under mpiexec each rank would only repeat the
#: serial run's work (a quarter of the suite's tests), so the serial run alone runs it.
pytestmark = pytest.mark.mpi_skip

needs_c = pytest.mark.skipif(
    adam._kernels is None, reason="zerompi._kernels not built (no C compiler at install)"
)

LENGTHS = [0, 1, 7, 16, 17, 63, 64, 96, 1000, (1 << 15) + 5]

#: Every variant the C source can compile, widest first ("auto": the extension's choice).
ALL_VARIANTS = ("avx512f", "avx2", "baseline")


def _variant(name: str) -> str | None:
    """``name`` for the kernel, or a skip naming why this CPU or build cannot run it."""
    if name == "auto":
        return None
    if name not in adam.VARIANTS:
        built = name in adam._kernels.compiled()
        pytest.skip(
            f"kernel variant {name}: "
            + ("this CPU lacks it" if built else "not compiled (compiler or platform)")
            + f"; this CPU runs {', '.join(adam.VARIANTS)}"
        )
    return name


variants = pytest.mark.parametrize("variant", ["auto", *ALL_VARIANTS])


def _arrays(n: int, dtype: type, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(dtype)
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(dtype)
    m = (rng.standard_normal(n) * 0.1).astype(dtype)
    v = np.abs(rng.standard_normal(n) * 0.01).astype(dtype)
    return [p, g, m, v]


def _run(
    kernel: str,
    arrays: list[np.ndarray],
    step: int,
    cfg: AdamConfig,
    div: float,
    variant: str | None = None,
):
    p, g, m, v = (a.copy() for a in arrays)
    scratch = np.empty(64, dtype=p.dtype)  # small: many numpy blocks
    adam_step(p, g, m, v, step, cfg, scratch, div, kernel=kernel, variant=variant)
    return p, m, v


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


@needs_c
@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(
    "wd,decoupled,div,step",
    [(0.0, False, 1.0, 1), (0.01, False, 2.0, 3), (0.1, True, 3.0, 1000), (0.0, True, 6.0, 7)],
)
def test_c_matches_numpy_bitwise(variant, dtype, n, wd, decoupled, div, step):
    variant = _variant(variant)
    cfg = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                     decoupled=decoupled)  # fmt: skip
    arrays = _arrays(n, dtype, seed=n + step)
    ours = _run("c", arrays, step, cfg, div, variant)
    theirs = _run("numpy", arrays, step, cfg, div)
    for a, b in zip(ours, theirs, strict=True):
        assert _same_bits(a, b)


def _with_nonfinite(dtype: type, n: int = 40) -> list[np.ndarray]:
    """Arrays whose gradient holds NaN, +inf, -inf and finite values whose squares
    overflow the dtype, and one infinite second moment."""
    arrays = _arrays(n, dtype, seed=1)
    big = np.finfo(dtype).max / 4  # finite; its square is not
    arrays[1][[0, 5, 17, 20, 33]] = [np.nan, np.inf, -np.inf, big, -big]
    arrays[3][9] = np.inf
    return arrays


@needs_c
@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("decoupled", [False, True])
def test_c_propagates_nonfinite_like_numpy(variant, dtype, decoupled):
    variant = _variant(variant)
    for n in (40, 1000):  # within one vector and across many, with tails
        arrays = _with_nonfinite(dtype, n)
        cfg = AdamConfig(weight_decay=0.01, decoupled=decoupled)
        with np.errstate(invalid="ignore", over="ignore"):  # numpy flags what C does silently
            numpy_result = _run("numpy", arrays, 2, cfg, 2.0)
        c_result = _run("c", arrays, 2, cfg, 2.0, variant)
        for ours, theirs in zip(c_result, numpy_result, strict=True):
            assert _same_bits(ours, theirs)
        assert np.isnan(c_result[0][[0, 5, 17]]).all()  # the parameters: NaN, not a number


@needs_c
def test_c_leaves_views_outside_alone():
    p, g, m, v = _arrays(100, np.float32, seed=2)
    before = [a.copy() for a in (p, m, v)]
    adam_step(p[10:20], g[10:20], m[10:20], v[10:20], 1, AdamConfig(), np.empty(8, np.float32),
              kernel="c")  # fmt: skip
    for after, orig in zip((p, m, v), before, strict=True):
        assert _same_bits(after[:10], orig[:10]) and _same_bits(after[20:], orig[20:])
        assert not _same_bits(after[10:20], orig[10:20])


@needs_c
def test_c_refuses_bad_arrays():
    p, g, m, v = _arrays(8, np.float32, seed=3)
    with pytest.raises(TypeError, match="float32 or float64"):
        adam._kernels.adam(p.astype(np.int32), g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, False,
                           0.1, 0.001, 1.0)  # fmt: skip
    with pytest.raises(TypeError, match="exp_avg has format"):
        adam._kernels.adam(p, g, m.astype(np.float64), v, 1e-3, 0.9, 0.999, 1e-8, 0.0, False,
                           0.1, 0.001, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="exp_avg_sq has 28 bytes, param 32"):
        adam._kernels.adam(p, g, m, v[:7], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 0.1, 0.001, 1.0)
    frozen = p.copy()
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="param must be a writable"):
        adam._kernels.adam(frozen, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 0.1, 0.001, 1.0)


def test_strided_views_take_numpy_path():
    """A non-contiguous view cannot go to the C kernel; the result is still right."""
    p, g, m, v = _arrays(64, np.float64, seed=4)
    ref = _run("numpy", [a[::2].copy() for a in (p, g, m, v)], 1, AdamConfig(), 1.0)
    views = [a.copy() for a in (p, g, m, v)]
    adam_step(*(a[::2] for a in views), 1, AdamConfig(), np.empty(8), kernel=adam.KERNEL)
    for got, want in zip((views[0][::2], views[2][::2], views[3][::2]), ref, strict=True):
        assert _same_bits(np.ascontiguousarray(got), want)


def test_kernel_choice_is_validated():
    with pytest.raises(ValueError, match="'fast'"):
        adam._choose_kernel("fast")
    assert adam._choose_kernel("numpy") == "numpy"
    assert adam.KERNEL in ("c", "numpy")


@needs_c
def test_variants_are_listed_and_validated():
    compiled = adam._kernels.compiled()
    assert adam.VARIANTS and adam.VARIANTS[-1] == "baseline"
    assert set(adam.VARIANTS) <= set(compiled) <= set(ALL_VARIANTS)
    assert list(compiled) == [v for v in ALL_VARIANTS if v in compiled]  # widest first
    assert adam._choose_variant("") is None and adam._choose_variant("auto") is None
    assert adam._choose_variant("baseline") == "baseline"
    with pytest.raises(ValueError, match="'sse9'"):
        adam._choose_variant("sse9")
    g = np.ones(4)
    with pytest.raises(ValueError, match="unknown kernel variant 'sse9'"):
        adam._kernels.grad_stats(g, variant="sse9")
    with pytest.raises(TypeError):
        adam._kernels.grad_stats(g, "baseline")  # keyword only
    for name in set(ALL_VARIANTS) - set(adam.VARIANTS):
        with pytest.raises(ValueError, match=f"kernel variant '{name}'"):
            adam._kernels.grad_stats(g, variant=name)


def test_variant_environment_variable():
    """ZEROMPI_KERNEL_VARIANT is read at import; a wrong one fails the import."""

    def variant_of(value: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, ZEROMPI_KERNEL_VARIANT=value)
        code = "import zerompi.adam as a; print(a.VARIANT)"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    assert variant_of("").stdout.strip() == "None"
    bad = variant_of("sse9")
    assert bad.returncode != 0 and "ZEROMPI_KERNEL_VARIANT='sse9'" in bad.stderr
    if adam._kernels is not None:
        assert variant_of("baseline").stdout.strip() == "baseline"


def _lane_sum(g: np.ndarray) -> float:
    """The C kernel's sum of squares, in its order: 16 float64 partial sums over the
    full blocks of 16, the tail added to 0.0, then the 16 partial sums in turn."""
    x = g.astype(np.float64)
    k = len(x) // 16 * 16
    acc = np.zeros(16)
    for row in (x[:k] * x[:k]).reshape(-1, 16):
        acc += row
    total = 0.0
    for value in x[k:]:
        total += float(value) * float(value)
    for value in acc:
        total += float(value)
    return total


@needs_c
@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c_grad_stats_every_variant_exact(variant, dtype):
    """Every variant sums the squares in the same order: the same bits as the C
    loop's order computed with numpy, and counts the same non-finite elements."""
    variant = _variant(variant)
    for n in LENGTHS:
        g = _arrays(n, dtype, seed=n)[1]
        assert adam._kernels.grad_stats(g, variant=variant) == (0, _lane_sum(g)), n
        if n >= 20:
            g[[0, 5, 17]] = [np.nan, np.inf, -np.inf]
            bad, total = adam._kernels.grad_stats(g, variant=variant)
            assert bad == 3 and np.isnan(total), n


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
def test_c_grad_stats_agree_with_numpy(dtype, n):
    """Same count, same sum up to float32 chunk rounding (C sums every square in
    float64; numpy's dot sums a chunk in the array's dtype)."""
    g = _arrays(n, dtype, seed=n)[1]
    scratch = np.empty(64, dtype)
    bad_c, sum_c = adam.grad_stats(g, scratch, kernel="c")
    bad_np, sum_np = adam.grad_stats(g, scratch, kernel="numpy")
    exact = float(np.sum(g.astype(np.float64) ** 2))
    assert bad_c == bad_np == 0
    assert sum_c == pytest.approx(exact, rel=1e-12, abs=0)
    assert sum_np == pytest.approx(exact, rel=1e-5 if dtype == np.float32 else 1e-12, abs=0)


@needs_c
@variants
@pytest.mark.parametrize("kernel", ["c", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_stats_count_nonfinite_and_survive_overflow(variant, kernel, dtype):
    variant = _variant(variant)
    scratch = np.empty(64, dtype)
    for where, values, want in [
        ([3, 500, 999], [np.nan, np.inf, -np.inf], np.nan),
        ([3], [np.nan], np.nan),
        ([500, 999], [np.inf, -np.inf], np.inf),
        ([999], [-np.inf], np.inf),
    ]:
        g = np.ones(1000, dtype)
        g[where] = values
        bad, total = adam.grad_stats(g, scratch, kernel=kernel, variant=variant)
        assert bad == len(where), (where, values)
        assert np.isnan(total) if np.isnan(want) else total == np.inf, (where, values, total)
    # Finite values whose squares overflow the dtype: float32's sum fits a float64;
    # float64's does not, and both kernels say inf without counting a bad element.
    for big_value in [1e20, 3e38] if dtype == np.float32 else [1e200, np.finfo(dtype).max]:
        big = np.full(100, big_value, dtype)
        big[::3] *= -1
        bad, total = adam.grad_stats(big, scratch, kernel=kernel, variant=variant)
        want = 100 * float(big_value) ** 2 if dtype == np.float32 else np.inf
        assert bad == 0 and total == pytest.approx(want, rel=1e-6), big_value
    # ...and with a NaN among them: counted, whatever the overflow
    big[50] = np.nan
    bad, total = adam.grad_stats(big, scratch, kernel=kernel, variant=variant)
    assert bad == 1 and np.isnan(total)


# -- the within-node sum (zerompi.nodesum) --------------------------------------------


def _sum_in_order(out: np.ndarray, parts: list[np.ndarray], add: bool) -> np.ndarray:
    """numpy's sum of ``parts`` in rank order (after ``out`` with ``add``)."""
    total = out.copy() if add else parts[0].copy()
    for part in parts if add else parts[1:]:
        total = total + part
    return total


@variants
@pytest.mark.parametrize("kernel", ["c", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 16])
def test_sum_parts_in_rank_order_with_stats(variant, kernel, dtype, ranks):
    """The node's sum of the parts, in rank order, bit for bit as numpy adds them,
    into a separate ``out`` or into one of the parts itself (a rank's own region of
    its own buffer, stage 1), with ``add`` (a later micro-batch) or not; the
    statistics from the same pass are the C ``grad_stats`` of the result, bit for
    bit (numpy's: the same up to its chunked float32 dot products)."""
    if kernel == "c" and adam._kernels is None:
        pytest.skip("zerompi._kernels is not built")
    variant = _variant(variant) if kernel == "c" else None
    rng = np.random.default_rng(ranks)
    for n in LENGTHS:
        parts = [rng.standard_normal(n).astype(dtype) for _ in range(ranks)]
        for into, add in [(-1, False), (-1, True), *((q, False) for q in range(ranks))]:
            mine = [p.copy() for p in parts]
            out = rng.standard_normal(n).astype(dtype) if into < 0 else mine[into]
            want = _sum_in_order(out, mine, add)
            got = adam.sum_parts(out, mine, add, True, kernel=kernel, variant=variant)
            assert np.array_equal(out, want), (n, into, add)
            assert got is not None and got[0] == 0, (n, into, add)
            if kernel == "c":
                assert got == adam._kernels.grad_stats(want), (n, into, add)
            else:
                exact = float(np.sum(want.astype(np.float64) ** 2))
                assert got[1] == pytest.approx(exact, rel=1e-5, abs=1e-30), (n, into, add)
            assert adam.sum_parts(out, mine, True, False, kernel=kernel, variant=variant) is None
        if n >= 20:
            parts[0][[1, 7]] = [np.nan, np.inf]
            out = np.empty(n, dtype)
            bad, total = adam.sum_parts(out, parts, False, True, kernel=kernel, variant=variant)
            assert bad == 2 and not np.isfinite(total), n


@variants
@pytest.mark.parametrize("kernel", ["c", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sum_parts_clear_leaves_the_parts_zero(variant, kernel, dtype, ranks):
    """``clear`` (the staging slots' sum within a node): the same sum and statistics
    as without it, and every part zero afterwards, except a part that is ``out``,
    which holds the sum; nothing outside the parts is touched."""
    if kernel == "c" and adam._kernels is None:
        pytest.skip("zerompi._kernels is not built")
    variant = _variant(variant) if kernel == "c" else None
    rng = np.random.default_rng(ranks + 10)
    for n in LENGTHS:
        for into, add in [(-1, False), (-1, True), *((q, False) for q in range(ranks))]:
            backing = [rng.standard_normal(n + 2).astype(dtype) for _ in range(ranks)]
            mine = [b[1 : n + 1] for b in backing]  # a guard element on each side
            edges = [(b[0], b[-1]) for b in backing]
            out = rng.standard_normal(n).astype(dtype) if into < 0 else mine[into]
            want = _sum_in_order(out, [p.copy() for p in mine], add)
            want_stats = adam.sum_parts(want.copy(), [want.copy()], False, True, kernel="numpy")
            got = adam.sum_parts(out, mine, add, True, kernel=kernel, variant=variant, clear=True)
            assert np.array_equal(out, want), (n, into, add)
            assert got is not None and got[0] == want_stats[0], (n, into, add)
            for q, part in enumerate(mine):
                assert q == into or not part.any(), (n, into, add, q)
            assert [(b[0], b[-1]) for b in backing] == edges, (n, into, add)


def _aligned(n: int, dtype: type, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """A view of ``n`` elements starting ``shift`` elements past a 64-byte boundary,
    and the same with 16 guard elements (7.0) on each side."""
    item = np.dtype(dtype).itemsize
    backing = np.full(n + 64 // item + 2 * 16 + 1, 7.0, dtype)
    start = 16 + (-(backing.ctypes.data + 16 * item) % 64) // item + shift
    return backing[start - 16 : start + n + 16], backing[start : start + n]


@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sum_parts_streamed_is_the_same_sum(variant, dtype, ranks):
    """``stream`` (non-temporal stores of ``out``'s whole tiles, stages 2-3's private
    shard): the same sum, statistics and cleared parts as plain stores, for an
    ``out`` on a 64-byte boundary (streamed) or off it, one of the parts, or added
    to (stored plainly); nothing outside ``out`` is written."""
    if adam._kernels is None:
        pytest.skip("zerompi._kernels is not built")
    variant = _variant(variant)
    rng = np.random.default_rng(ranks + 20)
    for n in LENGTHS:
        parts = [rng.standard_normal(n).astype(dtype) for _ in range(ranks)]
        for shift, into, add, clear in [(0, -1, False, False), (0, -1, False, True),
                                        (1, -1, False, False), (0, -1, True, False),
                                        (0, 0, False, False)]:  # fmt: skip
            results = []
            for stream in (False, True):
                backing, out = _aligned(n, dtype, shift)
                out[...] = np.arange(n)
                mine = [p.copy() for p in parts]
                if into >= 0:
                    mine[into] = out
                    out[...] = parts[into]
                got = adam.sum_parts_compiled(out, mine, add, True, variant, clear, stream)
                results.append((backing.copy(), got, [m.copy() for m in mine]))
            (plain, a, pa), (streamed, b, pb) = results
            case = (n, shift, into, add, clear)
            assert np.array_equal(plain, streamed), case
            assert a == b, case
            assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True)), case
            assert (plain[:16] == 7).all() and (plain[-16:] == 7).all(), case


@needs_c
@pytest.mark.parametrize("kernel", ["c", "numpy"])
def test_sum_parts_statistics_beyond_float64(kernel):
    """Finite float64 sums whose squares leave float64's range: no non-finite element,
    an infinite sum of squares (grad_stats' convention), by both kernels."""
    big = np.full(40, 1e200)
    for total in (adam.sum_parts(np.empty(40), [big, big], False, True, kernel=kernel),
                  adam.sum_parts_compiled(np.empty(40), [big, big], False, True)):
        assert total == (0, np.inf)


@needs_c
def test_sum_parts_refuses_bad_arrays():
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="part 1 is not 8 elements"):
        adam._kernels.sum_parts(a, [a, np.zeros(7, np.float32)], False, True)
    with pytest.raises(ValueError, match="part 0 is not 8 elements"):
        adam._kernels.sum_parts(a, [np.zeros(8, np.float64)], False, True)
    with pytest.raises(ValueError, match="1 to 256 parts, got 0"):
        adam._kernels.sum_parts(a, [], False, True)
    with pytest.raises(TypeError, match="out must be a writable"):
        adam._kernels.sum_parts(a[::2], [a[:4]], False, True)


# -- SGD's and Lion's compiled loops ----------------------------------------------------

RULE_CASES = [  # (rule name, its config's settings)
    ("sgd", {}),
    ("sgd", {"momentum": 0.9, "weight_decay": 0.01}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "decoupled": True}),
    ("sgd", {"momentum": 0.5, "dampening": 0.3}),
    ("lion", {}),
    ("lion", {"beta1": 0.95, "beta2": 0.98, "weight_decay": 0.1}),
]


def _rule_step(
    name: str, settings: dict, kernel: str, variant: str | None, dtype: type, n: int,
    step: int, divisor: float, low: bool = False,
) -> list[np.ndarray]:  # fmt: skip
    """One update of a fresh ``name`` rule with ``kernel``: param, state (and the
    bfloat16 copy), from the same arrays (NaN and infinity among the gradients)."""
    from zerompi.rules.lion import Lion, LionConfig
    from zerompi.rules.sgd import SGD, SGDConfig

    rule = SGD() if name == "sgd" else Lion()
    rule.kernel, rule.variant = kernel, variant
    config = (SGDConfig if name == "sgd" else LionConfig)(lr=0.1, **settings)
    p, g, state, _ = _arrays(n, dtype, seed=n + step)
    if n > 3:
        g[1], g[2], state[3] = np.nan, np.inf, -0.0
    scratch = np.empty(64 * rule.scratch_blocks, dtype)  # blocks with tails
    copy = np.zeros(n, np.uint16) if low else None
    if copy is not None:
        from zerompi.precision import bfloat16

        copy = copy.view(bfloat16())
    rule.update(p, g, [state], step, config, scratch, divisor, copy, None)
    return [p, state] + ([copy.view(np.uint16)] if copy is not None else [])


@needs_c
@variants
@pytest.mark.parametrize(("name", "settings"), RULE_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 17, 1000])
@pytest.mark.parametrize(("step", "divisor"), [(1, 1.0), (3, 6.0)])
def test_sgd_and_lion_c_match_numpy_bitwise(variant, name, settings, dtype, n, step, divisor):
    """Every compiled variant of SGD's and Lion's loops gives the numpy loop's bits
    (parameters and state; NaN and infinity among the gradients)."""
    chosen = _variant(variant)
    want = _rule_step(name, settings, "numpy", None, dtype, n, step, divisor)
    got = _rule_step(name, settings, "c", chosen, dtype, n, step, divisor)
    for a, b in zip(got, want, strict=True):
        assert a.tobytes() == b.tobytes(), (name, settings)


@needs_c
@pytest.mark.parametrize("name", ["sgd", "lion"])
def test_sgd_and_lion_c_write_the_bfloat16_copy(name):
    """With a bfloat16 copy to write, the compiled path (block by block) gives the
    numpy path's copy and parameters."""
    decay = {"weight_decay": 0.1}
    want = _rule_step(name, decay, "numpy", None, np.float32, 1000, 2, 2.0, True)
    got = _rule_step(name, decay, "c", None, np.float32, 1000, 2, 2.0, True)
    for a, b in zip(got, want, strict=True):
        assert a.tobytes() == b.tobytes()


@needs_c
def test_sgd_and_lion_c_refuse_bad_arrays():
    """Mismatched dtypes or lengths are errors naming the array, not wrong memory."""
    p = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="momentum_buffer has format"):
        adam._kernels.sgd(p, p.copy(), np.zeros(4), 0.1, 0.9, 0.0, False, 0.0, False, True, 1.0)
    with pytest.raises(ValueError, match="exp_avg has 12 bytes, param 16"):
        adam._kernels.lion(p, p.copy(), np.zeros(3, np.float32), 0.1, 0.9, 0.99, 0.0, 1.0)
    with pytest.raises(TypeError, match="param must be a writable"):
        adam._kernels.lion(b"abcd", p, p.copy(), 0.1, 0.9, 0.99, 0.0, 1.0)


def _factored(dtype: type, rows: int, w: int, seed: int) -> tuple[np.ndarray, ...]:
    """A rectangle's gradient over a wide range of magnitudes (a NaN, an infinity and
    a zero among them where it has room), its rows' and columns' states (a zero and
    a NaN state among them), and a parameter and an update of its size."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(rows * w) * np.exp(rng.uniform(-8, 8, rows * w))).astype(dtype)
    r = np.abs(rng.standard_normal(rows)).astype(dtype)
    c = np.abs(rng.standard_normal(w)).astype(dtype)
    if rows * w > 40:
        g[3], g[7], g[11] = np.nan, np.inf, 0.0
        r[0], c[-1] = 0.0, np.nan
    return g, r, c, rng.standard_normal(rows * w).astype(dtype), g[::-1].copy()


@needs_c
@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("rows", "w"), [(1, 1), (1, 15), (3, 16), (4, 33), (7, 100), (2, 300)])
def test_adafactor_loops_match_numpy_bitwise(variant, dtype, rows, w):
    """Every compiled variant of Adafactor's loops (zerompi.rules.adafactor: the sums of
    squares, the rows' and columns' sums of a rectangle, U in place, the update)
    gives the numpy functions' bits, widths with and without a tail of the 16 lanes,
    NaN and infinity among the values."""
    from zerompi.rules import adafactor as af

    chosen = _variant(variant)
    g, r, c, p, u = _factored(dtype, rows, w, seed=rows * w)
    with np.errstate(invalid="ignore", over="ignore"):
        for x in (g, p):
            got, want = af.sumsq(x, "c", chosen), af.sumsq_numpy(x)
            assert np.array([got]).tobytes() == np.array([want]).tobytes(), (got, want)
        got_sums = af.rect_sums(g, rows, "c", chosen)
        want_sums = af.rect_sums(g, rows, "numpy")
        for a, b in zip(got_sums, want_sums, strict=True):
            assert a.tobytes() == b.tobytes()
        # averaging where g is read: the sums of the quotients numpy's divide gives, g
        # unchanged; U of the quotients. Powers of two multiply by the reciprocal
        # (2, 4, 0.5), the others divide (3, 6); tiny values make subnormal quotients.
        tiny = g * dtype(np.finfo(dtype).tiny)
        denom, floor = dtype(0.37), dtype(1e-30)
        for divisor in (2.0, 3.0, 4.0, 6.0, 0.5):
            for x in (g, tiny):
                before = x.copy()
                got_sums = af.rect_sums(x, rows, "c", chosen, divisor)
                assert x.tobytes() == before.tobytes(), "af_sums wrote g"
                want_sums = af.rect_sums(x, rows, "numpy", None, divisor)
                divided = (x / divisor).astype(dtype)
                for a, b, d in zip(got_sums, want_sums, af.rect_sums(divided, rows, "numpy"),
                                   strict=True):  # fmt: skip
                    assert a.tobytes() == b.tobytes() == d.tobytes(), divisor
                got_u, want_u, plain = x.copy(), x.copy(), divided.copy()
                af.rect_u(got_u, r, c, denom, floor, "c", chosen, divisor)
                af.rect_u(want_u, r, c, denom, floor, "numpy", None, divisor)
                af.rect_u(plain, r, c, denom, floor, "numpy")
                assert got_u.tobytes() == want_u.tobytes() == plain.tobytes(), divisor
        got_u, want_u = g.copy(), g.copy()
        af.rect_u(got_u, r, c, denom, floor, "c", chosen)
        af.rect_u(want_u, r, c, denom, floor, "numpy")
        assert got_u.tobytes() == want_u.tobytes()
        # U is (g / divisor) / sqrt(max((r / denom) c^T, floor)), written out in numpy
        want = (g / dtype(2.0)).reshape(rows, w) / np.sqrt(np.maximum(np.outer(r / denom, c),
                                                                      floor))  # fmt: skip
        got_u = g.copy()
        af.rect_u(got_u, r, c, denom, floor, "c", chosen, 2.0)
        assert got_u.tobytes() == want.astype(dtype).reshape(-1).tobytes()
        for decay in (None, dtype(0.999)):
            got_p, want_p = p.copy(), p.copy()
            af.apply(got_p, u, decay, dtype(-0.01), "c", chosen)
            af.apply(want_p, u, decay, dtype(-0.01), "numpy")
            assert got_p.tobytes() == want_p.tobytes(), decay


@needs_c
def test_the_compiled_module_is_not_older_than_its_source():
    """The extension is optional, so a build that fails (say, a compile error in
    ``_kernels.c``) leaves the last one in place and ``pip install -e .`` still
    succeeds: the tests would run stale loops. A compiled module next to its source
    must be at least as new as it."""
    from pathlib import Path

    built = Path(adam._kernels.__file__)
    source = built.parent / "_kernels.c"
    if not source.exists():
        pytest.skip("an installed copy: its source is not next to it")
    assert built.stat().st_mtime >= source.stat().st_mtime, (
        f"{built.name} is older than {source}: its last build failed or did not run; "
        "rebuild with `pip install --no-deps --no-build-isolation -e .` and read its errors"
    )


@needs_c
@variants
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("stack", "n", "m", "chunk", "a", "b", "lo", "hi"),
    [
        (1, 4, 8, 16, 0, 32, 0, 32),  # one matrix, chunks of two rows
        (3, 5, 7, 16, 3, 101, 10, 90),  # partial rows at both ends, across matrices
        (2, 3, 40, 25, 17, 233, -5, 300),  # rows longer than a chunk, chunks mid-row
        (4, 2, 3, 64, 0, 24, 5, 6),  # whole rows, a chunk spans matrices
        (2, 6, 5, 7, 29, 30, 0, 60),  # one element
        (2, 6, 5, 7, 29, 29, 0, 60),  # nothing
    ],
)  # fmt: skip
def test_adafactor_range_loops_match_the_python_loops(
    variant, dtype, stack, n, m, chunk, a, b, lo, hi, monkeypatch
):
    """The compiled loops over a parameter's range in one call (sumsq_chunks,
    af_sums_range, af_u_range) give the bits of zerompi.rules.adafactor's numpy path,
    which loops over the same pieces in Python: sums per piece of the multiples of
    CHUNK added in turn to what was there, the rectangles of rects, U of the
    quotients and sum(U^2) of the counted elements (lo ... hi) per piece."""
    from zerompi.rules import adafactor as af

    monkeypatch.setattr(af, "CHUNK", chunk)
    chosen = _variant(variant)
    rng = np.random.default_rng(stack * n * m + a)
    x = rng.standard_normal(b - a).astype(dtype)
    init = 0.25
    want = init
    for p, q in af.chunks(a, b):
        want += af.sumsq_numpy(x[p - a : q - a])
    got = adam._kernels.sumsq_chunks(x, a, chunk, init, variant=chosen or None)
    assert np.float64(got).tobytes() == np.float64(want).tobytes(), (got, want)
    for divisor in (None, 2.0, 3.0):
        rows0, cols0 = rng.standard_normal(stack * n), rng.standard_normal(stack * m)
        want_rows, want_cols = rows0.copy(), cols0.copy()
        for k, i0, i1, j0, j1, at in af.rects(a, b, n, m):
            part = x[at : at + (i1 - i0) * (j1 - j0)]
            rs, cs = af.rect_sums(part, i1 - i0, "numpy", None, divisor)
            want_rows[k * n + i0 : k * n + i1] += rs
            want_cols[k * m + j0 : k * m + j1] += cs
        got_rows, got_cols, before = rows0.copy(), cols0.copy(), x.copy()
        adam._kernels.af_sums_range(x, a, n, m, chunk, got_rows, got_cols, divisor=divisor,
                                    variant=chosen or None)  # fmt: skip
        assert x.tobytes() == before.tobytes()
        assert got_rows.tobytes() == want_rows.tobytes(), divisor
        assert got_cols.tobytes() == want_cols.tobytes(), divisor
        k0 = a // (n * m)
        r = np.abs(rng.standard_normal(stack * n)).astype(dtype)[k0 * n :]
        c = np.abs(rng.standard_normal(stack * m)).astype(dtype)[k0 * m :]
        denoms = (np.abs(rng.standard_normal(stack)) + 0.5).astype(dtype)[k0:]
        floor = dtype(1e-3)
        want_u, want_sum = x.copy(), init
        for p, q in af.chunks(a, b):
            for k, i0, i1, j0, j1, at in af.rects(p, q, n, m):
                kk, at = k - k0, at + p - a
                af.rect_u(want_u[at : at + (i1 - i0) * (j1 - j0)], r[kk * n + i0 : kk * n + i1],
                          c[kk * m + j0 : kk * m + j1], denoms[kk], floor, "numpy", None,
                          divisor)  # fmt: skip
            ca, cb = max(p, lo), min(q, hi)
            if cb > ca:
                want_sum += af.sumsq_numpy(want_u[ca - a : cb - a])
        got_u = x.copy()
        got_sum = adam._kernels.af_u_range(got_u, a, n, m, r, c, denoms, k0, float(floor),
                                           chunk, lo, hi, init, divisor=divisor,
                                           variant=chosen or None)  # fmt: skip
        assert got_u.tobytes() == want_u.tobytes(), divisor
        assert np.float64(got_sum).tobytes() == np.float64(want_sum).tobytes(), divisor


@needs_c
def test_adafactor_range_loops_refuse_what_they_cannot_index():
    """A range past the states it is given is an error naming the sizes, not a read
    or write past them."""
    g = np.zeros(30, np.float32)
    with pytest.raises(ValueError, match="rowsum and colsum must hold 3 matrices"):
        adam._kernels.af_sums_range(g, 0, 2, 5, 16, np.zeros(4), np.zeros(10))
    with pytest.raises(ValueError, match="span matrices 0 to 2, denoms holds 0 to 1"):
        adam._kernels.af_u_range(g, 0, 2, 5, np.ones(6, np.float32), np.ones(15, np.float32),
                                 np.ones(2, np.float32), 0, 0.0, 16, 0, 30, 0.0)  # fmt: skip
    with pytest.raises(ValueError, match="r and c must hold 3 matrices"):
        adam._kernels.af_u_range(g, 0, 2, 5, np.ones(4, np.float32), np.ones(15, np.float32),
                                 np.ones(3, np.float32), 0, 0.0, 16, 0, 30, 0.0)  # fmt: skip
    with pytest.raises(ValueError, match="chunk >= 1"):
        adam._kernels.sumsq_chunks(g, 0, 0, 0.0)
    ints, k = np.zeros(30, np.int32), adam._kernels
    for call in (lambda: k.sumsq_chunks(ints, 0, 16, 0.0),
                 lambda: k.af_sums(ints, 3, np.zeros(3), np.zeros(10)),
                 lambda: k.af_sums_range(ints, 0, 2, 5, 16, np.zeros(6), np.zeros(15)),
                 lambda: k.af_u(ints, np.ones(3, np.float32), np.ones(10, np.float32), 1.0, 0.0),
                 lambda: k.af_u_range(ints, 0, 2, 5, np.ones(6, np.float32),
                                      np.ones(15, np.float32), np.ones(3, np.float32), 0, 0.0,
                                      16, 0, 30, 0.0)):  # fmt: skip
        with pytest.raises(TypeError, match=r"[xg] must be float32 or float64"):
            call()
    with pytest.raises(TypeError, match="real number"):
        k.af_u(g, np.ones(3, np.float32), np.ones(10, np.float32), 1.0, 0.0, divisor="2")


@needs_c
def test_adafactor_loops_refuse_bad_arrays():
    """Wrong shapes and dtypes are errors naming the array, not wrong memory."""
    g = np.zeros(12, np.float32)
    with pytest.raises(ValueError, match="rows x w elements"):
        adam._kernels.af_sums(g, 5, np.zeros(5), np.zeros(2))
    with pytest.raises(ValueError, match="colsum must be 4 float64 elements"):
        adam._kernels.af_sums(g, 3, np.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match="c must be 4 float32 elements"):
        adam._kernels.af_u(g, np.zeros(3, np.float32), np.zeros(5, np.float32), 1.0, 0.0)
    with pytest.raises(ValueError, match="r must be float32 elements"):
        adam._kernels.af_u(g, np.zeros(3), np.zeros(4, np.float32), 1.0, 0.0)
    with pytest.raises(ValueError, match="u has 8 bytes, param 48"):
        adam._kernels.af_apply(g, np.zeros(2, np.float32), None, 1.0)


def test_cache_bytes_reads_the_largest_cache(tmp_path):
    """The largest of sysfs' cache sizes (``K``, ``M`` suffixes or bytes); 32 MiB where
    the folder is missing or a size unreadable."""
    for index, size in enumerate(["48K", "2048K", "32768K", "64"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert adam.cache_bytes(str(tmp_path)) == 32 << 20
    (tmp_path / "index2" / "size").write_text("1M\n")
    assert adam.cache_bytes(str(tmp_path)) == 2 << 20
    assert adam.cache_bytes(str(tmp_path / "missing")) == 32 << 20
    (tmp_path / "index1" / "size").write_text("lots\n")
    assert adam.cache_bytes(str(tmp_path)) == 32 << 20


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.uint8])
def test_zero_sets_every_byte_and_nothing_else(dtype):
    """``zero`` (the gradient buffers after a step), streamed or not: every element of
    the view 0 (+0.0 for floats), whatever its length and alignment, the guard
    elements around it untouched; :func:`zerompi.adam.zero` picks the stream by size."""
    for n in [0, 1, 7, 31, 32, 33, 64, 1000, (1 << 15) + 5]:
        for shift in (0, 1, 3, 8):
            for stream in (False, True):
                backing = np.full(n + 2 * 16 + shift, 7, dtype)
                view = backing[16 + shift : 16 + shift + n]
                adam._kernels.zero(view, stream=stream)
                assert not view.any() and not np.signbit(view).any(), (n, shift, stream)
                assert (backing[: 16 + shift] == 7).all() and (backing[16 + shift + n :] == 7).all()
    big = np.ones(adam.ZERO_STREAM_BYTES // np.dtype(dtype).itemsize + 3, dtype)
    adam.zero(big[1:])
    assert big[0] == 1 and not big[1:].any()
    with pytest.raises(TypeError, match="writable contiguous"):
        adam._kernels.zero(np.zeros(8, dtype)[::2])
