"""zerompi.comm.Comm: the in-place collectives with exact counts, and collective validation.

Every test runs on each communicator of the ``comm`` fixture (world, self, an uneven
split, the world reversed), so one ``mpiexec -n 4`` covers sizes 1 to 4. Rank ``r``'s
data is a deterministic function of ``r`` (small multiples of 1/8, so sums are exact),
which lets every rank compute the expected result of a collective on its own.
Totals smaller than the communicator give ranks with empty shards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import assert_all, assert_raises_all
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from zerompi import shard_counts
from zerompi.mpi.agreement import CollectiveError
from zerompi.mpi.collectives import Comm

TOTALS = [0, 1, 2, 3, 5, 7, 64, 1000]
DTYPES = [np.float32, np.float64]
GUARD = 4  # sentinel elements either side of a buffer: nothing may be written there


def rank_data(total: int, rank: int, dtype: type) -> np.ndarray:
    """Rank ``rank``'s contribution: multiples of 1/8 in [-2, 2], exact in any sum of
    a few of them, different on every rank."""
    i = np.arange(total)
    return np.asarray(((i * 7 + rank * 13 + 3) % 33 - 16) / 8, dtype=dtype)


def expected_sum(total: int, size: int, dtype: type) -> np.ndarray:
    return np.sum(np.stack([rank_data(total, r, dtype) for r in range(size)]), axis=0)


def guarded(total: int, dtype: type, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of ``total`` elements inside a larger array of sentinels, as the engine's
    buckets are slices of a larger flat buffer."""
    outer = np.full(total + 2 * GUARD, fill, dtype=dtype)
    return outer, outer[GUARD : GUARD + total]


def guards_intact(outer: np.ndarray, fill: float) -> bool:
    edges = np.concatenate([outer[:GUARD], outer[-GUARD:]])
    return bool(np.array_equal(edges, np.full(2 * GUARD, fill, dtype=outer.dtype), equal_nan=True))


def expect(should_raise: bool, exc_type: type[BaseException], match: str, fn: Callable[[], Any]):
    """Collective: ``fn()`` raises like :func:`assert_raises_all` if ``should_raise``, else
    must return normally. Exactly one COMM_WORLD collective either way, so ranks whose
    sub-communicators take different branches stay in step."""
    if should_raise:
        return assert_raises_all(exc_type, match, fn)
    try:
        fn()
    except Exception as exc:
        assert_all(False, f"expected no error, got {type(exc).__name__}: {exc}")
    else:
        assert_all(True)
    return None


# -- construction --------------------------------------------------------------------


