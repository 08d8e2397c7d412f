"""``ZeroOptimizer``: plain data parallelism (stage 0) and ZeRO stages 1-3 over MPI.

The model's parameters are packed into one flat buffer per dtype, cut into buckets
and sharded with :func:`zerompi.partition.shard_range`. Per bucket, every stage
runs the same three phases with exact counts; they differ in what a rank keeps:

======  ==========  ====================  =============  ===============================
stage   parameters  gradients             Adam moments   reduction / gather
======  ==========  ====================  =============  ===============================
0       full        full                  full           Allreduce; no gather
1       full        full                  shard          Reduce_scatter at step; Allgatherv
2       full        shard (+2 buckets)    shard          Ireduce_scatter per bucket as its
                                                         gradients arrive; Iallgatherv
3       shard       shard (+2 buckets)    shard          as 2; parameters Allgatherv'd per
                                                         layer into 1 bucket when used
======  ==========  ====================  =============  ===============================

The reductions are nonblocking and bucketed: a bucket's reduction runs while the next
bucket is filled (two staging buckets with ``overlap=True``), and a bucket's gather
starts as soon as Adam has updated its shard. With ``shared_memory=True`` on one node,
stages 2-3 reduce (and stage 2 gathers) through MPI-3 shared-memory windows instead.

Model code reads parameters and hands over gradients layer by layer::

    for name in layers:                          # forward
        with opt.gathered(name) as p:            # stage 3 gathers the layer here
            h = forward(p, h)
    for name in reversed(layers):                # backward
        with opt.gathered(name) as p, opt.gradients(name) as g:
            d = backward(p, g, d)                # adds into g[...]; stages 2-3 reduce on exit
    opt.step()

``gathered`` / ``gradients`` take parameter names or group names (a group is the
prefix before the last dot, ``"layer0"`` for ``"layer0.weight"``). In stages 0-2
``opt.params[name]`` are persistent views of the full parameters, and
``opt.grads[name]`` full-size gradient views (in stage 2 a full staging buffer is
allocated the first time ``opt.grads`` is used: the streamed hand-over above is what
keeps stage 2's gradients at ``1/W``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from .adam import AdamConfig, adam_step, finite_real, grad_stats
from .buffers import OVERLAP_SLOTS, BufferPool, buffer_plan, full_grads_plan
from .mpi.agreement import CollectiveError
from .mpi.collectives import Comm, Pending
from .mpi.launch import check_world, install_abort_hook
from .partition import (
    DEFAULT_BUCKET_ELEMS,
    SUPPORTED_DTYPES,
    Bucket,
    Deferred,
    default_group,
    optimizer_layout,
)

PHASES = ("reduce_scatter", "adam", "allgather")
NONFINITE = ("skip", "raise")

#: Elements per Adam call in ``step()``: between calls, MPI advances the gathers of
#: the buckets already updated (without a progress thread, it moves data only inside
#: MPI calls). ~1 MiB of float32: far above the per-call cost, well below a bucket.
ADAM_CHUNK = 1 << 18


#: Stage 0-1 reductions in flight at once in ``step()``: bucket i+2 starts when bucket
#: i is complete. Starting all of them at once measured as slow as one collective on
#: the whole buffer (2.5x slower than bucket by bucket at 64M parameters): MPICH works
#: on all of them together and the working set leaves the cache.
REDUCE_WINDOW = 2


class _Reduction(NamedTuple):
    """A started reduce-scatter of bucket ``index``: into the shard directly
    (``add=False``, its first of the step) or in place, to be added to the shard."""

    index: int
    pending: Pending
    add: bool
    slot: int | None  # staging slot it reads, or None


def _check_failure_settings(max_norm: object, nonfinite: object) -> float | None:
    """Local validation of ``max_norm`` and ``nonfinite``; returns ``max_norm`` as a
    float (or None)."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r:.60}")
    if max_norm is None:
        return None
    return finite_real("max_norm", max_norm, positive=True, kind="a real number or None")


class FlatArrays(Mapping[str, np.ndarray]):
    """Name -> view into a flat buffer. Assigning copies into the view after checking
    shape and dtype, so the flat storage can never be swapped out from under the
    optimizer."""

    def __init__(self, views: dict[str, np.ndarray], what: str) -> None:
        self._views = views
        self._what = what

    def __getitem__(self, name: str) -> np.ndarray:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name not in self._views:
            raise KeyError(f"no {self._what} named {name!r}")
        view = self._views[name]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{self._what} {name!r} must be a numpy array, got {type(value)}")
        if value.shape != view.shape or value.dtype != view.dtype:
            raise ValueError(
                f"{self._what} {name!r} must have shape {view.shape} and dtype {view.dtype}, "
                f"got shape {value.shape} and dtype {value.dtype}"
            )
        np.copyto(view, value)

    def __repr__(self) -> str:
        return f"<{self._what}s: {', '.join(self._views)}>"


