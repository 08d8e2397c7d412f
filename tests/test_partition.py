"""shard_range, bucket planning and layouts: pure functions, the same on every rank.

Ports the intent of the reference's tests (zero_utils.rs): shards are disjoint and
cover every element in rank order, a shard is smaller than the global tensor, gather
round-trips, gradients are sharded and not rescaled, trailing ranks own nothing,
oversized items get a bucket of their own.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerompi import Layout, gather_shards, plan_buckets, shard, shard_counts, shard_range

#: Pure functions: under mpiexec each rank would only repeat the serial run's work.
pytestmark = pytest.mark.mpi_skip

totals = st.integers(min_value=0, max_value=10_000)
worlds = st.integers(min_value=1, max_value=64)


@given(totals, worlds)
def test_shards_are_disjoint_contiguous_and_cover(total: int, world: int) -> None:
    ranges = [shard_range(total, world, r) for r in range(world)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == total
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start  # contiguous, in rank order, no overlap
    assert sum(e - s for s, e in ranges) == total


@given(totals, worlds)
def test_ceil_div_sizes_and_trailing_ranks_empty(total: int, world: int) -> None:
    per_rank = -(-total // world)
    sizes = [e - s for s, e in (shard_range(total, world, r) for r in range(world))]
    assert all(size <= per_rank for size in sizes)
    # Sizes never grow with rank: full shards, at most one partial, then empty ones.
    assert sizes == sorted(sizes, reverse=True)
    assert sum(1 for s in sizes if 0 < s < per_rank) <= 1
    if total >= world:
        assert sizes[0] == per_rank


@given(totals, worlds)
def test_shard_counts_match_shard_range(total: int, world: int) -> None:
    counts, displs = shard_counts(total, world)
    assert len(counts) == len(displs) == world
    for r in range(world):
        assert shard_range(total, world, r) == (displs[r], displs[r] + counts[r])


def test_trailing_ranks_may_own_nothing() -> None:
    assert shard_range(3, 4, 3) == (3, 3)
    assert shard_range(3, 4, 0) == (0, 1)
    assert shard_range(0, 3, 2) == (0, 0)
    assert shard_counts(3, 4) == ([1, 1, 1, 0], [0, 1, 2, 3])
    assert shard_counts(10, 4) == ([3, 3, 3, 1], [0, 3, 6, 9])
    assert shard_counts(9, 6) == ([2, 2, 2, 2, 1, 0], [0, 2, 4, 6, 8, 9])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((3, 0, 0), "world_size must be >= 1, got 0"),
        ((3, -2, 0), "world_size must be >= 1, got -2"),
        ((3, 2, 2), "rank 2 is out of range for world_size 2"),
        ((3, 2, -1), "rank -1 is out of range for world_size 2"),
        ((-1, 2, 0), "total must be >= 0, got -1"),
    ],
)
def test_shard_range_rejects_bad_values(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shard_range(*args)


@pytest.mark.parametrize("args", [(3.0, 2, 0), (3, "2", 0), (3, 2, True), (None, 1, 0)])
def test_shard_range_rejects_non_integers(args: tuple) -> None:
    with pytest.raises(TypeError, match="must be an integer"):
        shard_range(*args)


def test_numpy_integers_are_accepted() -> None:
    assert shard_range(np.int64(10), np.int32(4), np.uint8(3)) == (9, 10)


def test_shards_are_disjoint_and_cover_every_element() -> None:
    w = np.arange(10, dtype=np.float32)
    shards = [shard(w, 4, r) for r in range(4)]
    assert sum(s.size for s in shards) == 10
    np.testing.assert_array_equal(np.concatenate(shards), w)


def test_each_shard_is_smaller_than_the_global_tensor() -> None:
    w = np.ones((4, 4), dtype=np.float32)
    s = shard(w, 4, 1)
    assert s.shape == (4,)
    assert shard_range(16, 4, 1) == (4, 8)
    # A copy that owns only its own elements, not a view keeping the whole alive.
    assert s.base is None and s.nbytes == 4 * 4
    assert not np.shares_memory(s, w)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 12, 13, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gather_round_trips_the_original_tensor(world: int, dtype: type) -> None:
    original = (np.arange(12, dtype=dtype) * 0.5).reshape(3, 4)
    gathered = gather_shards([shard(original, world, r) for r in range(world)], (3, 4))
    assert gathered.shape == original.shape and gathered.dtype == original.dtype
    np.testing.assert_array_equal(gathered, original)


def test_gather_rejects_wrong_element_count() -> None:
    with pytest.raises(ValueError, match=r"gathered 3 elements but the global shape \(2, 2\)"):
        gather_shards([np.zeros(2), np.zeros(1)], (2, 2))


def test_gradients_are_sharded_not_rescaled() -> None:
    g = np.full(8, 2.0, dtype=np.float32)
    local = shard(g, 2, 0)
    assert local.size == 4, "the shard must be half the gradient"
    assert np.all(local == 2.0), "values are copied verbatim, not scaled by 1/world_size"


def test_plan_buckets_matches_reference_example() -> None:
    sizes = [100, 200, 150, 300, 50]
    buckets = plan_buckets(sizes, 400)
    assert buckets == [[0, 1], [2], [3, 4]]


@given(st.lists(st.integers(min_value=0, max_value=50), max_size=30), st.integers(1, 60))
def test_plan_buckets_properties(sizes: list[int], target: int) -> None:
    buckets = plan_buckets(sizes, target)
    # Every item exactly once, in order, no empty bucket.
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for bucket in buckets:
        total = sum(sizes[i] for i in bucket)
        assert total <= target or len(bucket) == 1, "only a lone oversized item may exceed"
    # Greedy: the next bucket's first item would not have fit in the previous bucket.
    for prev, nxt in itertools.pairwise(buckets):
        assert sum(sizes[i] for i in prev) + sizes[nxt[0]] > target


def test_plan_buckets_rejects_bad_target() -> None:
    with pytest.raises(ValueError, match="bucket target must be >= 1 element, got 0"):
        plan_buckets([1, 2], 0)


SPECS = [
    ("a", (3, 4), np.dtype(np.float32)),
    ("b", (5,), np.dtype(np.float64)),
    ("c", (2, 2), np.dtype(np.float32)),
    ("d", (1,), np.dtype(np.float32)),
    ("e", (7,), np.dtype(np.float64)),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 40])
@pytest.mark.parametrize("bucket_elems", [1, 5, 13, 10_000])
def test_layout_buckets_shard_every_element_once(world: int, bucket_elems: int) -> None:
    layouts = [Layout.build(SPECS, world, r, bucket_elems) for r in range(world)]
    ref = layouts[0]
    assert ref.sizes == {np.dtype(np.float32): 17, np.dtype(np.float64): 12}
    # Parameters of a dtype are packed in mapping order, without gaps.
    f32 = [p for p in ref.params if p.dtype == np.float32]
    assert [(p.name, p.offset) for p in f32] == [("a", 0), ("c", 12), ("d", 16)]
    for dtype, size in ref.sizes.items():
        buckets = [b for b in ref.buckets if b.dtype == dtype]
        assert buckets[0].start == 0 and buckets[-1].stop == size
        assert all(b.stop == n.start for b, n in itertools.pairwise(buckets))
        for b in buckets:
            assert (list(b.counts), list(b.displs)) == shard_counts(b.size, world)
        # Each rank's shards of a dtype are packed into its shard buffer in order.
        for r, layout in enumerate(layouts):
            mine = [b for b in layout.buckets if b.dtype == dtype]
            offsets = [b.shard_offset for b in mine]
            assert offsets == list(np.cumsum([0] + [b.counts[r] for b in mine[:-1]]))
            assert layout.shard_sizes[dtype] == sum(b.counts[r] for b in mine)
        # Over all ranks the shards add up to the whole: no padding, no duplicates.
        assert sum(layout.shard_sizes[dtype] for layout in layouts) == size


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 40])
@pytest.mark.parametrize("bucket_elems", [1, 5, 13, 10_000])
def test_a_layout_for_another_rank_is_the_one_built_there(world: int, bucket_elems: int) -> None:
    """``for_rank`` (what the estimator uses for the other ranks of a world) gives
    exactly the layout that rank builds itself: every field, shard offsets included."""
    first = Layout.build(SPECS, world, 0, bucket_elems)
    for r in range(world):
        assert first.for_rank(r) == Layout.build(SPECS, world, r, bucket_elems)
    if world > 1:  # (a field that differs makes them unequal: the check can fail)
        assert first.for_rank(world - 1) != first
    with pytest.raises(ValueError, match=f"rank {world} is out of range"):
        first.for_rank(world)


def test_layout_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank 3 is out of range for world_size 3"):
        Layout.build(SPECS, 3, 3, 16)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 40])
@pytest.mark.parametrize("bucket_elems", [1, 5, 13, 10_000])
def test_a_per_block_state_is_counted_as_its_slots_add_up(world: int, bucket_elems: int) -> None:
    """``blockwise.count`` of a state of one span (per block: computed for all buckets
    at once) is the sum of the :func:`zerompi.blockwise.slots` the optimizer lays out,
    on every rank (empty shards among them) and stage, for blocks of several sizes."""
    from zerompi import blockwise
    from zerompi.buffers import StateKind

    for stage in (0, 1, 3):
        for block in (1, 2, 3, 8, 64):
            kind = StateKind("scales", per="block", block=block)
            for r in range(world):
                layout = Layout.build(SPECS, world, r, bucket_elems, merge=stage != 3)
                for dtype in layout.sizes:
                    spans = blockwise.spans_of(kind, layout, dtype)
                    slots = blockwise.slots(layout, stage, dtype, spans)
                    assert blockwise.count(layout, stage, dtype, spans) == sum(
                        s.count for s in slots
                    ), (stage, block, r, dtype)


@given(st.lists(st.integers(0, 40), max_size=12), st.integers(0, 40), st.integers(0, 40))
def test_gaps_are_the_rest_of_the_range(cuts: list[int], lo: int, hi: int) -> None:
    """:func:`zerompi.partition.gaps`: the pieces of ``[lo, hi)`` outside sorted
    disjoint spans (some reaching beyond it, some empty ranges included) are
    disjoint, in order, non-empty, and cover exactly the elements no span holds (an
    empty span may split a piece in two)."""
    from zerompi.partition import gaps

    edges = sorted(cuts)
    spans = [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2)]
    held = {x for a, b in spans for x in range(a, b)}
    pieces = list(gaps(spans, lo, hi))
    assert all(a < b for a, b in pieces)
    assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(pieces))
    assert [x for a, b in pieces for x in range(a, b)] == [
        x for x in range(lo, hi) if x not in held
    ]