def test_comm_wraps_the_communicator(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    assert_all(c.mpi is comm, "Comm.mpi is not the communicator it was given")
    assert_all(
        (c.rank, c.size) == (comm.Get_rank(), comm.Get_size()),
        f"rank/size {(c.rank, c.size)} vs {(comm.Get_rank(), comm.Get_size())}",
    )


def test_comm_defaults_to_world() -> None:
    c = Comm()
    assert_all(c.mpi == MPI.COMM_WORLD, "Comm() is not COMM_WORLD")
    assert_all((c.rank, c.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size), "rank/size")


def test_comm_rejects_non_intracommunicators() -> None:
    for bad in (MPI.COMM_NULL, "world", 0, np.zeros(2)):
        assert_raises_all(TypeError, "intracommunicator", lambda bad=bad: Comm(bad))


# -- reduce_scatter_inplace ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_reduce_scatter_inplace_is_exact(comm: MPI.Intracomm, dtype: type) -> None:
    c = Comm(comm)
    problems = []
    for total in TOTALS:
        counts, displs = shard_counts(total, c.size)
        outer, buf = guarded(total, dtype, np.nan)
        buf[...] = rank_data(total, c.rank, dtype)
        out = c.reduce_scatter_inplace(buf, counts)
        lo, n = displs[c.rank], counts[c.rank]
        want = expected_sum(total, c.size, dtype)[lo : lo + n]
        if out.shape != (n,) or out.dtype != np.dtype(dtype):
            problems.append(f"total={total}: result {out.shape} {out.dtype}, want ({n},) {dtype}")
        elif not np.array_equal(out, want):
            problems.append(f"total={total}: shard {lo}:{lo + n} is {out[:6]}.., want {want[:6]}..")
        # The result is the top of the caller's buffer, not a copy.
        if n and not (np.shares_memory(out, buf) and out.ctypes.data == buf.ctypes.data):
            problems.append(f"total={total}: result is not a view of the top of the buffer")
        if not guards_intact(outer, np.nan):
            problems.append(f"total={total}: wrote outside the buffer")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_reduce_scatter_then_allgatherv_is_an_allreduce(comm: MPI.Intracomm, dtype: type) -> None:
    """The engine's data path: reduce-scatter, move the shard to its place, gather."""
    c = Comm(comm)
    problems = []
    for total in TOTALS:
        counts, displs = shard_counts(total, c.size)
        outer, buf = guarded(total, dtype, -7.0)
        buf[...] = rank_data(total, c.rank, dtype)
        shard = c.reduce_scatter_inplace(buf, counts).copy()
        lo, n = displs[c.rank], counts[c.rank]
        buf[lo : lo + n] = shard
        c.allgatherv_inplace(buf, counts, displs)
        if not np.array_equal(buf, expected_sum(total, c.size, dtype)):
            problems.append(f"total={total}: wrong sum")
        if not guards_intact(outer, -7.0):
            problems.append(f"total={total}: wrote outside the buffer")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


# -- allgatherv_inplace --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_allgatherv_inplace_is_exact(comm: MPI.Intracomm, dtype: type) -> None:
    c = Comm(comm)
    problems = []
    for total in TOTALS:
        counts, displs = shard_counts(total, c.size)
        full = np.asarray(np.arange(total) * 0.5 - 3.25, dtype=dtype)
        outer, buf = guarded(total, dtype, np.nan)
        lo, n = displs[c.rank], counts[c.rank]
        buf[lo : lo + n] = full[lo : lo + n]  # everything else is NaN until received
        c.allgatherv_inplace(buf, counts, displs)
        if not np.array_equal(buf, full):
            problems.append(f"total={total}: gathered {buf[:6]}.., want {full[:6]}..")
        if not guards_intact(outer, np.nan):
            problems.append(f"total={total}: wrote outside the buffer")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


@settings(max_examples=25)
@given(
    counts4=st.lists(st.integers(min_value=0, max_value=6), min_size=4, max_size=4),
    dtype=st.sampled_from(DTYPES),
)
def test_collectives_with_arbitrary_counts(
    comm: MPI.Intracomm, counts4: list[int], dtype: type
) -> None:
    """Counts need not come from shard_counts: any non-negative counts, zeros anywhere.
    The drawn values never depend on the rank; the communicator uses its first
    ``size`` counts."""
    c = Comm(comm)
    counts = counts4[: c.size]
    displs = [sum(counts[:r]) for r in range(c.size)]
    total = sum(counts)
    lo, n = displs[c.rank], counts[c.rank]

    outer, buf = guarded(total, dtype, np.nan)
    buf[...] = rank_data(total, c.rank, dtype)
    out = c.reduce_scatter_inplace(buf, counts)
    ok_rs = bool(np.array_equal(out, expected_sum(total, c.size, dtype)[lo : lo + n]))

    full = np.asarray(np.arange(total) - 2.5, dtype=dtype)
    buf[...] = np.nan
    buf[lo : lo + n] = full[lo : lo + n]
    c.allgatherv_inplace(buf, counts, displs)
    ok_ag = bool(np.array_equal(buf, full))
    assert_all(
        ok_rs and ok_ag and guards_intact(outer, np.nan),
        f"counts={counts}: reduce_scatter ok={ok_rs}, allgatherv ok={ok_ag}",
    )


# -- bcast_inplace --------------------------------------------------------------------------


def test_bcast_inplace(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    problems = []
    for dtype, total, root in itertools.product(DTYPES, [0, 1, 3, 1000], [0, c.size - 1]):
        outer, buf = guarded(total, dtype, 11.0)
        buf[...] = rank_data(total, c.rank, dtype)
        if root == 0:
            c.bcast_inplace(buf)  # root defaults to 0
        else:
            c.bcast_inplace(buf, root=root)
        if not np.array_equal(buf, rank_data(total, root, dtype)):
            problems.append(f"{np.dtype(dtype)} total={total}: not root {root}'s data")
        if not guards_intact(outer, 11.0):
            problems.append(f"{np.dtype(dtype)} total={total}: wrote outside the buffer")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


def test_bcast_inplace_moves_any_dtype(comm: MPI.Intracomm) -> None:
    """A torch module's buffers are often integers or booleans (BERT's
    ``position_ids``, masks): ``shard()`` broadcasts them from rank 0 as bytes."""
    c = Comm(comm)
    problems = []
    for dtype in (np.int64, np.int32, np.bool_, np.uint8, np.complex64):
        for shape in [(0,), (5,), (3, 4)]:
            root = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
            buf = root.copy() if c.rank == 0 else np.full(shape, c.rank % 2, dtype=dtype)
            c.bcast_inplace(buf)
            if not np.array_equal(buf, root):
                problems.append(f"{np.dtype(dtype)} {shape}: not root's data")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


def test_bcast_object(comm: MPI.Intracomm) -> None:
    """Root's picklable object on every rank, from every root; an object root cannot
    pickle raises on every rank (no rank left waiting)."""
    c = Comm(comm)
    problems = []
    for root in range(c.size):
        got = c.bcast_object({"root": root, "rank": c.rank, "data": list(range(root))}, root)
        if got != {"root": root, "rank": root, "data": list(range(root))}:
            problems.append(f"root {root}: got {got!r:.80}")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))
    with pytest.raises(CollectiveError, match="could not pickle"):
        c.bcast_object(lambda: None if c.rank == 0 else 1, root=0)


