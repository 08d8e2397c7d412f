"""The hand-over API of :class:`zerompi.optimizer.ZeroOptimizer`: where the model
reads its parameters and adds its gradients, layer by layer.

``opt.params`` / ``opt.grads`` (stages 0-2; full views) and the blocks
``with opt.gathered(*names) as p`` (stage 3 gathers the layer's bucket) and
``with opt.gradients(*names) as g`` (stages 2-3 start reducing a bucket as soon as all
of it was handed over). Per call the cost is O(1) in the size of the model: name
lookups, prepared collectives and the views handed out are made once per bucket.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import FlatArrays
from .buffers import OVERLAP_SLOTS, full_grads_plan, gather_slots
from .prefetch import LayerGather
from .reducer import StreamReducer

if TYPE_CHECKING:
    from .buffers import BufferPool
    from .partition import Layout
    from .plan import Part, StagePlan

#: ``ZEROMPI_DEBUG=1``: fill a stage-3 gather buffer with NaN when its block ends, so
#: an array kept past its ``gathered`` block shows NaN instead of the next layer.
DEBUG = os.environ.get("ZEROMPI_DEBUG", "") not in ("", "0")

class Block:
    """What ``with opt.gathered(...)`` / ``with opt.gradients(...)`` enter: the arrays
    (a fresh dict of them per entry), what to do on any exit (``always``) and on a
    normal one (``on_exit``). A plain class, not a generator: it is entered three
    times per layer and step, and a whole bucket's blocks are made once and reused."""

    __slots__ = ("always", "arg", "on_exit", "views")

    def __init__(
        self, views: Mapping[str, np.ndarray], on_exit: Callable[[Any], None] | None = None,
        arg: Any = None, always: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.views, self.on_exit, self.arg, self.always = views, on_exit, arg, always

    def __enter__(self) -> dict[str, np.ndarray]:
        return dict(self.views)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.always is not None:
            self.always()
        if exc_type is None and self.on_exit is not None:
            self.on_exit(self.arg)



class HandOver:
    """``params``, ``grads``, ``gathered``, ``gradients`` (a mixin of ZeroOptimizer)."""

    comm: Any
    overlap: bool
    layout: Layout
    plan: StagePlan
    pool: BufferPool
    parts: list[Part]
    reducer: Any
    stage: int
    timings: dict[str, float]
    _order: list[str]
    _specs: dict[str, Any]
    _params: FlatArrays
    _grads: FlatArrays
    _gathered: tuple[int, int] | None
    _gather_blocks: list[list[Block | None]]
    _staging_blocks: list[list[Block | None]]
    _lookups: dict[tuple[str, ...], tuple[int, list[str], bool]]
    _closed: bool
    precisions: dict[np.dtype, Any]
    shared_memory: bool
    nodes: Any

    def _prepare_handover(self, stores: Mapping[str, Mapping[np.dtype, np.ndarray]]) -> None:
        """What makes a hand-over O(1): name lookups and the views handed out, cached
        per bucket as they are first used, and stage 3's gather buffer views with
        their prepared ``Allgatherv`` (collective: made in bucket order on every
        rank)."""
        layout, comm = self.layout, self.comm
        n = len(layout.buckets)
        self._lookups = {}
        slots = 1 if self.plan.full_grads else OVERLAP_SLOTS if self.overlap else 1
        self._staging_blocks = [[None] * n for _ in range(slots)]
        self.layers: LayerGather | None = None
        if not self.plan.full_params and self.plan.layer_buffers:  # shard -> buffer
            self.layers = LayerGather(
                comm, layout, stores["param_bucket"], gather_slots(self.overlap),
                self._gather_source,
                self.nodes if "param_bucket" in self.plan.node_kinds else None,
            )  # fmt: skip
            self._gather_blocks = [[None] * n for _ in range(self.layers.slots)]

    def _gather_source(self, index: int) -> np.ndarray:
        """What stage 3 gathers bucket ``index`` from: this rank's shard, or its
        rounded copy with a narrower ``param_dtype``."""
        part = self.parts[index]
        return part.param if part.low is None else part.low

    def _view(self, flat: Mapping[np.dtype, np.ndarray], name: str) -> np.ndarray:
        spec = self._specs[name]
        return flat[spec.dtype][spec.offset : spec.offset + spec.size].reshape(spec.shape)

    def _bucket_view(self, buf: np.ndarray, bucket: object, name: str) -> np.ndarray:
        spec = self._specs[name]
        lo = spec.offset - bucket.start  # type: ignore[attr-defined]
        return buf[lo : lo + spec.size].reshape(spec.shape)

    def _resolve(self, names: tuple[str, ...]) -> list[str]:
        """Parameter names for a mix of parameter and group names."""
        out: list[str] = []
        for name in names:
            if name in self._specs:
                out.append(name)
            elif name in self.layout.groups:
                out.extend(self.layout.groups[name])
            else:
                raise KeyError(f"{name!r} is neither a parameter nor a group of this model")
        return out

    def _single_bucket(self, names: list[str], what: str) -> int:
        bucket_of = self.layout.bucket_of
        index = bucket_of[names[0]]
        if any(bucket_of[n] != index for n in names):
            count = len({bucket_of[n] for n in names})
            raise ValueError(
                f"opt.{what}() takes the parameters of one bucket at a time in stage "
                f"{self.stage}; {names} span {count} buckets"
            )
        return index

    def _live(self, what: str) -> None:
        """Refuse training calls after ``close()``, before touching any state."""
        if self._closed:
            raise RuntimeError(
                f"opt.{what}() after close(): this optimizer was closed (its staging and "
                "shared-memory buffers are released); its parameters can still be read "
                "and saved, not trained"
            )

    @property
    def params(self) -> FlatArrays:
        """Name -> full parameter (a view into the flat buffer). Stages 0-2 only."""
        if self.stage == 3:  # (on one node they are the node's copy: still read them
            raise AttributeError(  # by layer, as on any number of nodes)
                "stage 3 keeps only parameter shards: read parameters inside "
                "`with opt.gathered(names) as p`, or copy them all with opt.full_params()"
            )
        return self._params

    @property
    def grads(self) -> FlatArrays:
        """Name -> full-size gradient view to add into. Stages 0-2; in stage 2 this
        allocates a full staging buffer on first use, which must come before the first
        ``accumulate()``/``step()`` on that rank: the ranks agree once, then, whether
        to reduce it (hand gradients over with ``opt.gradients(names)`` instead to
        keep them at ``1/W``)."""
        if self.stage == 3:
            raise AttributeError(
                "stage 3 has no full gradient: add gradients inside "
                "`with opt.gradients(names) as g`"
            )
        if self.stage == 2 and self.reducer.full is None:  # type: ignore[union-attr]
            reducer = self.reducer
            assert isinstance(reducer, StreamReducer)
            if reducer.full_mode is False:
                raise RuntimeError(
                    "stage 2: opt.grads used for the first time after the first "
                    "accumulate()/step(): the ranks agreed then not to reduce full "
                    "gradients. Touch opt.grads before the first step on any rank that "
                    "uses it, or hand gradients over with opt.gradients(names)"
                )
            reducer.full = self._full_grads()
        return self._grads

    def _full_grads(self) -> dict[np.dtype, np.ndarray]:
        """Stage 2's full gradient buffers (``opt.grads``), allocated on first use."""
        full, recv = {}, {}
        for buf in full_grads_plan(self.layout, self.precisions, self.shared_memory):
            store = full if buf.kind == "grads_full" else recv
            store[buf.master] = self.pool.zeros(buf.name, buf.count, buf.dtype, buf.category)
        if recv:  # their reduction's receive region (shared memory has no other)
            self.reducer.use_recv(recv)
        self._grads = FlatArrays({n: self._view(full, n) for n in self._order}, "gradient")
        return full

    def gathered(self, *names: str) -> Block:
        """``with opt.gathered(*names) as p``: the full parameters ``names`` (parameter
        or group names) for the duration of the block. Stage 3 gathers their bucket
        with ``Allgatherv`` into the gather buffer (collective: every rank must enter
        it) and releases it on exit; the arrays must not be used after the block
        (``ZEROMPI_DEBUG=1`` fills them with NaN on exit). Stages 0-2: the persistent
        views."""
        if self._closed:
            self._live("gathered")
        index, resolved, whole = self._lookup(names, "gathered")
        if self.stage < 3:
            return Block({n: self._params[n] for n in resolved})
        if self._gathered is not None:
            raise RuntimeError(
                "opt.gathered() blocks cannot nest in stage 3: one layer's parameters are "
                "gathered at a time"
            )
        if index < 0:
            self._single_bucket(resolved, "gathered")  # raises: one bucket at a time
        if self.plan.full_params:  # one node: its copy, in place (the same rules apply,
            # and the read is recorded as the gather it replaces: ranks that read
            # different layers fail the step alike on one node or many)
            self.comm.record_shared("allgatherv", index, self.layout.buckets[index].size)
            self._gathered = (index, 0)
            return Block({n: self._params[n] for n in resolved}, always=self._release_gathered)
        layers = self.layers
        if layers is None:
            raise RuntimeError(
                "opt.gathered(): this optimizer has no gather buffers (gather_buffers="
                "False): its owner gathers with opt.gather_into()"
            )
        start = time.perf_counter()
        slot = layers.gather(index)
        self.timings["allgather"] += time.perf_counter() - start
        self._gathered = (index, slot)
        cache = self._gather_blocks[slot]
        block = cache[index] if whole else None
        if block is None:
            views = self._views(layers.bufs[slot][index], index, resolved)
            block = Block(views, always=self._release_gathered)
            if whole:
                cache[index] = block
        return block

    @property
    def resident_params(self) -> FlatArrays | None:
        """Name -> full parameter view where this rank holds every parameter all the
        time (stages 0-2; stage 3 on one node with shared memory: the node's copy),
        in ``param_dtype``; else ``None`` (stage 3 gathers: :meth:`gather_into`)."""
        return self._params if self.plan.full_params else None

    def gather_into(self, index: int, out: np.ndarray) -> None:
        """Collective: bucket ``index``'s full parameters (in ``param_dtype``) into
        ``out``, memory the caller owns and may free between calls (the torch
        adapter's per-module storages, :mod:`zerompi.torch._units`). Stage 3 without
        a node copy; recorded in the step's fingerprint like a ``gathered`` block."""
        bucket = self.layout.buckets[index]
        start = time.perf_counter()
        self.comm.plan_allgatherv(
            out, bucket.counts, bucket.displs, index, send=self._gather_source(index)
        ).run()
        self.timings["allgather"] += time.perf_counter() - start

    def _release_gathered(self) -> None:
        layers = self.layers  # (a node's shared buffer is not this rank's to poison)
        if DEBUG and self._gathered is not None and layers is not None and layers.node is None:
            index, slot = self._gathered
            self.layers.bufs[slot][index].fill(np.nan)
        self._gathered = None

    def _gathers_done(self, step: bool = True) -> None:
        """Before the shards change (``step()``'s Adam, a load) or the buffers go:
        the gather in flight completes; a ``step`` also ends the order's recording
        and starts the next step's from the top."""
        if self.layers is not None:
            if step:
                self.layers.end_step()
            else:
                self.layers.finish()

    def gradients(self, *names: str) -> Block:
        """``with opt.gradients(*names) as g``: arrays to *add* the gradients of
        ``names`` into. On a normal exit they are handed over: in stages 2-3, once
        every parameter of a bucket has been handed over in this micro-batch, the
        bucket is reduce-scattered (collective) and only this rank's shard kept.
        Stages 0-1: views into the full gradient buffer."""
        if self._closed:
            self._live("gradients")
        index, resolved, whole = self._lookup(names, "gradients")
        if self.plan.full_grads:
            return Block({n: self._grads[n] for n in resolved})
        if index < 0:
            self._single_bucket(resolved, "gradients")  # raises: one bucket at a time
        reducer: StreamReducer = self.reducer
        start = time.perf_counter()
        buf = reducer.begin(index)
        self.timings["reduce_scatter"] += time.perf_counter() - start
        if not whole:
            views = self._views(buf, index, resolved)
            return Block(views, self._handed_over, (index, resolved))
        cache = self._staging_blocks[reducer.slot]
        block = cache[index]
        if block is None:
            views = self._views(buf, index, resolved)
            block = cache[index] = Block(views, self._handed_over, (index, None))
        return block

    def fold(self) -> None:
        """Fold the gradients added so far into the accumulated gradient *without*
        counting a micro-batch (``accumulate()`` counts one, and the step averages
        over them): torch's semantics, where the gradients of several ``backward()``
        calls are summed. Only 16-bit gradients at stages 0-1 are held in a buffer
        of their own dtype until folded (a collective there; elsewhere nothing to
        do), so the torch adapter folds after every backward: never summed in 16
        bits."""
        if self.plan.full_grads and any(p.low_grads for p in self.precisions.values()):
            self._live("fold")
            start = time.perf_counter()
            self.reducer.end_micro_batch()
            self.timings["reduce_scatter"] += time.perf_counter() - start

    def _handed_over(self, handed: tuple[int, list[str] | None]) -> None:
        start = time.perf_counter()
        self.reducer.handed_over(*handed)
        self.timings["reduce_scatter"] += time.perf_counter() - start

    def _views(self, buf: np.ndarray, index: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Name -> view of ``buf`` (bucket ``index``'s buffer) for ``names``."""
        bucket = self.layout.buckets[index]
        return {n: self._bucket_view(buf, bucket, n) for n in names}

    def _lookup(self, names: tuple[str, ...], what: str) -> tuple[int, list[str], bool]:
        """The bucket of ``names`` (parameter or group names; -1 if they span
        several), their parameter names, and whether they are all of the bucket's:
        cached, so the hand-over of a layer costs O(1), not O(model)."""
        found = self._lookups.get(names)
        if found is None:
            resolved = self._resolve(names)
            indices = {self.layout.bucket_of[n] for n in resolved}
            index = indices.pop() if len(indices) == 1 else -1
            whole = index >= 0 and set(resolved) == set(self.layout.buckets[index].names)
            found = self._lookups[names] = (index, resolved, whole)
        return found
