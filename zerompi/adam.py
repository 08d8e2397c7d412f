"""The optimizer kernel: Adam / AdamW on one rank's flat shard, in place.

Adam is Kingma & Ba (2015), Algorithm 1, with bias correction; weight decay is
either an L2 term added to the gradient (``decoupled=False``, torch's ``Adam``) or
decoupled (Loshchilov & Hutter 2019, Algorithm 2 with the schedule multiplier set
to the learning rate, as torch's ``AdamW``)::

    g  = grad / divisor                       (average over ranks and micro-batches)
    g += wd * p                               (L2 only)
    m  = b1 * m + (1 - b1) * g
    v  = b2 * v + (1 - b2) * (g * g)
    u  = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)
    u += wd * p                               (decoupled only)
    p -= lr * u

Two kernels compute it, with the same IEEE operations in the same order as
:mod:`zerompi.reference`, so a world of one rank reproduces the reference bit for bit:

* ``"c"``: the compiled extension ``zerompi._kernels`` (built at install when a C
  compiler is there), one fused pass over memory: 28 bytes per float32 element, at
  about the speed of torch's fused CPU Adam;
* ``"numpy"``: blocks of ``len(scratch)`` elements with ``out=`` ufuncs, allocation
  free and cache-resident, about 3x slower. The fallback without a compiler.

``ZEROMPI_KERNEL=numpy`` (or ``c``, which then must be present) chooses; :data:`KERNEL`
says which one runs.

The C loops are compiled for AVX-512, AVX2 and baseline x86-64 (only the baseline
elsewhere) and the widest one the CPU runs is used; :data:`VARIANTS` lists those this
CPU runs. ``ZEROMPI_KERNEL_VARIANT=avx2`` (say) makes every call use that one, and the
``variant=`` argument of :func:`adam_step`/:func:`grad_stats` picks one per call (the
tests run each one against the numpy kernel). All give the same bits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:
    from . import _kernels
except ImportError:  # built without a C compiler: the numpy kernel does the work
    _kernels = None


def _choose_kernel(requested: str) -> str:
    """The kernel to run for a request of ``""``/``"auto"``, ``"c"`` or ``"numpy"``."""
    if requested not in ("", "auto", "c", "numpy"):
        raise ValueError(f"the Adam kernel must be 'c', 'numpy' or 'auto', got {requested!r}")
    if requested == "c" and _kernels is None:
        raise ImportError(
            "ZEROMPI_KERNEL=c but zerompi._kernels was not built (no C compiler at "
            "install time?): reinstall zerompi with gcc or cc on PATH"
        )
    if requested == "numpy" or _kernels is None:
        return "numpy"
    return "c"


#: The Adam kernel in use: ``"c"`` (fused, compiled) or ``"numpy"`` (blocked ufuncs).
KERNEL: str = _choose_kernel(os.environ.get("ZEROMPI_KERNEL", ""))

#: The compiled variants of the C kernel this CPU runs, widest vectors first (empty
#: without the extension).
VARIANTS: tuple[str, ...] = tuple(_kernels.variants()) if _kernels is not None else ()


def _choose_variant(requested: str) -> str | None:
    """The C variant every call runs for ``ZEROMPI_KERNEL_VARIANT=requested`` (``None``:
    the widest one this CPU runs, chosen by the extension)."""
    if requested in ("", "auto"):
        return None
    if _kernels is None:
        raise ImportError(f"ZEROMPI_KERNEL_VARIANT={requested} but zerompi._kernels was not built")
    if requested not in VARIANTS:
        raise ValueError(
            f"ZEROMPI_KERNEL_VARIANT={requested!r}: this CPU and build run "
            f"{', '.join(VARIANTS)} (compiled: {', '.join(_kernels.compiled())})"
        )
    return requested


#: The C variant every call runs (``None``: the widest one this CPU runs).
VARIANT: str | None = _choose_variant(os.environ.get("ZEROMPI_KERNEL_VARIANT", "").strip())

#: Elements per block: 4 arrays + scratch of one block stay within L2 cache.
BLOCK = 1 << 15


def cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest cache of CPU 0 in bytes, from Linux's sysfs (its ``index*/size``,
    ``"32768K"``); 32 MiB where it cannot be read (another OS, a container hiding
    it). What decides whether an array written now is still cached when read again
    after a pass over the others (:class:`zerompi.nodesum.NodeSum`)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    try:
        for entry in os.listdir(root):
            if entry.startswith("index"):
                with open(os.path.join(root, entry, "size")) as f:
                    text = f.read().strip()
                largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units
                              else int(text))  # fmt: skip
    except (OSError, ValueError):
        largest = 0
    return largest or 32 << 20


#: This machine's largest cache (:func:`cache_bytes`).
CACHE_BYTES = cache_bytes()


#: Bytes from which :func:`zero` writes past the cache.
ZERO_STREAM_BYTES = 1 << 20


def zero(a: np.ndarray) -> None:
    """``a`` (contiguous) set to zero where it is not read again before the next
    backward writes it (the gradient buffers after a step): the compiled kernel's
    non-temporal stores from :data:`ZERO_STREAM_BYTES` up (no read for ownership;
    ``scripts/zero_ab.py`` times it against ``fill``), its ``memset`` below; numpy's
    ``fill`` without the kernel."""
    if KERNEL == "c" and a.flags.c_contiguous:
        _kernels.zero(a, stream=a.nbytes >= ZERO_STREAM_BYTES)
    else:
        a.fill(0)


def finite_real(
    name: str, value: object, *, positive: bool = False, kind: str = "a real number"
) -> float:
    """``value`` as a finite Python float (``> 0`` if ``positive``), or a
    ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be {kind}, got {value!r:.60}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {value!r:.40}") from None
    if positive and not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