def _check_params(params: object) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """Local validation of the parameter mapping; returns its (name, shape, dtype)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping name -> numpy array, got {type(params)}")
    if not params:
        raise ValueError("params is empty: there is nothing to optimize")
    specs = []
    for name, value in params.items():
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {name!r}")
        if not isinstance(value, (np.ndarray, Deferred)):
            raise TypeError(
                f"parameter {name!r} must be a numpy array or zerompi.Deferred, "
                f"got {type(value).__name__} {value!r:.60}"
            )
        if value.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {value.dtype}; zerompi optimizes float32 or "
                "float64 arrays"
            )
        if value.size == 0:
            raise ValueError(f"parameter {name!r} has no elements (shape {value.shape})")
        specs.append((name, tuple(int(s) for s in value.shape), value.dtype))
    return specs


class ZeroOptimizer:
    """Sharded Adam/AdamW (stage 0 baseline, ZeRO stages 1-3) over an MPI communicator.

    Building one is collective: the layout (names, order, shapes, dtypes), stage and
    hyperparameters are checked to be identical on every rank, and any error is
    raised on every rank. Initial parameter values are broadcast from rank 0, as
    every data-parallel rank must start from the same model.

    Gradients are *added* (``+=``), like torch's ``.grad``. Each rank's contribution
    is averaged over ranks and over the micro-batches counted by ``accumulate()``;
    ``step()`` without any ``accumulate()`` counts one. With ``accumulate()``, call it
    after every micro-batch, the last one included. A parameter whose gradient is
    never handed over in a step has a zero gradient in that step (in every stage).

    Before Adam runs, ``step()`` agrees on two numbers over all ranks: how many
    elements of the averaged gradient are not finite, and its global L2 norm
    (``opt.last_grad_norm``, before clipping). A non-finite gradient skips the step
    on every rank alike: parameters, Adam moments and ``step_count`` stay as they
    were, the gradients are discarded and ``opt.skipped_steps`` counts it; with
    ``nonfinite="raise"`` every rank then raises ``FloatingPointError``. With
    ``max_norm``, a gradient whose norm exceeds it is scaled by
    ``max_norm / (norm + 1e-6)`` (torch's ``clip_grad_norm_``).
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        *,
        comm: MPI.Intracomm | None = None,
        stage: int = 1,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        bucket_elems: int = DEFAULT_BUCKET_ELEMS,
        group_of: Callable[[str], str] = default_group,
        max_norm: float | None = None,
        nonfinite: str = "skip",
        overlap: bool = True,
        shared_memory: bool = False,
    ) -> None:
        self.comm = Comm(comm)
        install_abort_hook()  # an uncaught exception on any rank aborts the whole job
        error: BaseException | None = None
        specs: list[tuple[str, tuple[int, ...], np.dtype]] = []
        keys: list[str] = []
        try:
            check_world()
            specs = _check_params(params)
            try:
                b1, b2 = betas
            except (TypeError, ValueError):
                raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
            self.config = AdamConfig(lr, b1, b2, eps, weight_decay, decoupled_weight_decay)
            self.layout = optimizer_layout(
                specs, self.comm.size, self.comm.rank, stage, bucket_elems, group_of
            )
            keys = [group_of(name) for name, _, _ in specs]
            self.max_norm = _check_failure_settings(max_norm, nonfinite)
            self.nonfinite = nonfinite
            for name, flag in (("overlap", overlap), ("shared_memory", shared_memory)):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name} must be a bool, got {flag!r:.60}")
        except Exception as exc:  # whatever it is, every rank must hear of it
            error = exc
        self.comm.agree(error)
        self.comm.check_same(
            [(n, s, d.str, k) for (n, s, d), k in zip(specs, keys, strict=True)],
            "the parameter layout (name, shape, dtype, group)",
        )
        self.comm.check_same(
            (stage, self.config, int(bucket_elems)),
            "the optimizer settings (stage, hyperparameters, bucket_elems)",
        )
        self.comm.check_same(
            (self.max_norm, self.nonfinite), "the failure settings (max_norm, nonfinite)"
        )
        self.comm.check_same((overlap, shared_memory), "(overlap, shared_memory)")
        self.stage = stage
        self.overlap = overlap
        #: Whether stages 2-3 reduce their staging buckets through a shared-memory
        #: window (asked for with shared_memory=True, and every rank on one node).
        self.shared_memory = bool(shared_memory and stage >= 2 and self.comm.single_node())
        # Stage 2 also gathers its parameters through the window; stage 3 keeps shards.
        self._shared_kinds = ("grad_bucket", "params") if stage == 2 else ("grad_bucket",)
        self._closed = False
        self.step_count = 0
        #: Steps skipped because the averaged gradient was not finite (step_count
        #: does not count them).
        self.skipped_steps = 0
        #: Global L2 norm of the last step's averaged gradient, before clipping
        #: (``nan`` before the first step; ``inf`` or ``nan`` for a skipped step).
        self.last_grad_norm = math.nan
        self.timings = dict.fromkeys(PHASES, 0.0)
        self._order = list(params)
        self._micro_batches = 0
        self._reductions = [0] * len(self.layout.buckets)  # per bucket, this step
        self._open: int | None = None  # bucket whose gradients fill the staging buffer
        self._slots = OVERLAP_SLOTS if overlap else 1  # staging buckets (stages 2-3)
        self._slot = 0  # the open bucket's staging slot
        self._inflight: list[_Reduction] = []  # started reductions, oldest first
        self._pending: set[str] = set()  # its parameters not handed over yet
        self._gathered: int | None = None  # stage 3: bucket in the gather buffer
        self._full_grads: dict[np.dtype, np.ndarray] | None = None  # stage 2 opt.grads
        self._full_grads_everywhere = False  # every rank knows all ranks allocated it
        self._allocate(params)

    # -- setup -----------------------------------------------------------------

    def _allocate(self, params: Mapping[str, np.ndarray]) -> None:
        """Every buffer the optimizer keeps, allocated once, here."""
        pool = self.pool = BufferPool()
        layout, stage = self.layout, self.stage
        self._flat: dict[np.dtype, np.ndarray] = {}  # full params (0-2) or shard (3)
        self._grad: dict[np.dtype, np.ndarray] = {}  # full grads (0-1) or shard (2-3)
        self._staging: dict[np.dtype, np.ndarray] = {}  # one bucket of gradients (2-3)
        self._gather: dict[np.dtype, np.ndarray] = {}  # one bucket of parameters (3)
        self._exp_avg: dict[np.dtype, np.ndarray] = {}
        self._exp_avg_sq: dict[np.dtype, np.ndarray] = {}
        self._scratch: dict[np.dtype, np.ndarray] = {}
        stores = {
            "params": self._flat,
            "grads": self._grad,
            "grad_bucket": self._staging,
            "param_bucket": self._gather,
            "exp_avg": self._exp_avg,
            "exp_avg_sq": self._exp_avg_sq,
            "scratch": self._scratch,
        }
        # The plan zerompi.memory estimates from:
        for buf in buffer_plan(layout, stage, self.overlap):
            shared = self.comm if self.shared_memory and buf.kind in self._shared_kinds else None
            stores[buf.kind][buf.dtype] = pool.zeros(
                buf.name, buf.count, buf.dtype, buf.category, shared=shared
            )
        self._specs = {spec.name: spec for spec in layout.params}
        if stage <= 2:
            views = {n: self._view(self._flat, n) for n in self._order}
            self._params = FlatArrays(views, "parameter")
            self._initialize(params, list(self._order), lambda name: views[name])
            for flat in self._flat.values():
                self.comm.bcast_inplace(flat, root=0)
        else:
            for i, bucket in enumerate(layout.buckets):  # rank 0's values, bucket by bucket
                buf = self._gather[bucket.dtype][: bucket.size]
                self._initialize(
                    params, bucket.names, lambda n, b=bucket, f=buf: self._bucket_view(f, b, n)
                )
                self.comm.bcast_inplace(buf, root=0)
                self._shard_of(self._flat, i)[...] = buf[slice(*bucket.local(self.comm.rank))]
        if stage <= 1:
            self._grads = FlatArrays(
                {n: self._view(self._grad, n) for n in self._order}, "gradient"
            )

    def _initialize(
        self,
        params: Mapping[str, np.ndarray | Deferred],
        names: Sequence[str],
        target: Callable[[str], np.ndarray],
    ) -> None:
        """Collective: rank 0 writes the initial values of ``names`` into ``target(name)``
        (the caller broadcasts them); a failing ``init`` raises on every rank."""
        error = None
        if self.comm.rank == 0:
            try:
                for name in names:
                    value = params[name]
                    if isinstance(value, Deferred):
                        value = value.materialize(name)
                    np.copyto(target(name), value, casting="same_kind")
            except Exception as exc:
                error = exc
        self.comm.agree(error)

    def _view(self, flat: Mapping[np.dtype, np.ndarray], name: str) -> np.ndarray:
        spec = self._specs[name]
        return flat[spec.dtype][spec.offset : spec.offset + spec.size].reshape(spec.shape)

    def _shard_of(self, store: Mapping[np.dtype, np.ndarray], index: int) -> np.ndarray:
        """This rank's shard of bucket ``index`` in a shard-sized buffer."""
        bucket = self.layout.buckets[index]
        lo = bucket.shard_offset
        return store[bucket.dtype][lo : lo + bucket.counts[self.comm.rank]]

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

    # -- parameters and gradients ---------------------------------------------------

    @property
    def params(self) -> FlatArrays:
        """Name -> full parameter (a view into the flat buffer). Stages 0-2 only."""
        if self.stage == 3:
            raise AttributeError(
                "stage 3 keeps only parameter shards: read parameters inside "
                "`with opt.gathered(names) as p`, or copy them all with opt.full_params()"
            )
        return self._params

    @property
    def grads(self) -> FlatArrays:
        """Name -> full-size gradient view to add into. Stages 0-2; in stage 2 this
        allocates a full staging buffer on first use (hand gradients over with
        ``opt.gradients(names)`` instead to keep them at ``1/W``)."""
        if self.stage == 3:
            raise AttributeError(
                "stage 3 has no full gradient: add gradients inside "
                "`with opt.gradients(names) as g`"
            )
        if self.stage == 2 and self._full_grads is None:
            self._allocate_full_grads()
        return self._grads

    def _allocate_full_grads(self) -> None:
        self._full_grads = {
            buf.dtype: self.pool.zeros(buf.name, buf.count, buf.dtype, buf.category)
            for buf in full_grads_plan(self.layout)
        }
        self._grads = FlatArrays(
            {n: self._view(self._full_grads, n) for n in self._order}, "gradient"
        )

    @contextmanager
    def gathered(self, *names: str) -> Iterator[Mapping[str, np.ndarray]]:
        """The full parameters ``names`` (parameter or group names) for the duration of
        the block. Stage 3 gathers their bucket with ``Allgatherv`` into the gather
        buffer (collective: every rank must enter it) and releases it on exit; the
        arrays must not be used after the block. Stages 0-2: the persistent views."""
        resolved = self._resolve(names)
        if self.stage < 3:
            yield {n: self._params[n] for n in resolved}
            return
        index = self._single_bucket(resolved, "gathered")
        if self._gathered is not None:
            raise RuntimeError(
                "opt.gathered() blocks cannot nest in stage 3: one layer's parameters are "
                "gathered at a time"
            )
        bucket = self.layout.buckets[index]
        buf = self._gather[bucket.dtype][: bucket.size]
        start = time.perf_counter()
        buf[slice(*bucket.local(self.comm.rank))] = self._shard_of(self._flat, index)
        self.comm.iallgatherv(buf, bucket.counts, bucket.displs).wait()
        self.timings["allgather"] += time.perf_counter() - start
        self._gathered = index
        try:
            yield {n: self._bucket_view(buf, bucket, n) for n in resolved}
        finally:
            self._gathered = None

    @contextmanager
    def gradients(self, *names: str) -> Iterator[Mapping[str, np.ndarray]]:
        """Arrays to *add* the gradients of ``names`` into. On exit they are handed
        over: in stages 2-3, once every parameter of a bucket has been handed over in
        this micro-batch, the bucket is reduce-scattered (collective) and only this
        rank's shard kept. Stages 0-1: views into the full gradient buffer."""
        resolved = self._resolve(names)
        if self.stage < 2:
            yield {n: self._grads[n] for n in resolved}
            return
        index = self._single_bucket(resolved, "gradients")
        if self._closed:
            raise RuntimeError("this optimizer was closed: its staging buffers are gone")
        if self._open != index:
            self._flush()
            slot = (self._slot + 1) % self._slots
            self._release_slot(slot)
            self._slot = slot
            self._staging_of(index).fill(0)
            self._open = index
            self._pending = set(self.layout.buckets[index].names)
        elif self._inflight:
            self._progress()
        bucket = self.layout.buckets[index]
        buf = self._staging_of(index)
        yield {n: self._bucket_view(buf, bucket, n) for n in resolved}
        self._pending.difference_update(resolved)
        if not self._pending:
            self._flush()

    def _bucket_view(self, buf: np.ndarray, bucket: Bucket, name: str) -> np.ndarray:
        spec = self._specs[name]
        lo = spec.offset - bucket.start
        return buf[lo : lo + spec.size].reshape(spec.shape)

    def _single_bucket(self, names: list[str], what: str) -> int:
        indices = {self.layout.bucket_of[n] for n in names}
        if len(indices) != 1:
            raise ValueError(
                f"opt.{what}() takes the parameters of one bucket at a time in stage "
                f"{self.stage}; {names} span {len(indices)} buckets"
            )
        return indices.pop()

    def _staging_of(self, index: int) -> np.ndarray:
        """The open staging slot, sized for bucket ``index``."""
        bucket = self.layout.buckets[index]
        lo = self._slot * self.layout.max_bucket(bucket.dtype)
        return self._staging[bucket.dtype][lo : lo + bucket.size]

    def _flush(self) -> None:
        """Start reducing the open staging bucket into the gradient shard."""
        if self._open is None:
            return
        index, self._open = self._open, None
        self._start_reduction(index, self._staging_of(index), self._slot)

    def _start_reduction(self, index: int, buf: np.ndarray, slot: int | None) -> None:
        """Collective: start reduce-scattering ``buf`` (bucket ``index``) into its
        gradient shard; :meth:`_complete` finishes it. The first reduction of a
        step lands in the shard directly, later ones (micro-batches) are added."""
        start = time.perf_counter()
        bucket = self.layout.buckets[index]
        add = self._reductions[index] > 0
        if self.shared_memory and slot is not None:  # every rank's bucket is addressable
            self.comm.shared_reduce_scatter(
                self.pool.windows[f"grad_bucket.{bucket.dtype.name}"],
                slot * self.layout.max_bucket(bucket.dtype),
                bucket.counts,
                bucket.displs,
                self._shard_of(self._grad, index),
                add,
                reuse=self._slots == 1,
            )  # blocking: complete on return
        else:
            out = None if add else self._shard_of(self._grad, index)
            pending = self.comm.ireduce_scatter(buf, bucket.counts, out=out)
            self._inflight.append(_Reduction(index, pending, add, slot))
        self._reductions[index] += 1
        self.timings["reduce_scatter"] += time.perf_counter() - start

    def _complete(self, upto: int) -> None:
        """Finish the ``upto`` oldest started reductions, in the order started."""
        start = time.perf_counter()
        done, self._inflight = self._inflight[:upto], self._inflight[upto:]
        for reduction in done:
            reduced = reduction.pending.wait()
            if reduction.add:
                target = self._shard_of(self._grad, reduction.index)
                np.add(target, reduced, out=target)
        self.timings["reduce_scatter"] += time.perf_counter() - start

    def _release_slot(self, slot: int) -> None:
        """Wait until no started reduction still reads staging slot ``slot``."""
        last = max((i for i, r in enumerate(self._inflight) if r.slot == slot), default=-1)
        self._complete(last + 1)

    def _progress(self) -> None:
        start = time.perf_counter()
        self.comm.progress([r.pending for r in self._inflight])
        self.timings["reduce_scatter"] += time.perf_counter() - start

    # -- training --------------------------------------------------------------

    def zero_grad(self) -> None:
        """Discard every gradient added or accumulated since the last step."""
        self._complete(len(self._inflight))  # MPI must be done with the buffers first
        for store in (self._grad, self._full_grads or {}):
            for grad in store.values():
                grad.fill(0)
        self._open, self._pending = None, set()
        self._reductions = [0] * len(self.layout.buckets)
        self._micro_batches = 0

    def accumulate(self) -> None:
        """Collective: end of one micro-batch; its gradients are folded into the
        accumulated gradient and the gradient buffers take the next micro-batch."""
        self._micro_batches += 1
        if self.stage < 2:
            return  # gradients keep summing in the full gradient buffer
        self._flush()
        if not self._full_grads_everywhere:
            # opt.grads may have been used on some ranks only (say, to log a norm): agree,
            # or those ranks would reduce-scatter buckets the others never reduce.
            if not self.comm.max(int(self._full_grads is not None)):
                return
            if self._full_grads is None:
                self._allocate_full_grads()
            self._full_grads_everywhere = True
        if self._full_grads is not None:  # stage 2 with opt.grads: reduce every bucket
            for index, bucket in enumerate(self.layout.buckets):
                self._start_reduction(
                    index, self._full_grads[bucket.dtype][bucket.start : bucket.stop], None
                )
            self._complete(len(self._inflight))
            for grad in self._full_grads.values():
                grad.fill(0)

    def step(self) -> None:
        """Collective: average the gradients over ranks and micro-batches, check them
        and take their global norm, clip them if ``max_norm`` is set, run Adam on this
        rank's part of every bucket, and (stages 1-2) gather the updated parameters
        everywhere. Leaves every gradient buffer zeroed. A non-finite gradient skips
        the step on every rank (and raises ``FloatingPointError`` everywhere with
        ``nonfinite="raise"``)."""
        if self._micro_batches == 0:
            self.accumulate()  # what was handed over is the one micro-batch
        else:
            self._flush()
        divisor = float(self.comm.size * self._micro_batches)
        clock = time.perf_counter
        rank = self.comm.rank
        # (a) Every reduction, REDUCE_WINDOW buckets in flight (stages 2-3 started theirs
        # as gradients were handed over), completed bucket by bucket: afterwards each bucket's
        # summed gradient is in `grad`, of which this rank counts `local` (its shard)
        # in the global statistics, taken as soon as the bucket is complete.
        t0 = clock()
        spent = self.timings["reduce_scatter"]
        started: dict[int, Pending] = {}

        def start(index: int) -> None:  # stages 0-1: reduce bucket `index` of the full grads
            if self.stage <= 1 and index < len(self.layout.buckets):
                bucket = self.layout.buckets[index]
                full = self._grad[bucket.dtype][bucket.start : bucket.stop]
                if self.stage == 0:  # blocking: MPICH's Iallreduce measured 1.6x slower here
                    self.comm.allreduce_inplace(full)
                    started[index] = Pending.done(full)
                else:
                    started[index] = self.comm.ireduce_scatter(full, bucket.counts)

        for index in range(REDUCE_WINDOW):
            start(index)
        # [non-finite count, sum of squares, step count, micro-batches] of this rank
        stats = np.array([0.0, 0.0, self.step_count, self._micro_batches])
        parts: list[tuple[np.ndarray, np.ndarray, slice]] = []
        for index, bucket in enumerate(self.layout.buckets):
            dtype = bucket.dtype
            lo, hi = bucket.local(rank)
            if self.stage <= 1:
                reduced = started.pop(index).wait()
                start(index + REDUCE_WINDOW)
            if self.stage == 0:
                grad = reduced
                local = grad[lo:hi]  # every rank holds it all; count each element once
                param = self._flat[dtype][bucket.start : bucket.stop]
                moments = slice(bucket.start, bucket.stop)
            else:
                if self.stage == 1:
                    grad = reduced
                else:
                    last = [i for i, r in enumerate(self._inflight) if r.index == index]
                    self._complete(last[-1] + 1 if last else 0)
                    grad = self._shard_of(self._grad, index)
                    if self._reductions[index] == 0:
                        grad.fill(0)  # nothing was handed over: a zero gradient
                local = grad
                if self.stage == 3:
                    param = self._shard_of(self._flat, index)
                else:
                    param = self._flat[dtype][bucket.start + lo : bucket.start + hi]
                moments = slice(bucket.shard_offset, bucket.shard_offset + hi - lo)
            parts.append((grad, param, moments))
            bad, sumsq = grad_stats(local, self._scratch[dtype])
            stats[0] += bad
            stats[1] += sumsq
        # (b) One small collective: non-finite count and sum of squares over all ranks,
        # summed in rank order so that every rank reaches the same decision.
        gathered = self.comm.allgather_float64(stats)
        for column, what in ((2, "step count"), (3, "number of micro-batches")):
            if (gathered[:, column] != gathered[0, column]).any():  # every rank sees this
                r = int(np.argmax(gathered[:, column] != gathered[0, column]))
                raise CollectiveError(
                    f"the {what} differs between ranks: rank 0 has "
                    f"{int(gathered[0, column])}, rank {r} has {int(gathered[r, column])} "
                    "(every rank must call step() and accumulate() alike)"
                )
        nonfinite = int(math.fsum(gathered[:, 0]))
        try:
            sumsq = math.fsum(gathered[:, 1])  # the same on every rank
        except (OverflowError, ValueError):  # inf - inf, or finite terms overflowing
            sumsq = math.inf if not np.isnan(gathered[:, 1]).any() else math.nan
        self.last_grad_norm = math.sqrt(sumsq) / divisor
        self.timings["reduce_scatter"] = spent + clock() - t0  # _complete counted within
        if nonfinite:  # (c) skip on every rank alike
            self.skipped_steps += 1
            for store in (self._grad, self._full_grads or {}):
                for grad in store.values():
                    grad.fill(0)
            self._reductions = [0] * len(self.layout.buckets)
            self._micro_batches = 0
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"step {self.step_count + 1}: the averaged gradient has {nonfinite} "
                    f"non-finite element(s) over {self.comm.size} rank(s); the step was "
                    "skipped (parameters and Adam state unchanged)"
                )
            return
        # (d) Clipping, folded into the divisor: g / (divisor / scale) = scale * g / divisor.
        if self.max_norm is not None and self.last_grad_norm > self.max_norm:
            divisor /= self.max_norm / (self.last_grad_norm + 1e-6)
        self.step_count += 1
        # (e) Adam on this rank's part, bucket by bucket, in chunks; (stages 1-2) each
        # bucket's gather starts as soon as its part is updated and advances between
        # the chunks of the next buckets' Adam.
        gathers: list[Pending] = []
        adam_s = gather_s = 0.0
        step_count, config = self.step_count, self.config
        for (grad, param, moments), bucket in zip(parts, self.layout.buckets, strict=True):
            dtype = bucket.dtype
            exp_avg = self._exp_avg[dtype][moments]
            exp_avg_sq = self._exp_avg_sq[dtype][moments]
            scratch = self._scratch[dtype]
            for lo in range(0, param.shape[0], ADAM_CHUNK):
                hi = lo + ADAM_CHUNK
                t1 = clock()
                adam_step(
                    param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                    step_count, config, scratch, divisor,
                )  # fmt: skip
                t2 = clock()
                adam_s += t2 - t1
                if gathers:
                    self.comm.progress(gathers)
                    gather_s += clock() - t2
            if self.stage == 1 or (self.stage == 2 and not self.shared_memory):
                t2 = clock()
                gathers.append(
                    self.comm.iallgatherv(
                        self._flat[dtype][bucket.start : bucket.stop], bucket.counts, bucket.displs
                    )
                )
                gather_s += clock() - t2
        t2 = clock()
        self.comm.wait_all(gathers)
        if self.stage == 2 and self.shared_memory:  # one fence, then copy the others' parts
            for dtype in self._flat:
                buckets = [b for b in self.layout.buckets if b.dtype == dtype]
                self.comm.shared_allgatherv(
                    self.pool.windows[f"params.{dtype.name}"],
                    [(b.start, b.counts, b.displs) for b in buckets],
                )
        self.timings["adam"] += adam_s
        self.timings["allgather"] += gather_s + clock() - t2
        if self.stage <= 1:
            for grad in self._grad.values():
                grad.fill(0)  # consumed (stage 1 reduced it in place)
        self._reductions = [0] * len(self.layout.buckets)
        self._micro_batches = 0

    def close(self) -> None:
        """Collective: release the shared-memory windows (``shared_memory=True``);
        afterwards the optimizer can still be inspected and saved, not trained.
        ``with ZeroOptimizer(...) as opt:`` calls it on a normal exit."""
        if not self._closed:
            self._complete(len(self._inflight))
            self._open = None
            names = {f"params.{dtype.name}": dtype for dtype in self._flat}
            for name, flat in self.pool.close(keep=frozenset(names)).items():
                self._flat[names[name]] = flat  # now private memory
            if self.shared_memory and self.stage == 2:
                views = {n: self._view(self._flat, n) for n in self._order}
                self._params = FlatArrays(views, "parameter")
            if self.shared_memory:
                self._staging = {}
            self._closed = True

    def __enter__(self) -> ZeroOptimizer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Not while an exception propagates: it may be on this rank only, and close()
        # is collective (it would wait forever for the others); the abort hook ends
        # the world instead.
        if exc_type is None:
            self.close()

    # -- inspection ------------------------------------------------------------

    def pop_timings(self) -> dict[str, float]:
        """Seconds spent per phase since the last call, and reset."""
        out, self.timings = self.timings, dict.fromkeys(PHASES, 0.0)
        return out

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank's optimizer holds, per category: the reference's four
        (``optimizer_states``, ``gradient_partitions``, ``parameter_partitions``,
        ``communication_buffers``) plus the Adam kernel's ``scratch``."""
        return self.pool.usage()

    def memory_buffers(self) -> dict[str, int]:
        """Bytes per named buffer (``grad_bucket.float32``, ``exp_avg.float32``, ...)."""
        return self.pool.buffers()

    def full_params(self) -> dict[str, np.ndarray]:
        """Collective: a copy of every full parameter, on every rank (any stage)."""
        if self.stage < 3:
            return {n: self._params[n].copy() for n in self._order}
        return self._gather_full(self._flat)

    def gather_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Collective: the full (unsharded) ``exp_avg`` and ``exp_avg_sq`` of every
        parameter on every rank. Allocates full-size arrays: for checks and export,
        not for the training loop."""
        if self.stage == 0:
            return {
                "exp_avg": {n: self._view(self._exp_avg, n).copy() for n in self._order},
                "exp_avg_sq": {n: self._view(self._exp_avg_sq, n).copy() for n in self._order},
            }
        return {
            "exp_avg": self._gather_full(self._exp_avg),
            "exp_avg_sq": self._gather_full(self._exp_avg_sq),
        }

    def _gather_full(self, shards: Mapping[np.dtype, np.ndarray]) -> dict[str, np.ndarray]:
        full = {dtype: np.zeros(size, dtype) for dtype, size in self.layout.sizes.items()}
        traffic, self.comm.traffic = self.comm.traffic, {}  # not training traffic
        for index, bucket in enumerate(self.layout.buckets):
            part = full[bucket.dtype][bucket.start : bucket.stop]
            part[slice(*bucket.local(self.comm.rank))] = self._shard_of(shards, index)
            self.comm.allgatherv_inplace(part, bucket.counts, bucket.displs)
        self.comm.traffic = traffic
        return {n: self._view(full, n) for n in self._order}

    # -- checkpoints -----------------------------------------------------------

    def save(self, path: str) -> None:
        """Collective: write parameters, Adam moments and step count to the single
        file ``path`` (format: :mod:`zerompi.checkpoint`), each rank writing only its
        shards with MPI-IO. The file is written under a temporary name and renamed
        into place by rank 0, so ``path`` holds either the previous checkpoint or the
        complete new one; an error on any rank is raised on every rank."""
        from . import checkpoint  # not at import: keeps `python -m zerompi.checkpoint` clean

        checkpoint.save(self, path)

    def load(self, path: str) -> dict:
        """Collective: restore parameters, Adam moments and step count from a
        checkpoint saved at any world size and stage. The model (names, shapes,
        dtypes, order) must match; this optimizer keeps its own hyperparameters.
        Every checksum is verified before anything is changed: on any error
        (not a checkpoint, truncated, corrupted, another model) every rank raises
        :class:`zerompi.checkpoint.CheckpointError` and the state is untouched.
        Accumulated gradients are discarded. Returns the checkpoint's header."""
        from . import checkpoint

        return checkpoint.load(self, path)

    # -- the state interface of checkpoints --------------------------------------
    # zerompi.checkpoint goes through these methods only (it reads no private
    # attribute); the optimizer's storage layout stays this class's business.

    def param_entries(self) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
        """``(name, shape, dtype, offset in its dtype's flat buffer)`` of every
        parameter, in the model's order."""
        specs = self._specs
        return [
            (n, tuple(specs[n].shape), specs[n].dtype, int(specs[n].offset)) for n in self._order
        ]

    def state_sections(self) -> list[str]:
        """Names of the checkpoint sections, in file order: ``"<kind>.<dtype>"`` for
        every dtype of the layout and every kind (params, exp_avg, exp_avg_sq)."""
        kinds = ("params", "exp_avg", "exp_avg_sq")
        return [f"{kind}.{d.name}" for d in self.layout.sizes for kind in kinds]

    def state_shards(self) -> list[tuple[str, int, np.ndarray]]:
        """``(section, index of the first element in the section's global flat
        vector, this rank's shard)`` of every bucket (in layout order) of every kind
        (params, exp_avg, exp_avg_sq), in one fixed order that every rank's
        collective I/O follows. The shards are writable 1-D views of the
        optimizer's own storage; a rank owning nothing of a bucket gets an empty
        view. After writing into them, call :meth:`publish_state`."""
        rank, stage = self.comm.rank, self.stage
        stores = {"params": self._flat, "exp_avg": self._exp_avg, "exp_avg_sq": self._exp_avg_sq}
        out = []
        for kind, store in stores.items():
            full = stage == 0 or (kind == "params" and stage < 3)
            for index, bucket in enumerate(self.layout.buckets):
                lo, hi = bucket.local(rank)
                if full:
                    shard = store[bucket.dtype][bucket.start + lo : bucket.start + hi]
                else:
                    shard = self._shard_of(store, index)
                out.append((f"{kind}.{bucket.dtype.name}", bucket.start + lo, shard))
        return out

    def publish_state(self) -> None:
        """Collective: after the :meth:`state_shards` were overwritten (a load), make
        every rank's full copies consistent again (``Allgatherv`` of the kinds kept
        whole: parameters in stages 0-2, the moments too in stage 0; not counted as
        training traffic), then discard accumulated gradients."""
        comm, stage = self.comm, self.stage
        stores = {"params": self._flat, "exp_avg": self._exp_avg, "exp_avg_sq": self._exp_avg_sq}
        kinds = list(stores) if stage == 0 else ["params"] if stage < 3 else []
        traffic, comm.traffic = comm.traffic, {}  # not training traffic
        try:
            for kind in kinds:
                for bucket in self.layout.buckets:
                    comm.allgatherv_inplace(
                        stores[kind][bucket.dtype][bucket.start : bucket.stop],
                        bucket.counts,
                        bucket.displs,
                    )
        finally:
            comm.traffic = traffic
        self.zero_grad()

    def set_counters(self, step: int, skipped_steps: int) -> None:
        """Set ``step_count`` and ``skipped_steps`` (a load restores them)."""
        self.step_count = int(step)
        self.skipped_steps = int(skipped_steps)

    def hyperparameters(self) -> dict:
        """Adam's settings as a checkpoint records them: ``lr``, ``beta1``,
        ``beta2``, ``eps``, ``weight_decay``, ``decoupled``."""
        cfg = self.config
        return {
            "lr": cfg.lr,
            "beta1": cfg.beta1,
            "beta2": cfg.beta2,
            "eps": cfg.eps,
            "weight_decay": cfg.weight_decay,
            "decoupled": cfg.decoupled,
        }

    def __repr__(self) -> str:
        total = sum(self.layout.sizes.values())
        return (
            f"ZeroOptimizer(stage={self.stage}, params={total}, buckets="
            f"{len(self.layout.buckets)}, rank={self.comm.rank}/{self.comm.size})"
        )
