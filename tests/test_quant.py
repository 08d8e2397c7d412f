"""Blockwise 8-bit quantization (:mod:`zerompi.quant`) and the 8-bit Adam reference
built on it: nearest codes, blocks cut from the flat array's start so that any cut
into shards quantizes to the same bytes once the parts agree on the scales, and a
reference that trains like float32 Adam. Serial, one fixed seed; the serial run alone."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from zerompi import quant
from zerompi.reference import ReferenceAdam, ReferenceAdam8bit

#: Serial and local: under mpiexec each rank would only repeat the serial run's work.
pytestmark = pytest.mark.mpi_skip

MAPS = {"signed": quant.SIGNED, "unsigned": quant.UNSIGNED}


@pytest.mark.parametrize("kind", list(MAPS))
def test_formats_are_256_distinct_codes_with_zero_and_one(kind: str) -> None:
    """Every byte a distinct value (but -0 in the signed format), 0 and 1 among them,
    eight codes in every binade: dense near zero in relative terms."""
    fmt = MAPS[kind]
    table = fmt.table
    assert table.dtype == np.float32 and table.shape == (256,)
    assert table[0] == 0.0 and 1.0 in table
    distinct = np.unique(table)
    assert distinct.shape[0] == (255 if kind == "signed" else 256)
    positive = np.sort(table[table > 0])
    assert positive[0] == np.float32(2.0**-fmt.sub)  # the smallest: 2^-17, 2^-33
    for k in (1, 5, 10):  # a value 2^-k below its block's largest: 8 codes in its binade
        binade = positive[(positive >= 2.0**-k) & (positive < 2.0 ** (1 - k))]
        assert binade.shape[0] == 8


@pytest.mark.parametrize("kind", list(MAPS))
def test_quantize_takes_the_nearest_code(kind: str) -> None:
    """The code's value is the nearest of all 256 to ``x / scale`` (computed as
    ``|x| * (1 / scale)``), exact ties to the even code; the block's largest is
    exact; what is stored re-quantizes to itself."""
    fmt = MAPS[kind]
    codes = fmt.table
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(3000) * np.logspace(-12, 0, 3000)).astype(np.float32)
    if kind == "unsigned":
        x = np.abs(x)
    x[:5] = 0.0
    mags = np.unique(np.abs(codes)).astype(np.float64)  # every code, in a block of scale 1
    x[256 : 256 + mags.shape[0]] = mags
    mids = (mags[:-1] + mags[1:]) / 2  # every midpoint (rounded to float32), and 1.0
    x[512 : 512 + mids.shape[0]] = mids
    x[512 + mids.shape[0]] = 1.0
    scales = quant.block_max(x, 0)
    q = np.empty(x.shape, np.uint8)
    quant.quantize(x, 0, scales, fmt, q)
    for b in range(scales.shape[0]):
        part = x[b * quant.BLOCK : (b + 1) * quant.BLOCK]
        y = np.abs(part) * quant.reciprocal(scales[b])
        mine = q[b * quant.BLOCK : (b + 1) * quant.BLOCK]
        got = np.abs(np.abs(codes[mine]).astype(np.float64) - y)
        best = np.min(np.abs(np.abs(codes[None, :]).astype(np.float64) - y[:, None]), axis=1)
        assert np.all(got == best), f"block {b}: not the nearest"
        if fmt.signed:
            assert np.array_equal(mine >= 128, np.signbit(part)), f"block {b}: signs"
    out = np.empty(x.shape, np.float32)
    quant.dequantize(q, 0, scales, fmt, out)
    assert np.max(np.abs(out)) == np.max(np.abs(x))  # a block's largest is exact
    again = np.empty_like(q)  # what is stored is what a checkpoint re-reads, exactly
    quant.quantize(out, 0, quant.block_max(out, 0), fmt, again)
    assert np.array_equal(again, q)


def test_ties_go_to_the_even_code() -> None:
    """Halfway between two normal codes, and between two subnormal ones."""
    fmt = quant.UNSIGNED
    t = fmt.table
    for lo in (8, 100, 201, 3, 4):  # codes lo and lo + 1, their midpoint
        mid = np.float32((np.float64(t[lo]) + np.float64(t[lo + 1])) / 2)
        assert np.float64(mid) == (np.float64(t[lo]) + np.float64(t[lo + 1])) / 2
        got = int(quant.encode(np.array([mid], np.float32), fmt)[0])
        assert got == (lo if lo % 2 == 0 else lo + 1), (lo, got)


def test_any_cut_into_parts_gives_the_same_bytes() -> None:
    """Shards of any sizes (empty ones too), each quantizing its part with its
    blocks' scales agreed as the largest over the parts: the whole array's bytes."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(2000).astype(np.float32)
    whole = np.empty(x.shape, np.uint8)
    quant.quantize(x, 0, quant.block_max(x, 0), quant.SIGNED, whole)
    nblocks = quant.blocks_of(0, x.shape[0])[1]
    for _ in range(40):
        cuts = np.sort(rng.integers(0, x.shape[0] + 1, size=int(rng.integers(1, 9))))
        edges = [0, *cuts.tolist(), x.shape[0]]
        agreed = np.zeros(nblocks, np.float32)
        for lo, hi in pairwise(edges):
            first, stop = quant.blocks_of(lo, hi - lo)
            np.maximum(agreed[first:stop], quant.block_max(x[lo:hi], lo), out=agreed[first:stop])
        parts = np.empty_like(whole)
        for lo, hi in pairwise(edges):
            first, stop = quant.blocks_of(lo, hi - lo)
            quant.quantize(x[lo:hi], lo, agreed[first:stop], quant.SIGNED, parts[lo:hi])
        assert np.array_equal(parts, whole), f"cut at {edges}"