@dataclass(frozen=True)
class AdamConfig:
    """Hyperparameters of Adam/AdamW, validated on construction."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            # Plain Python floats: numpy then treats them as weak scalars and computes
            # in the array's own dtype.
            object.__setattr__(self, name, finite_real(name, getattr(self, name)))
        if self.lr < 0:  # 0 is a schedule's warm-up start or end: torch accepts it
            raise ValueError(f"lr must be >= 0, got {self.lr!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not isinstance(self.decoupled, bool):
            raise TypeError(f"decoupled_weight_decay must be a bool, got {self.decoupled!r}")


def adam_step(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    step: int,
    config: AdamConfig,
    scratch: np.ndarray,
    divisor: float = 1.0,
    kernel: str | None = None,
    variant: str | None = None,
    low: np.ndarray | None = None,
    stochastic: tuple[int, int] | None = None,
) -> None:
    """One Adam step on 1-D views of equal length, in place.

    ``grad`` is consumed (its contents are undefined afterwards). ``step`` is the
    1-based step count used for bias correction; ``divisor`` averages a gradient that
    was summed over ranks and micro-batches. ``kernel`` overrides :data:`KERNEL`;
    views that are not contiguous take the numpy kernel. ``variant`` (one of
    :data:`VARIANTS`) overrides :data:`VARIANT` for the C kernel. ``low`` (bfloat16
    or float16, as long as ``param``) receives the updated parameters rounded to
    nearest even, in the same pass (the numpy kernel: block by block, while the
    block is in cache), bit-identical to numpy's/ml_dtypes' cast; with ``stochastic``
    (``(key, base)``, bfloat16 only) rounded stochastically instead, element ``i``
    from the hash of ``(key, base + i)`` (:func:`stochastic_round`).
    """
    c = config
    bc1 = 1.0 - c.beta1**step
    bc2 = 1.0 - c.beta2**step
    if kernel is not None and kernel != KERNEL:
        kernel = _choose_kernel(kernel)
    if (kernel or KERNEL) == "c" and all(
        a.flags.c_contiguous for a in (param, grad, exp_avg, exp_avg_sq)
    ) and (low is None or low.flags.c_contiguous):  # fmt: skip
        if low is not None and low.dtype.itemsize != 2:  # float32 copy of a float64 master
            adam_step(param, grad, exp_avg, exp_avg_sq, step, config, scratch, divisor,
                      kernel, variant)  # fmt: skip
            np.copyto(low, param, casting="unsafe")  # the chunk is still in cache
            return
        if low is None:
            _kernels.adam(
                param, grad, exp_avg, exp_avg_sq, c.lr, c.beta1, c.beta2, c.eps,
                c.weight_decay, c.decoupled, bc1, bc2, float(divisor),
                variant=variant or VARIANT,
            )  # fmt: skip
        else:
            key, base = stochastic if stochastic is not None else (-1, 0)
            _kernels.adam(
                param, grad, exp_avg, exp_avg_sq, c.lr, c.beta1, c.beta2, c.eps,
                c.weight_decay, c.decoupled, bc1, bc2, float(divisor),
                variant=variant or VARIANT, low=low.view(np.uint16), low_kind=_low_kind(low),
                sr_key=key, sr_base=base,
            )  # fmt: skip
        return
    n = param.shape[0]
    for lo in range(0, n, scratch.shape[0]):
        hi = min(lo + scratch.shape[0], n)
        p, g, m, v = param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        t = scratch[: hi - lo]
        if divisor != 1.0:
            np.divide(g, divisor, out=g)
        if c.weight_decay and not c.decoupled:
            np.multiply(p, c.weight_decay, out=t)
            np.add(g, t, out=g)
        np.multiply(m, c.beta1, out=m)
        np.multiply(g, 1.0 - c.beta1, out=t)
        np.add(m, t, out=m)
        np.multiply(v, c.beta2, out=v)
        np.multiply(g, g, out=t)
        np.multiply(t, 1.0 - c.beta2, out=t)
        np.add(v, t, out=v)
        np.divide(v, bc2, out=t)
        np.sqrt(t, out=t)
        np.add(t, c.eps, out=t)
        np.divide(m, bc1, out=g)
        np.divide(g, t, out=g)
        if c.weight_decay and c.decoupled:
            np.multiply(p, c.weight_decay, out=t)
            np.add(g, t, out=g)
        np.multiply(g, c.lr, out=g)
        np.subtract(p, g, out=p)
        if low is not None and stochastic is not None:
            stochastic_round(p, low[lo:hi], stochastic[0], stochastic[1] + lo)
        elif low is not None:  # (overflow rounds to inf, as the C kernel does: no warning)
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(low[lo:hi], p, casting="unsafe")


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32, in place on a uint32 array (the C kernel's ``mix32``)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def sr_key(step: int) -> int:
    """The stochastic-rounding key of a step: the same on every rank."""
    x = np.array([(step * 0x85EBCA6B + 0x27D4EB2F) & 0xFFFFFFFF], np.uint32)
    return int(_mix32(x)[0])


def stochastic_round(src: np.ndarray, low: np.ndarray, key: int, base: int) -> None:
    """``low`` (bfloat16) = ``src`` rounded stochastically: the magnitude rounds up
    with probability equal to the fraction of a bfloat16 ulp below it, from 16 random
    bits per element, element ``i``'s a hash of ``(key, base + i)``; what the C kernel
    computes, in numpy (block-sized temporaries: the fallback, and the tests'
    yardstick)."""
    if low.dtype.name != "bfloat16":
        raise TypeError(f"stochastic rounding is for bfloat16, got {low.dtype}")
    n = src.shape[0]
    if src.dtype == np.float64:
        src = _f64_to_f32_odd(src)
    u = src.astype(np.float32).view(np.uint32)
    index = np.arange(n, dtype=np.uint32)
    index += np.uint32(base & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        index *= np.uint32(0x9E3779B1)
    index += np.uint32(key)
    random = _mix32(index) & np.uint32(0xFFFF)
    up = ((u + random) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = ((u >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0)).astype(np.uint16)
    low.view(np.uint16)[...] = np.where(nan, quiet, up)


def _f64_to_f32_odd(x: np.ndarray) -> np.ndarray:
    """float64 to float32 rounding to odd (the C kernel's ``f64_to_f32_odd``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        back = f.astype(np.float64)
    u = f.view(np.uint32).copy()
    fix = (back != x) & np.isfinite(x) & np.isfinite(f)
    away = np.abs(back) > np.abs(x)
    u[fix] = (u[fix] - away[fix].astype(np.uint32)) | np.uint32(1)
    return u.view(np.float32)


def _low_kind(low: np.ndarray) -> int:
    """The C kernel's code of a 16-bit dtype: 0 bfloat16, 1 float16."""
    if low.dtype == np.float16:
        return 1
    if low.dtype.name == "bfloat16":
        return 0
    raise TypeError(f"low must be bfloat16 or float16, got {low.dtype}")


def accumulate(
    out: np.ndarray, part: np.ndarray, add: bool, kernel: str | None = None,
    variant: str | None = None,
) -> None:  # fmt: skip
    """``out += part`` (``add``) or ``out[...] = part``: a narrower ``part``
    (bfloat16/float16, or float32 into float64) upcast exactly into ``out``, summed
    in ``out``'s dtype: the same bits as numpy's mixed-dtype add; the compiled kernel
    does the 16-bit ones without numpy's per-element cast calls (the 16-bit
    reduction's inner loop)."""
    if kernel is not None and kernel != KERNEL:
        kernel = _choose_kernel(kernel)
    c_path = (kernel or KERNEL) == "c" and part.dtype.itemsize == 2
    if c_path and out.flags.c_contiguous and part.flags.c_contiguous:
        _kernels.accumulate(out, part.view(np.uint16), _low_kind(part), add,
                            variant=variant or VARIANT)  # fmt: skip
    elif add:
        np.add(out, part, out=out)
    else:
        np.copyto(out, part)


def round_low(
    src: np.ndarray, low: np.ndarray, kernel: str | None = None, variant: str | None = None
) -> None:
    """``low[...] = src`` rounded to nearest even (``low`` bfloat16 or float16): what
    :func:`adam_step` writes, for a copy made outside a step (initial values, a load)."""
    if kernel is not None and kernel != KERNEL:
        kernel = _choose_kernel(kernel)
    c_path = (kernel or KERNEL) == "c" and low.dtype.itemsize == 2
    if c_path and src.flags.c_contiguous and low.flags.c_contiguous:
        _kernels.round_low(src, low.view(np.uint16), _low_kind(low), variant=variant or VARIANT)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(low, src, casting="unsafe")


def sum_parts(
    out: np.ndarray, parts: Sequence[np.ndarray], add: bool, stats: bool = False,
    kernel: str | None = None, variant: str | None = None, clear: bool = False,
) -> tuple[int, float] | None:  # fmt: skip
    """``out[...] = parts[0] + parts[1] + ...`` (or ``out + parts[0] + ...`` with
    ``add``), summed in that order in ``out``'s dtype, the parts of ``out``'s dtype and
    length; ``out`` may be one of them. With ``stats``, also :func:`grad_stats` of
    the result: the C kernel computes both in one pass over memory (the reduction
    within a node reads each byte once), the numpy one in two. ``clear`` leaves every
    part zero (a part that is ``out`` holds the sum): the C kernel zeroes each block
    as it reads it, so the buffers need no zeroing pass before the next gradients."""
    if kernel is not None and kernel != KERNEL:
        kernel = _choose_kernel(kernel)
    if (kernel or KERNEL) == "c" and out.flags.c_contiguous and all(
        p.flags.c_contiguous for p in parts
    ):
        return sum_parts_compiled(out, parts, add, stats, variant, clear)
    n = out.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        aliased = any(np.may_share_memory(out, p) for p in parts)
        chunk = BLOCK if aliased else max(n, 1)  # aliased: through a small block
        tmp = np.empty(min(chunk, n), out.dtype) if aliased else None
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            o = out[lo:hi]
            acc = o if tmp is None else tmp[: hi - lo]
            if add:
                np.add(o, parts[0][lo:hi], out=acc)
            else:
                np.copyto(acc, parts[0][lo:hi])
            for part in parts[1:]:
                np.add(acc, part[lo:hi], out=acc)
            if tmp is not None:
                np.copyto(o, acc)
    if clear:
        for part in parts:
            if not np.may_share_memory(part, out):
                part.fill(0)
    if not stats:
        return None
    return grad_stats(out, np.empty(min(BLOCK, max(n, 1)), out.dtype), kernel="numpy")


def sum_parts_compiled(
    out: np.ndarray, parts: Sequence[np.ndarray], add: bool, stats: bool,
    variant: str | None = None, clear: bool = False, stream: bool = False,
) -> tuple[int, float] | None:  # fmt: skip
    """:func:`sum_parts` by the C kernel alone (which must be built), without the
    checks: for a caller whose arrays are contiguous and of ``out``'s float dtype by
    construction (the reduction within a node, once per bucket and micro-batch).
    ``stream`` writes ``out`` past the cache where the kernel can (not added to, none
    of the parts, aligned): the same values, without reading ``out`` first."""
    result = _kernels.sum_parts(
        out, parts, add, stats, clear=clear, stream=stream, variant=variant or VARIANT
    )
    if result is None or result[0] or math.isfinite(result[1]):
        return result
    # finite float64 squares beyond float64's range: grad_stats rescales
    return grad_stats(out, np.empty(min(BLOCK, out.shape[0]), out.dtype))


#: Elements per ``np.dot`` in :func:`grad_stats`: bounds the float32 accumulation error
#: of one dot product; the chunks are summed in float64.
STATS_CHUNK = 4096


def grad_stats(
    grad: np.ndarray,
    scratch: np.ndarray,
    kernel: str | None = None,
    variant: str | None = None,
) -> tuple[int, float]:
    """``(non-finite elements, sum of squares)`` of a 1-D view, read only.

    The C kernel sums the squares in float64 in one pass. The numpy one goes chunk
    by chunk with ``np.dot`` (which allocates nothing), summed in float64.
    Elements are counted only in a chunk whose dot product is not finite; a chunk of
    finite values whose squares overflow its dtype is rescaled by its largest
    magnitude into ``scratch`` (chunks are at most ``len(scratch)`` long) and summed
    again. The sum is ``nan`` or ``inf`` when the count is not zero, and ``inf`` with a
    count of zero when finite float64 values have a sum of squares beyond float64's
    range (float32 squares always fit).
    """
    if kernel is not None and kernel != KERNEL:
        kernel = _choose_kernel(kernel)
    if (kernel or KERNEL) == "c" and grad.flags.c_contiguous:
        # one pass, summed in float64
        nonfinite, total = _kernels.grad_stats(grad, variant=variant or VARIANT)
        if nonfinite or math.isfinite(total):
            return nonfinite, total
        # finite float64 values whose squares overflow: the rescaling path below
    # Overflow is expected and handled below: no RuntimeWarning for it.
    with np.errstate(over="ignore"):
        nonfinite = 0
        total = 0.0
        chunk = max(1, min(STATS_CHUNK, scratch.shape[0]))
        for lo in range(0, grad.shape[0], chunk):
            g = grad[lo : lo + chunk]
            s = float(np.dot(g, g))
            if not math.isfinite(s):
                bad = g.shape[0] - int(np.count_nonzero(np.isfinite(g)))  # rare: chunk-sized
                if bad:
                    nonfinite += bad
                else:  # finite values whose squares overflow: rescale
                    amax = max(abs(float(g.max())), abs(float(g.min())))
                    t = scratch[: g.shape[0]]
                    np.divide(g, amax, out=t)
                    s = float(np.dot(t, t)) * amax * amax
            total += s
    return nonfinite, total