def test_bcast_inplace_refuses_a_strided_array(comm: MPI.Intracomm) -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        Comm(comm).bcast_inplace(np.zeros((4, 4))[:, 1])


# -- small collectives --------------------------------------------------------------------


def test_allgather_max_sum(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    gathered = c.allgather(("r", c.rank))
    ok = gathered == [("r", r) for r in range(c.size)]
    ok = ok and c.max(float(c.rank)) == c.size - 1
    ok = ok and c.sum(c.rank + 1) == c.size * (c.size + 1) // 2
    c.barrier()
    assert_all(ok, f"allgather/max/sum wrong on a communicator of {c.size}")


# -- agree ----------------------------------------------------------------------------------


def where(ranks: list[int], size: int, others: int = 0) -> str:
    """The suffix agree() appends, built independently from its documented wording."""
    if len(ranks) == size > 1:
        text = f"on all {size} ranks"
    else:
        text = f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {size}"
    if others:
        text += f"; {others} other rank(s) failed differently"
    return f"({text})"


def test_agree_passes_when_no_rank_fails(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    expect(False, Exception, "", lambda: c.agree(None))


@pytest.mark.parametrize("failing", ["first", "last"])
def test_agree_raises_a_type_error_everywhere(comm: MPI.Intracomm, failing: str) -> None:
    c = Comm(comm)
    bad = 0 if failing == "first" else c.size - 1
    error = TypeError("param 'w' has dtype int64") if c.rank == bad else None
    exc = assert_raises_all(TypeError, "param 'w' has dtype int64", lambda: c.agree(error))
    suffix = where([bad], c.size)
    assert_all(
        type(exc) is TypeError and str(exc).endswith(suffix),
        f"got {type(exc).__name__}: {exc!s}; want a TypeError ending with {suffix!r}",
    )


@pytest.mark.parametrize("kind", [ValueError, RuntimeError, KeyError])
def test_agree_raises_a_collective_error_for_other_errors(
    comm: MPI.Intracomm, kind: type[Exception]
) -> None:
    c = Comm(comm)
    bad = c.size - 1
    error = kind("lr must be > 0, got -1.0") if c.rank == bad else None
    exc = assert_raises_all(CollectiveError, "lr must be > 0, got -1.0", lambda: c.agree(error))
    suffix = where([bad], c.size)
    assert_all(
        isinstance(exc, ValueError) and str(exc).endswith(suffix),
        f"{exc!s} does not end with {suffix!r}",
    )


def test_agree_names_every_rank_with_the_same_error(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    failing = [r for r in range(c.size) if r % 2 == 0]  # 0, 2, ...
    error = ValueError("bad layout") if c.rank in failing else None
    exc = assert_raises_all(ValueError, "bad layout", lambda: c.agree(error))
    assert_all(
        str(exc) == f"bad layout {where(failing, c.size)}",
        f"got {exc!s}, want 'bad layout {where(failing, c.size)}'",
    )


def test_agree_reports_the_first_failing_rank_and_counts_the_others(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    # Every rank fails differently; the first failing rank (0) is the one reported,
    # and its error type (TypeError) is kept even though the others are ValueErrors.
    error: Exception = (
        TypeError("rank 0 is broken") if c.rank == 0 else ValueError(f"rank {c.rank} too")
    )
    exc = assert_raises_all(TypeError, "rank 0 is broken", lambda: c.agree(error))
    want = f"rank 0 is broken {where([0], c.size, c.size - 1)}"
    assert_all(str(exc) == want, f"got {exc!s}, want {want!r}")


# -- check_same -----------------------------------------------------------------------------


def test_check_same_passes_on_equal_values(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    expect(False, Exception, "", lambda: c.check_same([("w", (3, 4), "<f4"), 1.5], "layout"))


@pytest.mark.parametrize("odd", ["first", "last"])
def test_check_same_names_the_first_differing_item(comm: MPI.Intracomm, odd: str) -> None:
    c = Comm(comm)
    odd_rank = 0 if odd == "first" else c.size - 1
    items = ["a", ("b", (2, 3)), "c", "d"]
    if c.rank == odd_rank:
        items = ["a", ("b", (2, 3)), "X", "Y"]  # items 2 and 3 differ; 2 comes first
    # The reference is rank 0: if rank 0 is the odd one out, rank 1 is the first to differ.
    other = c.size - 1 if odd == "last" else 1
    first, second = ("'c'", "'X'") if odd == "last" else ("'X'", "'c'")
    want = (
        "the layout differs between ranks: "
        f"item 2 is {first} on rank 0 but {second} on rank {other}"
    )
    exc = expect(c.size > 1, CollectiveError, want, lambda: c.check_same(items, "the layout"))
    if c.size > 1:
        assert_all(str(exc) == want, f"got {exc!s}, want {want!r}")
    else:
        assert_all(True)


def test_check_same_reports_different_lengths(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    last = c.size - 1
    items = [1, 2, 3] + ([4] if c.rank == last else [])
    want = f"names differs between ranks: rank 0 has 3 items, rank {last} has 4"
    expect(c.size > 1, CollectiveError, want, lambda: c.check_same(items, "names"))


def test_check_same_reports_different_scalars(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    last = c.size - 1
    value = 0.002 if c.rank == last else 0.001
    want = f"lr differs between ranks: rank 0 has 0.001, rank {last} has 0.002"
    expect(c.size > 1, CollectiveError, want, lambda: c.check_same(value, "lr"))


def test_check_same_shortens_huge_values(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    last = c.size - 1
    value = "x" * 10_000 + ("!" if c.rank == last else "")
    exc = expect(c.size > 1, CollectiveError, "...", lambda: c.check_same(value, "blob"))
    assert_all(exc is None or len(str(exc)) < 1000, "message is not shortened")


def test_inplace_collectives_refuse_counts_that_do_not_fit(comm: MPI.Intracomm) -> None:
    """MPI does not bounds-check in-place buffers: a count past the end would write
    into whatever memory follows. Comm refuses before any rank enters the collective
    (the counts are the same on every rank, so every rank refuses)."""
    c = Comm(comm)
    outer = np.full(8 + c.size, -1.0)
    buf = outer[:4]
    counts, displs = [5] * c.size, [5 * r for r in range(c.size)]
    assert_raises_all(ValueError, "do not fit a buffer of 4 elements",
                      lambda: c.allgatherv_inplace(buf, counts, displs))
    assert_raises_all(ValueError, "do not sum to the 4 elements",
                      lambda: c.reduce_scatter_inplace(buf, [5] + [0] * (c.size - 1)))
    assert_all(bool(np.all(outer == -1.0)), f"buffer written: {outer}")


# -- nonblocking: ireduce_scatter, iallgatherv, iallreduce ---------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_nonblocking_collectives_in_flight_together(comm: MPI.Intracomm, dtype: type) -> None:
    """Every total at once, all started before any completes (as the engine keeps one
    bucket's reduction in flight while the next fills): reduce-scatter in place and
    into a separate shard, allgatherv and allreduce, each exact, nothing written
    outside its buffer, results delivered by wait()."""
    c = Comm(comm)
    problems = []
    started = []
    for total in TOTALS:
        counts, displs = shard_counts(total, c.size)
        lo, n = displs[c.rank], counts[c.rank]
        rs_outer, rs = guarded(total, dtype, np.nan)
        rs[...] = rank_data(total, c.rank, dtype)
        to_outer, to_buf = guarded(total, dtype, np.nan)
        to_buf[...] = rank_data(total, c.rank, dtype)
        shard_outer, shard = guarded(n, dtype, np.nan)
        full = np.asarray(np.arange(total) * 0.5 - 3.25, dtype=dtype)
        ag_outer, ag = guarded(total, dtype, np.nan)
        ag[lo : lo + n] = full[lo : lo + n]
        ar_outer, ar = guarded(total, dtype, np.nan)
        ar[...] = rank_data(total, c.rank, dtype)
        pending = [
            c.ireduce_scatter(rs, counts),
            c.ireduce_scatter(to_buf, counts, out=shard),
            c.iallgatherv(ag, counts, displs),
            c.iallreduce(ar),
        ]
        c.progress(pending)
        started.append((total, lo, n, pending, (rs_outer, to_outer, shard_outer, ag_outer,
                                                ar_outer), full))  # fmt: skip
    c.wait_all([p for *_, pending, _, _ in started for p in pending])
    for total, lo, n, pending, outers, full in started:
        want = expected_sum(total, c.size, dtype)
        got_rs, got_shard = pending[0].wait(), pending[1].wait()
        if got_rs.shape != (n,) or not np.array_equal(got_rs, want[lo : lo + n]):
            problems.append(f"total={total}: in-place reduce-scatter {got_rs[:6]}")
        if not np.array_equal(got_shard, want[lo : lo + n]):
            problems.append(f"total={total}: reduce-scatter into out {got_shard[:6]}")
        if not np.array_equal(pending[2].wait(), full):
            problems.append(f"total={total}: allgatherv {pending[2].result[:6]}")
        if not np.array_equal(pending[3].wait(), want):
            problems.append(f"total={total}: allreduce {pending[3].result[:6]}")
        if not all(p.test() for p in pending):
            problems.append(f"total={total}: not done after wait")
        if not all(guards_intact(outer, np.nan) for outer in outers):
            problems.append(f"total={total}: wrote outside a buffer")
    assert_all(not problems, f"size {c.size}: " + "; ".join(problems))


def test_nonblocking_collectives_count_traffic_like_blocking(comm: MPI.Intracomm) -> None:
    c = Comm(comm)
    counts, displs = shard_counts(1000, c.size)
    buf = np.zeros(1000)
    c.reduce_scatter_inplace(buf, counts)
    c.allgatherv_inplace(buf, counts, displs)
    c.allreduce_inplace(buf)
    blocking = c.pop_traffic()
    c.wait_all([c.ireduce_scatter(buf, counts), c.iallgatherv(buf, counts, displs),
                c.iallreduce(buf)])  # fmt: skip
    assert_all(c.pop_traffic() == blocking, "traffic differs")


def test_nonblocking_collectives_refuse_bad_buffers(comm: MPI.Intracomm) -> None:
    """Checked before MPI is entered, identically on every rank."""
    c = Comm(comm)
    buf = np.zeros(4)
    counts, displs = [5] * c.size, [5 * r for r in range(c.size)]
    assert_raises_all(ValueError, "do not fit a buffer of 4 elements",
                      lambda: c.iallgatherv(buf, counts, displs))  # fmt: skip
    assert_raises_all(ValueError, "do not sum to the 4 elements",
                      lambda: c.ireduce_scatter(buf, [5] + [0] * (c.size - 1)))  # fmt: skip
    counts4, _ = shard_counts(4, c.size)
    assert_raises_all(ValueError, "out must be",
                      lambda: c.ireduce_scatter(buf, counts4, out=np.zeros(9)))  # fmt: skip
    assert_raises_all(ValueError, "out must be", lambda: c.ireduce_scatter(
        buf, counts4, out=np.zeros(counts4[c.rank], np.float32)))  # fmt: skip
