"""The compiled fused Adam kernel against the numpy kernel: bit for bit.

Both kernels promise the reference's IEEE operations in the reference's order, so
they must agree exactly (bit patterns, NaN and infinity included), for every dtype,
weight-decay mode, divisor and length, 0 and vector tails included. Local and
deterministic, so the same on every rank: plain asserts are collective enough here.
"""

from __future__ import annotations

import numpy as np
import pytest

from zerompi import adam
from zerompi.adam import AdamConfig, adam_step

needs_c = pytest.mark.skipif(
    adam._kernels is None, reason="zerompi._kernels not built (no C compiler at install)"
)

LENGTHS = [0, 1, 7, 16, 17, 63, 1000, (1 << 15) + 5]


def _arrays(n: int, dtype: type, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(dtype)
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(dtype)
    m = (rng.standard_normal(n) * 0.1).astype(dtype)
    v = np.abs(rng.standard_normal(n) * 0.01).astype(dtype)
    return [p, g, m, v]


def _run(kernel: str, arrays: list[np.ndarray], step: int, cfg: AdamConfig, div: float):
    p, g, m, v = (a.copy() for a in arrays)
    scratch = np.empty(64, dtype=p.dtype)  # small: many numpy blocks
    adam_step(p, g, m, v, step, cfg, scratch, div, kernel=kernel)
    return p, m, v


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(
    "wd,decoupled,div,step",
    [(0.0, False, 1.0, 1), (0.01, False, 2.0, 3), (0.1, True, 3.0, 1000), (0.0, True, 6.0, 7)],
)
def test_c_matches_numpy_bitwise(dtype, n, wd, decoupled, div, step):
    cfg = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                     decoupled=decoupled)  # fmt: skip
    arrays = _arrays(n, dtype, seed=n + step)
    ours, theirs = _run("c", arrays, step, cfg, div), _run("numpy", arrays, step, cfg, div)
    for a, b in zip(ours, theirs, strict=True):
        assert _same_bits(a, b)


@needs_c
def test_c_propagates_nonfinite_like_numpy():
    arrays = _arrays(40, np.float32, seed=1)
    arrays[1][[0, 5, 17]] = [np.nan, np.inf, -np.inf]
    arrays[3][9] = np.inf
    cfg = AdamConfig(weight_decay=0.01)
    with np.errstate(invalid="ignore"):
        numpy_result = _run("numpy", arrays, 2, cfg, 2.0)
    for ours, theirs in zip(_run("c", arrays, 2, cfg, 2.0), numpy_result, strict=True):
        assert _same_bits(ours, theirs)


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
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c_grad_stats_count_nonfinite_and_survive_overflow(dtype):
    g = np.ones(1000, dtype)
    g[[3, 500, 999]] = [np.nan, np.inf, -np.inf]
    bad, total = adam.grad_stats(g, np.empty(64, dtype), kernel="c")
    assert bad == 3 and not np.isfinite(total)
    # Finite values whose squares overflow the dtype: float32's sum fits a float64;
    # float64's does not, and both kernels say inf without counting a bad element.
    big = np.full(100, 1e20 if dtype == np.float32 else 1e200, dtype)
    for kernel in ("c", "numpy"):
        bad, total = adam.grad_stats(big, np.empty(64, dtype), kernel=kernel)
        want = 100 * float(big[0]) ** 2 if dtype == np.float32 else np.inf
        assert bad == 0 and total == pytest.approx(want, rel=1e-6), kernel