def test_the_8bit_reference_trains_like_float32_adam() -> None:
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((40, 30)).astype(np.float32),
              "b": rng.standard_normal(30).astype(np.float32)}  # fmt: skip
    hyper = {"lr": 1e-3, "weight_decay": 0.01, "decoupled_weight_decay": True}
    ref, ref8 = ReferenceAdam(params, **hyper), ReferenceAdam8bit(params, **hyper)
    target = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}

    def loss(opt: ReferenceAdam) -> float:
        return sum(float(np.sum((opt.params[n] - target[n]) ** 2)) for n in params) / 2

    start = loss(ref)
    for _ in range(200):
        for opt in (ref, ref8):
            opt.step({n: opt.params[n] - target[n] for n in params})
    gained, apart = start - loss(ref), abs(loss(ref8) - loss(ref))
    assert gained > 0.1 * start and apart < 0.05 * gained, (start, loss(ref), loss(ref8))
    q, scales = ref8.quantized["exp_avg_sq"]
    assert q.dtype == np.uint8 and scales.shape == (quant.blocks_of(0, 1230)[1],)
    stored = (q.nbytes + scales.nbytes) * 2
    assert stored / (1230 * 8) < 0.27  # Adam's two states: ~2 bytes an element, not 8


def sharded_8bit_steps(
    x0: np.ndarray, grads: list[np.ndarray], cuts: list[int], hyper: dict, kernel: str
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The flat parameters cut into pieces at ``cuts`` (a rank's shards, empty ones
    too), each stepped by :func:`zerompi.quant.adam8_step`, the scales of the blocks
    held in part agreed as the largest over the pieces, then quantized: the flat
    result and its states, laid end to end."""
    from zerompi.adam import AdamConfig

    config = AdamConfig(hyper["lr"], 0.9, 0.999, 1e-8, hyper["weight_decay"],
                        hyper["decoupled_weight_decay"])  # fmt: skip
    edges = [0, *cuts, x0.shape[0]]
    pieces = list(pairwise(edges))
    param = x0.copy()
    n = x0.shape[0]
    qm = np.zeros(n, np.uint8)
    qv = np.zeros(n, np.uint8)
    nb = quant.blocks_of(0, n)[1]
    sm = [np.zeros(np.subtract(*quant.blocks_of(lo, hi - lo)[::-1]), np.float32)
          for lo, hi in pieces]  # fmt: skip
    sv = [a.copy() for a in sm]
    for t, g in enumerate(grads, start=1):
        left = []
        for (lo, hi), m_s, v_s in zip(pieces, sm, sv, strict=True):
            kind, _, variant = kernel.partition(":")
            e = quant.adam8_step(param[lo:hi], g[lo:hi].copy(), qm[lo:hi], qv[lo:hi], m_s, v_s,
                                 lo, t, config, kernel=kind, variant=variant or None)  # fmt: skip
            left.append(e)
        agreed_m, agreed_v = np.zeros(nb, np.float32), np.zeros(nb, np.float32)
        for (lo, hi), e in zip(pieces, left, strict=True):
            first = quant.blocks_of(lo, hi - lo)[0]
            for (slot, _, _), (am, av) in zip(e.spans, quant.edge_maxima(e), strict=True):
                agreed_m[first + slot] = max(agreed_m[first + slot], am)
                agreed_v[first + slot] = max(agreed_v[first + slot], av)
        for (lo, hi), e, m_s, v_s in zip(pieces, left, sm, sv, strict=True):
            first = quant.blocks_of(lo, hi - lo)[0]
            agreed = [(agreed_m[first + s], agreed_v[first + s]) for s, _, _ in e.spans]
            quant.finish_edges(e, qm[lo:hi], qv[lo:hi], m_s, v_s, lo, agreed)
    scales_m, scales_v = np.zeros(nb, np.float32), np.zeros(nb, np.float32)
    for (lo, hi), m_s, v_s in zip(pieces, sm, sv, strict=True):
        first, stop = quant.blocks_of(lo, hi - lo)
        scales_m[first:stop], scales_v[first:stop] = m_s, v_s
    return param, {"exp_avg": (qm, scales_m), "exp_avg_sq": (qv, scales_v)}


def _kernels() -> list[str]:
    """``numpy``, and ``c:VARIANT`` for each compiled variant this CPU runs."""
    from zerompi import adam

    if adam._kernels is None or not hasattr(adam._kernels, "adam8"):
        return ["numpy"]
    return ["numpy", *(f"c:{v}" for v in adam._kernels.variants())]


@pytest.mark.parametrize("kernel", _kernels())
def test_8bit_adam_on_any_cut_is_the_reference_bit_for_bit(kernel: str) -> None:
    """Pieces cut anywhere (one, several, empty, inside one block), stepped each on
    its own with the partial blocks' scales agreed: the reference's parameters,
    bytes and scales exactly, three steps, with L2 and decoupled weight decay."""
    rng = np.random.default_rng(4)
    n = 3 * quant.BLOCK + 77
    x0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * 10.0**-k for k in range(3)]
    layouts = [[], [quant.BLOCK], [5, 5, 300, 301, 900], [n // 2], [1, 2, 3, n - 1]]
    for decoupled in (True, False):
        hyper = {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": decoupled}
        ref = ReferenceAdam8bit({"w": x0}, **hyper)
        for g in grads:
            ref.step({"w": g})
        for cuts in layouts:
            param, states = sharded_8bit_steps(x0, grads, cuts, hyper, kernel)
            assert np.array_equal(param, ref.params["w"]), f"params, cuts {cuts}"
            for label, (q, scales) in states.items():
                rq, rs = ref.quantized[label]
                assert np.array_equal(scales, rs), f"{label} scales, cuts {cuts}"
                assert np.array_equal(q, rq), f"{label} bytes, cuts {cuts}"


def test_the_compiled_step_names_a_wrong_array() -> None:
    """The kernel refuses an array of the wrong type or length, naming it."""
    from zerompi import adam

    if adam._kernels is None or not hasattr(adam._kernels, "adam8"):
        pytest.skip("the compiled kernels are not built")
    from zerompi.adam import AdamConfig

    n = quant.BLOCK
    good = {"param": np.zeros(n, np.float32), "grad": np.zeros(n, np.float32),
            "qm": np.zeros(n, np.uint8), "qv": np.zeros(n, np.uint8),
            "sm": np.zeros(1, np.float32), "sv": np.zeros(1, np.float32)}  # fmt: skip
    config = AdamConfig(1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    for name, bad in (("qm", np.zeros(n, np.float32)), ("sv", np.zeros(2, np.float32)),
                      ("param", np.zeros(n + 1, np.float32))):  # fmt: skip
        arrays = {**good, name: bad}
        with pytest.raises(ValueError, match=name):
            quant._adam8_compiled(*arrays.values(), 1, config, 1.0, quant.BLOCK, None)
