"""How flat data is split across ranks: the whole partition story in one function.

Every sharded object in zerompi (a bucket of parameters, its gradient, its Adam
moments) is a flat vector of ``total`` elements. Rank ``r`` of ``W`` owns the
contiguous slice ``shard_range(total, W, r)``: ceil-div slices, so trailing ranks
may own nothing. The slices are disjoint and cover ``[0, total)`` exactly, which is
what lets collectives use exact variable counts with no padding, and what makes a
checkpoint of the global vectors independent of the world size.

This module is pure Python + numpy (no MPI) so that layouts for any world size can
be built and checked in a single process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

#: dtypes zerompi shards. Adam on integers or float16 master weights is not offered.
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """Half-open element range ``[start, end)`` of the flat data owned by ``rank``.

    Rank ``r`` owns ``[r*c, min((r+1)*c, total))`` clamped to ``total``, with
    ``c = ceil(total / world_size)``. Trailing ranks may own an empty range.

    Raises ``ValueError`` naming the value for ``world_size < 1``, ``rank`` outside
    ``[0, world_size)`` or a negative ``total``.
    """
    total = _check_int("total", total)
    world_size = _check_int("world_size", world_size)
    rank = _check_int("rank", rank)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    per_rank = -(-total // world_size)
    return min(rank * per_rank, total), min((rank + 1) * per_rank, total)


def shard_counts(total: int, world_size: int) -> tuple[list[int], list[int]]:
    """Counts and displacements of every rank's shard: the arguments of
    ``Reduce_scatter(recvcounts=...)`` and ``Allgatherv``; :func:`shard_range` of every
    rank (checked as it checks), computed for all ranks at once (a layout of 2048
    ranks asks this for every bucket)."""
    shard_range(total, world_size, 0)  # (the same errors, naming the value)
    per_rank = -(-int(total) // int(world_size))
    edges = np.minimum(np.arange(int(world_size) + 1, dtype=np.int64) * per_rank, int(total))
    return np.diff(edges).tolist(), edges[:-1].tolist()


@lru_cache(maxsize=256)
def _shared_counts(total: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`shard_counts` as tuples, one pair for every bucket of the same size: the
    buckets of a large model are mostly of one size, so a layout of thousands of
    ranks holds their counts once (an estimate at 2048 ranks built them per bucket)."""
    counts, displs = shard_counts(total, world_size)
    return tuple(counts), tuple(displs)


