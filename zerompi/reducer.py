"""Gradient hand-over and reduction scheduling: one of two objects per engine, by the
plan, each driving one reduction backend per bucket (:mod:`zerompi.reduction`).

* :class:`FullGradients` (stages 0-1): the model adds into full gradient buffers;
  ``step()`` reduces them bucket by bucket, :data:`zerompi.plan.REDUCE_WINDOW` in
  flight. Gradients narrower than the master are reduced at every micro-batch
  instead (never accumulated in 16 bits), and the step does what is left.
* :class:`StagedGradients` (stages 2-3): gradients are handed over bucket by bucket
  into a staging slot and reduced as soon as a bucket is complete, while the model
  computes the next one; stage 2's ``opt.grads`` adds full buffers, reduced at every
  micro-batch once every rank agreed to use them.

Both expose the same interface to the engine: ``block(found)`` (what
``opt.gradients`` enters), ``add(found, grads)`` (``opt.add_gradients``),
``grads`` (``opt.grads``), ``end_micro_batch()``,
``fold()``, ``flush()``, ``reduce(visit)`` (``visit(index)`` in bucket order as soon
as bucket ``index``'s reduced gradient, ``parts[index].grad``, is complete),
``fused`` (per bucket, its statistics where its reduction computed them),
``consumed()``, ``discard()`` and ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .adam import zero
from .arrays import FlatArrays
from .handover import Block, Found, Names, single_bucket
from .mpi.collectives import Comm
from .nodesum import Stats
from .partition import Layout, gaps
from .plan import REDUCE_WINDOW, Part
from .reduction import Backend, InFlight
from .timings import Phase

Visit = Callable[[int], None]

#: Whether one staging slot summed within one node is used from both ends
#: (:func:`staging_offsets`), read when an engine is built: ``False`` gives the node fence
#: after every sum instead (``scripts/ends_ab.py`` builds one of each).
ENDS = True


def staging_offsets(layout: Layout, slots: int, ends: bool = False) -> list[list[int]]:
    """``offsets[slot][index]``: where bucket ``index``'s gradients go in its dtype's
    staging, ``slots`` slots of the largest bucket's size one after the other.

    With ``ends`` (one slot, summed within one node), the slot is used from both ends:
    the buckets handed over one after the other alternate between its bottom (slot 0,
    from offset 0) and its top (slot 1, ending at the slot's end). A bucket is then
    written while the node's ranks may still read the one before it, with no node
    fence in between, unless the two do not fit side by side in the slot (the
    largest bucket and a neighbour); then one fence first. Measured against the node
    fence after every sum it replaces: ``scripts/ends_ab.py``."""
    width = {d: layout.max_bucket(d) for d in layout.sizes}
    buckets = layout.buckets
    if ends:
        assert slots == 1, "both ends of one staging slot"
        return [[0] * len(buckets), [width[b.dtype] - b.size for b in buckets]]
    return [[s * width[b.dtype] for b in buckets] for s in range(slots)]


def take(spans: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Remove ``[start, stop)`` from the disjoint sorted ``spans`` (in place) and
    return the pieces of the spans it covered, relative to ``start``."""
    if start >= stop:
        return []
    inside, kept = [], []
    for lo, hi in spans:
        if hi <= start or lo >= stop:
            kept.append((lo, hi))
            continue
        inside.append((max(lo, start) - start, min(hi, stop) - start))
        if lo < start:
            kept.append((lo, start))
        if hi > stop:
            kept.append((stop, hi))
    spans[:] = kept
    return inside


def add_span(spans: list[tuple[int, int]], start: int, stop: int) -> None:
    """Add ``[start, stop)`` to the disjoint sorted ``spans`` (in place), merged with
    the spans it overlaps or touches."""
    if start >= stop:
        return
    kept = []
    for lo, hi in spans:
        if hi < start or lo > stop:
            kept.append((lo, hi))
        else:
            start, stop = min(lo, start), max(hi, stop)
    kept.append((start, stop))
    kept.sort()
    spans[:] = kept


def zero_except(buf: np.ndarray, lo: int, hi: int, known: Sequence[tuple[int, int]]) -> None:
    """Zero ``buf[lo:hi]`` but the sorted disjoint ``known`` spans (zero already)."""
    for a, b in gaps(known, lo, hi):
        buf[a:b].fill(0)


class FullGradients:
    """Stages 0-1: reduce the full gradient buffers at ``step()``, through
    ``at_step[index]`` (then ``gather()``, where given); with ``per_micro`` backends
    (gradients narrower than the master), every micro-batch is reduced as it ends and
    its buffers zeroed, and ``at_step`` does what is left (stage 0 gathers the reduced
    parts). ``to_zero``: per bucket, what to zero once Adam consumed the reduced
    gradient (the full buffer; with node memory at stage 1 only this rank's own part,
    the sums zeroed the rest)."""

    def __init__(
        self, comm: Comm, parts: Sequence[Part], grads: FlatArrays,
        at_step: Sequence[Backend], per_micro: Sequence[Backend | None] = (),
        to_zero: Sequence[np.ndarray] = (),
        gather: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.parts, self.grads = comm, parts, grads
        self.at_step, self.per_micro, self.to_zero = at_step, per_micro, to_zero
        #: Stage 0 summed in node memory: the other ranks' regions copied in at the end
        #: (:class:`zerompi.nodesum.NodeCopies`).
        self.gather = gather
        #: Per bucket, the backend of its reduction at ``step()``.
        self.backends = at_step
        #: Per bucket, its statistics when its reduction computed them (one node).
        self.fused: list[Stats] = [None] * len(parts)
        self.micro = 0  # micro-batches folded into the reduced shards (per_micro only)

    def block(self, found: Found) -> Block:
        """Views into the full gradient buffer (nothing happens on exit)."""
        _, names, _ = found
        return Block({n: self.grads[n] for n in names})

    def add(self, found: Found, grads: Mapping[str, np.ndarray], phase: Phase) -> None:
        """Add ``grads`` (name -> array) into the full gradient buffers: the model's
        writes, as into a block's views, so nothing of it is timed in ``phase``."""
        for name, grad in grads.items():
            dst = self.grads[name]
            np.add(dst, grad.reshape(dst.shape), out=dst)

    def _window(self, backends: Sequence[Backend | None], add: bool, visit: Visit) -> None:
        """Every bucket's reduction (``None``: none), :data:`REDUCE_WINDOW` in flight;
        ``visit(i)`` once bucket ``i``'s is complete."""
        n = len(backends)

        def start(i: int) -> InFlight | None:
            backend = backends[i]
            if backend is None:
                return None
            flight = backend.start(self.parts[i].full_grad, i % REDUCE_WINDOW, add)  # type: ignore[arg-type]
            self.fused[i] = backend.stats
            return flight

        started = [start(i) for i in range(min(REDUCE_WINDOW, n))]
        for index in range(n):
            flight = started[index]
            if flight is not None:
                flight.wait()
            if index + REDUCE_WINDOW < n:  # its receive region is free again
                started.append(start(index + REDUCE_WINDOW))
            visit(index)

    def end_micro_batch(self) -> None:
        """Gradients keep summing in the full buffers; narrower ones are reduced now
        (collective) and their buffers zeroed."""
        if not self.per_micro:
            return

        def zero(index: int) -> None:
            if self.per_micro[index] is not None:
                self.parts[index].full_grad.fill(0)  # type: ignore[union-attr]

        self._window(self.per_micro, self.micro > 0, zero)
        self.micro += 1

    fold = end_micro_batch

    def flush(self) -> None:
        """Nothing is staged: the full buffers are reduced at ``step()``."""

    def reduce(self, visit: Visit) -> None:
        self._window(self.at_step, False, visit)
        if self.gather is not None:
            self.gather()

    def consumed(self) -> None:
        """After Adam: start the next step from zero."""
        self.micro = 0
        self.fused = [None] * len(self.parts)
        for buf in self.to_zero:
            zero(buf)

    def discard(self) -> None:
        self.micro = 0
        self.fused = [None] * len(self.parts)
        for part in self.parts:
            part.full_grad.fill(0)  # type: ignore[union-attr]

    def close(self) -> None:
        pass


#: Stage 2's full buffers (``opt.grads``) and their per-bucket backends, made on first use.
MakeFull = Callable[[], tuple[FlatArrays, Mapping[np.dtype, np.ndarray], Sequence[Backend]]]


class StagedGradients:
    """Stages 2-3: gradients handed over bucket by bucket into ``slots`` staging slots
    (``staging[dtype]``: ``slots`` buckets of the largest size of that dtype), each
    reduced through ``backends[index]`` as soon as every parameter of the bucket was
    handed over. ``on_exit(found)`` runs when an ``opt.gradients`` block ends (the
    optimizer's guarded hand-over, which calls :meth:`handed_over`); ``make_full``
    (stage 2) adds the full buffers of ``opt.grads``."""

    def __init__(
        self, comm: Comm, layout: Layout, parts: Sequence[Part], names: Names,
        staging: Mapping[np.dtype, np.ndarray], offsets: list[list[int]],
        backends: Sequence[Backend], on_exit: Callable[[Found], None],
        make_full: MakeFull | None = None, ends_fence: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.layout, self.parts, self.names = comm, layout, parts, names
        self.backends, self.on_exit = backends, on_exit
        self.make_full = make_full
        #: Per bucket, its statistics when its reduction computed them (one node).
        self.fused: list[Stats] = [None] * len(parts)
        buckets = layout.buckets
        #: offsets[slot][index]: where bucket index's staging buffer starts in slot
        #: (:func:`staging_offsets`)
        self.offsets = offsets
        self.slots = len(offsets)
        #: One slot used from both ends: the node fence to call before a bucket is
        #: written over the one reduced just before it.
        self.ends_fence = ends_fence
        #: views[slot][index]: bucket index's staging buffer in slot
        self.views = [
            [staging[b.dtype][off : off + b.size] for b, off in zip(buckets, row, strict=True)]
            for row in self.offsets
        ]
        self.bucket_names = [frozenset(b.names) for b in layout.buckets]
        #: per bucket, each parameter's ``(lo, hi)`` in the bucket's staging buffer,
        #: when its parameters tile the bucket (else ``None``: zeroed at ``begin``)
        self.ranges: list[dict[str, tuple[int, int]] | None] = []
        for b in buckets:
            specs = [names.specs[n] for n in b.names]
            spans = {p.name: (p.offset - b.start, p.offset - b.start + p.size) for p in specs}
            tiled = sum(hi - lo for lo, hi in spans.values()) == b.size
            self.ranges.append(spans if tiled else None)
        #: the open bucket's parameters not written since ``begin``: their staging
        #: region is stale, so the first hand-over copies into it, and a block or
        #: ``flush`` zeroes what is left (but ``known``: what is zero already)
        self.unwritten: set[str] = set()
        self.known: list[tuple[int, int]] = []
        self.reductions = [0] * len(parts)  # per bucket, this step
        self.open: int | None = None  # bucket whose gradients fill the open slot
        self.slot = 0
        #: Per dtype (each has its own staging), the ``(start, stop)`` spans of it
        #: zero in every node rank's part: zeroed by the sum within a node as it read
        #: them, so not again at ``begin``.
        self.zeros: dict[np.dtype, list[tuple[int, int]]] = {d: [] for d in staging}
        #: The bucket reduced last from staging: ``(dtype, start, stop)`` there.
        self.last: tuple[np.dtype, int, int] | None = None
        #: its parameters not handed over yet (``None``: all of them)
        self.pending: set[str] | None = None
        self.inflight: list[InFlight] = []
        #: Stage 2's full gradient buffers (``opt.grads``) and their backends,
        #: reduced at every ``end_micro_batch`` once every rank agreed to use them.
        self.full: Mapping[np.dtype, np.ndarray] | None = None
        self.full_backends: Sequence[Backend] = ()
        self._grads: FlatArrays | None = None
        self.full_mode: bool | None = None  # decided once, collectively
        #: Whether this rank entered an ``opt.gradients`` block (which must hand out
        #: zeros to add into). At the first ``end_micro_batch`` the ranks agree on it:
        #: when none did, the sums within a node stop zeroing what they read, since
        #: ``add`` overwrites a stale region (a block used later zeroes its own).
        self.used_blocks = False
        #: per slot, a whole bucket's cached blocks
        self.blocks: list[list[Block | None]] = [[None] * len(parts) for _ in offsets]

    # -- hand-over ----------------------------------------------------------------

    @property
    def grads(self) -> FlatArrays:
        """Stage 2's full-size gradient views, allocated on first use, which must come
        before the first ``accumulate()``/``step()`` on that rank: the ranks agree once,
        then, whether to reduce them."""
        if self.make_full is None:
            raise AttributeError(
                "stage 3 has no full gradient: add gradients inside "
                "`with opt.gradients(names) as g`"
            )
        if self.full is None:
            if self.full_mode is False:
                raise RuntimeError(
                    "stage 2: opt.grads used for the first time after the first "
                    "accumulate()/step(): the ranks agreed then not to reduce full "
                    "gradients. Touch opt.grads before the first step on any rank that "
                    "uses it, or hand gradients over with opt.gradients(names)"
                )
            self._grads, self.full, self.full_backends = self.make_full()
        assert self._grads is not None
        return self._grads

    def block(self, found: Found) -> Block:
        """The staging views of ``found``'s parameters; on exit they are handed over."""
        index, names, whole = found
        if index < 0:
            single_bucket(self.layout, names, "gradients", 2 if self.make_full else 3)
        self.used_blocks = True
        buf = self.begin(index)
        if self.unwritten:  # the numpy API adds into them: they must hold zeros
            self._zero_unwritten(buf, index, names)
        if not whole:
            return Block(self.names.views(buf, index, names), self.on_exit, found)
        cache = self.blocks[self.slot]
        block = cache[index]
        if block is None:
            views = self.names.views(buf, index, names)
            block = cache[index] = Block(views, self.on_exit, (index, None, True))
        return block

    def begin(self, index: int) -> np.ndarray:
        """The staging buffer to add bucket ``index``'s gradients into: the open one,
        or a fresh (zeroed) slot, which closes and starts reducing the open bucket."""
        if self.open == index:
            if self.inflight:
                self.comm.progress([r.pending for r in self.inflight])
            return self.views[self.slot][index]
        if self.open is not None:
            self.flush()
        slot = self.slot + 1
        if slot == self.slots:
            slot = 0
        if self.inflight:
            self._release(slot)
        self.slot = slot
        buf = self.views[slot][index]
        dtype = self.layout.buckets[index].dtype
        start = self.offsets[slot][index]
        stop = start + buf.shape[0]
        last = self.last
        if self.ends_fence is not None and last is not None and last[0] == dtype and (
            last[1] < stop and start < last[2]
        ):
            self.ends_fence()  # every node rank is done reading the bucket before
        known = take(self.zeros[dtype], start, stop)  # written from now on
        if self.ranges[index] is None:
            zero_except(buf, 0, buf.shape[0], known)
        else:  # zeroed lazily: a parameter's first hand-over overwrites its region
            self.unwritten = set(self.bucket_names[index])
            self.known = known
        self.open = index
        self.pending = None
        return buf

    def add(self, found: Found, grads: Mapping[str, np.ndarray], phase: Phase) -> None:
        """Add ``grads`` (name -> array of that parameter's shape or size) into the
        staged gradients of ``found``'s parameters and hand them over: what a
        ``gradients`` block does, in one call. A region not written since its slot
        was begun is overwritten instead (one pass, no zero-fill first). ``phase``
        times what a block times (opening the slot, the hand-over and its
        reduction), not the copies, which are the model's writes into a block."""
        index, names, whole = found
        if index < 0:
            single_bucket(self.layout, names, "gradients", 2 if self.make_full else 3)
        with phase:
            buf = self.begin(index)
        spans, unwritten = self.ranges[index], self.unwritten
        for name, grad in grads.items():
            if spans is None:
                dst = self.names.bucket_view(buf, index, name)
                np.add(dst, grad.reshape(dst.shape), out=dst)
                continue
            lo, hi = spans[name]
            if name in unwritten:
                unwritten.discard(name)
                np.copyto(buf[lo:hi], grad.reshape(-1), casting="same_kind")
            else:
                np.add(buf[lo:hi], grad.reshape(-1), out=buf[lo:hi])
        with phase:
            self.handed_over(index, None if whole else list(grads))

    def _zero_unwritten(self, buf: np.ndarray, index: int, names: Sequence[str] | None) -> None:
        """Zero the stale regions of ``names`` (``None``: all) of the open bucket."""
        spans, known = self.ranges[index], self.known
        assert spans is not None
        for name in list(self.unwritten) if names is None else names:
            if name in self.unwritten:
                self.unwritten.discard(name)
                lo, hi = spans[name]
                zero_except(buf, lo, hi, known)

    def handed_over(self, index: int, names: Sequence[str] | None) -> None:
        """``names`` of bucket ``index`` are handed over (``None``: all of them);
        start its reduction once every parameter of the bucket is."""
        if self.open != index:
            return  # already started: a later bucket was begun
        if names is not None:
            if self.pending is None:
                self.pending = set(self.bucket_names[index])
            self.pending.difference_update(names)
            if self.pending:
                return
        self.flush()

    def flush(self) -> None:
        """Start reducing the open staging bucket into the gradient shard."""
        if self.open is not None:
            index, self.open = self.open, None
            buf = self.views[self.slot][index]
            if self.unwritten:  # parameters never handed over add zero
                self._zero_unwritten(buf, index, None)
            self._start(index, self.backends[index], buf, self.slot)

    def end_micro_batch(self) -> None:
        self.flush()
        if self.full_mode is None:  # once: did any rank use opt.grads, or a block?
            self._agree()
        if self.full_mode:
            if self.full is None:  # another rank uses opt.grads: reduce ours too
                self.grads  # noqa: B018 (allocates them)
            assert self.full is not None
            backends = self.full_backends
            if any(b.one_region for b in backends):  # receive region 0: the slots' too
                self._complete(len(self.inflight))
            for index, bucket in enumerate(self.layout.buckets):
                src = self.full[bucket.dtype][bucket.start : bucket.stop]
                self._start(index, backends[index], src, None)
                if backends[index].one_region:  # one receive region: one at a time
                    self._complete(len(self.inflight))
            self._complete(len(self.inflight))
            for grad in self.full.values():
                zero(grad)

    def _agree(self) -> None:
        """Collective, once (the first ``end_micro_batch``, after every sum of it):
        whether any rank used ``opt.grads`` (then every rank reduces full buffers) and
        whether any entered a block. If none did, no sum zeroes what it reads from now
        on, on every rank alike: a span counts as zero (``zeros``) only where every
        node rank zeroed its region of it, so the ranks must switch together. Every
        hand-over then overwrites its stale region (:meth:`add`), and a block entered
        later zeroes the regions it hands out (``_zero_unwritten``), so the choice is
        a speed, never a result: it saves the sum's writes, ``W`` times a shard's
        bytes per rank and step (``scripts/clear_ab``)."""
        agreed = np.array([self.full is not None, self.used_blocks], np.float64)
        self.comm.max_inplace(agreed)
        self.full_mode = bool(agreed[0])
        if not agreed[1]:
            for backend in self.backends:
                backend.clears = False

    def fold(self) -> None:
        """Nothing to fold: staged gradients are reduced per bucket as they arrive."""

    # -- reduction --------------------------------------------------------------

    def _start(self, index: int, backend: Backend, src: np.ndarray, slot: int | None) -> None:
        """Collective: start reducing ``src`` (bucket ``index``) into its gradient
        shard. The first reduction of a step lands in the shard directly, later ones
        (micro-batches) are added."""
        add = self.reductions[index] > 0
        self.reductions[index] += 1
        flight = backend.start(src, slot, add)
        self.fused[index] = backend.stats
        if slot is not None:
            dtype = self.layout.buckets[index].dtype
            start = self.offsets[slot][index]
            self.last = (dtype, start, start + src.shape[0])
            if backend.clears:  # (zero everywhere once the node's ranks pass a fence)
                add_span(self.zeros[dtype], *self.last[1:])
        if flight is not None:
            self.inflight.append(flight)

    def _complete(self, upto: int) -> None:
        """Finish the ``upto`` oldest started reductions, in the order started."""
        if upto >= len(self.inflight):  # the common case: all of them, no slicing
            done, self.inflight = self.inflight, []
        else:
            done, self.inflight = self.inflight[:upto], self.inflight[upto:]
        for flight in done:
            flight.wait()

    def _release(self, slot: int) -> None:
        """Wait until no started reduction still reads staging slot ``slot``."""
        inflight = self.inflight
        for i in range(len(inflight) - 1, -1, -1):  # the newest that reads it, and older
            if inflight[i].slot == slot:
                self._complete(i + 1)
                return

    def reduce(self, visit: Visit) -> None:
        self._complete(len(self.inflight))
        for index, part in enumerate(self.parts):
            if self.reductions[index] == 0:
                part.grad.fill(0)  # nothing was handed over: a zero gradient
                self.fused[index] = (0, 0.0)
            visit(index)

    def consumed(self) -> None:
        self.reductions = [0] * len(self.parts)
        self.fused = [None] * len(self.parts)

    def discard(self) -> None:
        """Drop every gradient added or reduced since the last step."""
        self._complete(len(self.inflight))  # MPI must be done with the buffers first
        # The shards need no zeroing: with no reduction counted, the next one
        # overwrites them, and ``reduce`` zero-fills a bucket that had none.
        if self.full is not None:
            for grad in self.full.values():
                grad.fill(0)
        self.open, self.pending, self.unwritten = None, None, set()
        self.consumed()

    def close(self) -> None:
        self._complete(len(self.inflight))
        self.open = None
