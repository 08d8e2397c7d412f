"""Initial parameter values: rank 0's, broadcast to every rank.

Rank 0 writes the values the user passed (materializing :class:`Deferred` ones, so
only rank 0 runs an ``init``) and broadcasts them; a failing ``init`` raises on every
rank. With full parameters in the master dtype (stages 0-2) the whole flat buffer is
broadcast at once; otherwise (stage 3, or a narrower ``param_dtype``) one bucket at a
time through a bucket-sized buffer of the master dtype, from which each rank keeps
its master part and the model's rounded copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .adam import round_low
from .mpi.collectives import Comm
from .mpi.nodes import Nodes
from .partition import Deferred, Layout
from .plan import Part


def initialize(
    comm: Comm,
    params: Mapping[str, np.ndarray | Deferred],
    names: Sequence[str],
    target: Callable[[str], np.ndarray],
) -> None:
    """Collective: rank 0 writes the initial values of ``names`` into ``target(name)``
    (the caller broadcasts them); a failing ``init`` raises on every rank."""
    with comm.verdict():
        if comm.rank == 0:
            for name in names:
                value = params[name]
                if isinstance(value, Deferred):
                    value = value.materialize(name)
                np.copyto(target(name), value, casting="same_kind")


class Releases:
    """The :attr:`Deferred.release` calls of one initialization, on every rank: each
    as soon as its value is held; the first exception is kept and raised on every
    rank by :meth:`agree` (one collective at the end, not one per bucket)."""

    def __init__(self, comm: Comm, params: Mapping[str, np.ndarray | Deferred]) -> None:
        self.params = params
        self.verdict = comm.verdict()

    def __call__(self, names: Sequence[str]) -> None:
        for name in names:
            value = self.params[name]
            if isinstance(value, Deferred) and value.release is not None and self.verdict.ok:
                with self.verdict.catch():
                    value.release()

    def agree(self) -> None:
        self.verdict.agree()


def initialize_by_bucket(
    comm: Comm,
    layout: Layout,
    parts: Sequence[Part],
    params: Mapping[str, np.ndarray | Deferred],
    bucket_view: Callable[[np.ndarray, int, str], np.ndarray],
    nodes: Nodes | None = None,
) -> None:
    """Collective: rank 0's initial values, one bucket at a time through a
    bucket-sized buffer of the master dtype (freed after), into each part's master
    (``part.param``: the whole bucket in stage 0, this rank's shard otherwise) and,
    rounded, into the model's copy (``part.low``). With ``nodes`` the model's copy is
    one per node: this rank writes its region of it, then the node fences."""
    temp = {d: np.zeros(layout.max_bucket(d), d) for d in layout.sizes}
    release = Releases(comm, params)
    for i, (bucket, part) in enumerate(zip(layout.buckets, parts, strict=True)):
        buf = temp[bucket.dtype][: bucket.size]
        initialize(comm, params, bucket.names, lambda n, i=i, f=buf: bucket_view(f, i, n))
        comm.bcast_inplace(buf, root=0, tag=i)
        release(bucket.names)
        mine = buf[slice(*bucket.local(comm.rank))]
        whole = part.param.shape[0] == bucket.size  # stage 0: Adam runs on everything
        if nodes is not None:  # this rank's region of its node's copy
            assert part.full_param is not None
            for lo, hi in nodes.region(bucket.counts, bucket.displs):
                if part.low is not None:
                    round_low(buf[lo:hi], part.full_param[lo:hi])
                else:
                    part.full_param[lo:hi] = buf[lo:hi]  # (the region holds part.param)
            if part.low is not None:
                part.param[...] = mine  # the master shard
            continue
        part.param[...] = buf if whole else mine
        if part.low is not None and part.full_param is not None:
            round_low(buf, part.full_param)  # the model's copy of the whole bucket
        elif part.low is not None:
            round_low(part.param, part.low)  # stage 3: the shard it gathers from
    if nodes is not None:
        nodes.node.fence()
    release.agree()


def initialize_whole(
    comm: Comm,
    params: Mapping[str, np.ndarray | Deferred],
    views: Mapping[str, np.ndarray],
    flats: Sequence[np.ndarray],
) -> None:
    """Collective: rank 0's initial values into ``views`` (each parameter's view of
    the full flat buffers ``flats``), then each flat buffer broadcast at once."""
    initialize(comm, params, list(views), lambda name: views[name])
    for index, flat in enumerate(flats):
        comm.bcast_inplace(flat, root=0, tag=-2 - index)
    release = Releases(comm, params)
    release(list(views))
    release.agree()