def gaps(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """The pieces of ``[lo, hi)`` outside ``spans`` (sorted, disjoint; they may reach
    beyond ``[lo, hi)``), in order."""
    for start, stop in spans:
        if start >= hi:
            break
        if start > lo:
            yield lo, start
        lo = max(lo, stop)
    if lo < hi:
        yield lo, hi


def plan_buckets(sizes: Sequence[int], target: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``target`` elements.

    Greedy and order-preserving; an item larger than ``target`` gets a bucket of its
    own (the reference's ``calculate_bucket_size``). Returns lists of item indices.
    """
    target = _check_int("target", target)
    if target < 1:
        raise ValueError(f"bucket target must be >= 1 element, got {target}")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_size = 0
    for i, size in enumerate(sizes):
        if current and current_size + size > target:
            buckets.append(current)
            current, current_size = [], 0
        current.append(i)
        current_size += size
    if current:
        buckets.append(current)
    return buckets


def shard(array: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """``rank``'s slice of ``array`` flattened, as a copy that owns only its elements.

    Values are copied verbatim (a gradient shard is not rescaled by ``1/W``).
    """
    flat = np.asarray(array).reshape(-1)
    start, end = shard_range(flat.size, world_size, rank)
    return flat[start:end].copy()


def gather_shards(shards: Sequence[np.ndarray], shape: Sequence[int]) -> np.ndarray:
    """Concatenate shards given in rank order and reshape: the inverse of :func:`shard`."""
    flat = np.concatenate([np.asarray(s).reshape(-1) for s in shards])
    expected = int(np.prod(shape, dtype=np.int64))
    if flat.size != expected:
        raise ValueError(
            f"gathered {flat.size} elements but the global shape {tuple(shape)} needs {expected}"
        )
    return flat.reshape(shape)


@dataclass(frozen=True)
class Deferred:
    """A parameter described by shape and dtype, made by ``init()`` only when and where
    it is needed: on rank 0 alone, one bucket at a time. This is what lets a stage-3
    model larger than one rank's memory be built without ever holding it whole.

    ``release()``, if given, is called on every rank once the optimizer holds the
    value (after its bucket's broadcast), before the optimizer touches the pages of
    its other buffers: the caller's copy (a module's own parameter) can be freed
    there, so the caller's copy and the optimizer state never coexist in full. An
    exception from it is raised on every rank when the optimizer is built. Every
    check of the arguments comes before the first release; a failure after it (an
    ``init`` that raises on a later bucket) leaves the earlier values released."""

    shape: tuple[int, ...]
    dtype: np.dtype
    init: Callable[[], np.ndarray]
    release: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"Deferred shape {self.shape} has a negative dimension")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def materialize(self, name: str) -> np.ndarray:
        value = self.init()
        if not isinstance(value, np.ndarray) or value.shape != self.shape:
            raise ValueError(
                f"init of parameter {name!r} returned {type(value).__name__} of shape "
                f"{getattr(value, 'shape', None)}, expected an array of shape {self.shape}"
            )
        return value


@dataclass(frozen=True)
class ParamSpec:
    """Where one named parameter lives in its dtype's flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    size: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous run ``[start, stop)`` of one dtype's flat buffer, sharded over
    all ranks: the unit of every collective."""

    dtype: np.dtype
    start: int
    stop: int
    names: tuple[str, ...]
    counts: tuple[int, ...]
    displs: tuple[int, ...]
    shard_offset: int  # where this rank's shard of the bucket starts in the shard buffer

    @property
    def size(self) -> int:
        return self.stop - self.start

    def local(self, rank: int) -> tuple[int, int]:
        """This rank's shard as a range relative to the bucket start."""
        return self.displs[rank], self.displs[rank] + self.counts[rank]


def default_group(name: str) -> str:
    """The module a parameter belongs to: ``"layer0.weight"`` -> ``"layer0"``.
    Consecutive parameters of one group and one dtype always share a bucket (a group
    whose parameters are interleaved with another's, or of two dtypes, spans several)."""
    return name.rpartition(".")[0] or name


@dataclass(frozen=True)
class Layout:
    """The flat layout of a model on one rank of a world of ``world_size``.

    Parameters of each dtype are packed, in the mapping's order, into one flat
    buffer per dtype. Consecutive parameters of the same group (a layer) form a unit
    that is never split; units are packed into buckets (:func:`plan_buckets`, or one
    unit per bucket when ``merge`` is false) and each bucket is sharded with
    :func:`shard_range`. ``shard_sizes[dtype]`` is the length of this rank's
    concatenated shards of that dtype.
    """

    world_size: int
    rank: int
    params: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    sizes: Mapping[np.dtype, int]
    shard_sizes: Mapping[np.dtype, int]
    groups: Mapping[str, tuple[str, ...]]  # group -> its parameter names, in order
    bucket_of: Mapping[str, int]  # parameter name -> index into buckets

    @classmethod
    def build(
        cls,
        specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
        world_size: int,
        rank: int,
        bucket_elems: int,
        group_keys: Sequence[str] | None = None,
        merge: bool = True,
    ) -> Layout:
        shard_range(0, world_size, rank)  # validates world_size and rank
        if group_keys is None:
            group_keys = [name for name, _, _ in specs]
        key_of = {name: key for (name, _, _), key in zip(specs, group_keys, strict=True)}
        params: list[ParamSpec] = []
        buckets: list[Bucket] = []
        sizes: dict[np.dtype, int] = {}
        shard_sizes: dict[np.dtype, int] = {}
        dtypes = list(dict.fromkeys(np.dtype(d) for _, _, d in specs))
        for dtype in dtypes:
            group = [(n, tuple(s)) for n, s, d in specs if np.dtype(d) == dtype]
            first = len(params)
            offset = 0
            for name, shape in group:
                size = int(np.prod(shape, dtype=np.int64))
                params.append(ParamSpec(name, shape, dtype, offset, size))
                offset += size
            sizes[dtype] = offset
            mine = params[first:]
            # Units: runs of consecutive parameters of one group.
            units: list[list[ParamSpec]] = []
            for spec in mine:
                if units and key_of[units[-1][-1].name] == key_of[spec.name]:
                    units[-1].append(spec)
                else:
                    units.append([spec])
            unit_sizes = [sum(p.size for p in unit) for unit in units]
            shard_offset = 0
            for members in plan_buckets(unit_sizes, bucket_elems if merge else 1):
                specs_in = [p for i in members for p in units[i]]
                start = specs_in[0].offset
                stop = specs_in[-1].offset + specs_in[-1].size
                counts, displs = _shared_counts(stop - start, world_size)
                buckets.append(
                    Bucket(
                        dtype, start, stop, tuple(p.name for p in specs_in), counts, displs,
                        shard_offset,
                    )
                )  # fmt: skip
                shard_offset += counts[rank]
            shard_sizes[dtype] = shard_offset
        groups: dict[str, tuple[str, ...]] = {}
        for name, _, _ in specs:
            groups[key_of[name]] = (*groups.get(key_of[name], ()), name)
        bucket_of = {name: i for i, b in enumerate(buckets) for name in b.names}
        return cls(
            world_size, rank, tuple(params), tuple(buckets), sizes, shard_sizes, groups, bucket_of
        )

    def for_rank(self, rank: int) -> Layout:
        """The same layout on ``rank`` of the same world: its buckets and counts
        shared with this one (nothing recomputed), that rank's shard offsets and
        sizes. What an estimate of every rank of a large world builds once."""
        if rank == self.rank:
            return self
        shard_range(0, self.world_size, rank)  # validates rank
        offsets = dict.fromkeys(self.sizes, 0)
        buckets = []
        for b in self.buckets:  # (the constructor: dataclasses.replace is slower)
            buckets.append(Bucket(b.dtype, b.start, b.stop, b.names, b.counts, b.displs,
                                  offsets[b.dtype]))  # fmt: skip
            offsets[b.dtype] += b.counts[rank]
        return Layout(self.world_size, rank, self.params, tuple(buckets), self.sizes, offsets,
                      self.groups, self.bucket_of)  # fmt: skip

    def max_bucket(self, dtype: np.dtype) -> int:
        """Elements of the largest bucket of ``dtype``: the size of a staging buffer."""
        return max((b.size for b in self.buckets if b.dtype == dtype), default=0)

    def max_part(self, dtype: np.dtype) -> int:
        """Elements of the largest shard of any bucket of ``dtype`` on any rank: what
        a 16-bit reduction receives from each rank."""
        # rank 0's shard of a bucket is its largest (shard_range: ceil-division)
        return max((b.counts[0] for b in self.buckets if b.dtype == dtype), default=0)


#: Default bucket size in elements (16 MiB of float32): large enough that the
#: per-collective latency is negligible, small enough to bound staging buffers.
DEFAULT_BUCKET_ELEMS = 1 << 22

#: 0 is plain data parallelism (nothing sharded), 1-3 the ZeRO stages.
STAGES = (0, 1, 2, 3)


def optimizer_layout(
    specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
    world_size: int,
    rank: int,
    stage: int,
    bucket_elems: int,
    group_of: Callable[[str], str] = default_group,
) -> Layout:
    """The layout a ``ZeroOptimizer`` of ``stage`` uses, after checking its arguments:
    stage 3 gathers one group at a time, so there a bucket is exactly one group;
    stages 0-2 merge consecutive groups into buckets of up to ``bucket_elems``."""
    if type(stage) is not int or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if isinstance(bucket_elems, bool) or not isinstance(bucket_elems, (int, np.integer)):
        raise TypeError(f"bucket_elems must be an integer, got {bucket_elems!r}")
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems!r}")
    keys = [group_of(name) for name, _, _ in specs]
    for (name, _, _), key in zip(specs, keys, strict=True):
        if not isinstance(key, str):
            raise TypeError(f"group_of({name!r}) must return a str, got {key!r}")
    return Layout.build(specs, world_size, rank, int(bucket_elems), keys, stage != 3)
