"""``ZeroOptimizer``: ZeRO stages 1 and 2 over MPI with exact counts.

The model's parameters are packed into one flat buffer per dtype, cut into buckets
and sharded with :func:`zerompi.partition.shard_range`. ``opt.params[name]`` and
``opt.grads[name]`` are views into the flat buffers, so the model reads and writes
them with zero copies. ``step()`` is, per bucket::

    Reduce_scatter (exact counts)  ->  Adam on the local shard  ->  Allgatherv

Stage 1 shards the Adam moments; the gradient is kept whole and reduced in place.
Stage 2 also shards the gradient: each micro-batch's gradient is reduce-scattered
by ``accumulate()`` and only the local shard is kept, which is what makes gradient
accumulation cost ``1/W`` of the gradient memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import numpy as np
from mpi4py import MPI

from .adam import BLOCK, AdamConfig, adam_step
from .buffers import BufferPool
from .comm import Comm
from .partition import SUPPORTED_DTYPES, Layout

#: Default bucket size in elements (16 MiB of float32): large enough that the
#: per-collective latency is negligible, small enough to bound staging buffers.
DEFAULT_BUCKET_ELEMS = 1 << 22

STAGES = (1, 2)

PHASES = ("reduce_scatter", "adam", "allgather")


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
        if not isinstance(value, np.ndarray):
            raise TypeError(
                f"parameter {name!r} must be a numpy array, "
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
    """Sharded Adam/AdamW (ZeRO stage 1 or 2) over an MPI communicator.

    Building one is collective: the layout (names, order, shapes, dtypes), stage and
    hyperparameters are checked to be identical on every rank, and any error is
    raised on every rank. Initial parameter values are broadcast from rank 0, as
    every data-parallel rank must start from the same model.

    Use::

        opt = ZeroOptimizer(params, stage=2, lr=1e-3, weight_decay=0.01,
                            decoupled_weight_decay=True)
        for batch in data:
            for micro in split(batch):
                model.backward(micro, opt.params, opt.grads)   # adds into opt.grads
                opt.accumulate()                               # optional, per micro-batch
            opt.step()                                         # leaves opt.grads zeroed

    Gradients are *added* into ``opt.grads`` (``+=``), like torch's ``.grad``. Each
    rank's contribution is averaged over ranks and over the micro-batches counted by
    ``accumulate()``; ``step()`` without any ``accumulate()`` counts one. When you use
    ``accumulate()``, call it after every micro-batch, the last one included: what is
    added after the last ``accumulate()`` is not part of a stage-2 step.
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
    ) -> None:
        self.comm = Comm(comm)
        error: BaseException | None = None
        try:
            specs = _check_params(params)
            if type(stage) is not int or stage not in STAGES:
                raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
            if isinstance(bucket_elems, bool) or not isinstance(bucket_elems, (int, np.integer)):
                raise TypeError(f"bucket_elems must be an integer, got {bucket_elems!r}")
            if bucket_elems < 1:
                raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems!r}")
            try:
                b1, b2 = betas
            except (TypeError, ValueError):
                raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
            self.config = AdamConfig(lr, b1, b2, eps, weight_decay, decoupled_weight_decay)
            self.layout = Layout.build(specs, self.comm.size, self.comm.rank, bucket_elems)
        except Exception as exc:  # whatever it is, every rank must hear of it
            error = exc
        self.comm.agree(error)
        self.comm.check_same(
            [(n, s, d.str) for n, s, d in specs], "the parameter layout (name, shape, dtype)"
        )
        self.comm.check_same(
            (stage, self.config, bucket_elems), "the optimizer settings (stage, hyperparameters)"
        )
        self.stage = stage
        self.step_count = 0
        self.timings = dict.fromkeys(PHASES, 0.0)
        self._micro_batches = 0
        self._allocate(params)

    # -- setup -----------------------------------------------------------------

    def _allocate(self, params: Mapping[str, np.ndarray]) -> None:
        """Every buffer the optimizer will ever use, allocated once, here."""
        pool = self.pool = BufferPool()
        self._flat: dict[np.dtype, np.ndarray] = {}
        self._grad: dict[np.dtype, np.ndarray] = {}
        self._grad_shard: dict[np.dtype, np.ndarray] = {}
        self._exp_avg: dict[np.dtype, np.ndarray] = {}
        self._exp_avg_sq: dict[np.dtype, np.ndarray] = {}
        self._scratch: dict[np.dtype, np.ndarray] = {}
        for dtype, size in self.layout.sizes.items():
            shard = self.layout.shard_sizes[dtype]
            key = dtype.name
            self._flat[dtype] = pool.zeros(f"params.{key}", size, dtype, "parameter_partitions")
            # Stage 1 keeps the whole gradient; stage 2 keeps only its shard, and the
            # whole-gradient buffer is a staging area for the reduce-scatter.
            category = "gradient_partitions" if self.stage == 1 else "communication_buffers"
            self._grad[dtype] = pool.zeros(f"grads.{key}", size, dtype, category)
            if self.stage == 2:
                self._grad_shard[dtype] = pool.zeros(
                    f"grad_shard.{key}", shard, dtype, "gradient_partitions"
                )
            self._exp_avg[dtype] = pool.zeros(f"exp_avg.{key}", shard, dtype, "optimizer_states")
            self._exp_avg_sq[dtype] = pool.zeros(
                f"exp_avg_sq.{key}", shard, dtype, "optimizer_states"
            )
            self._scratch[dtype] = pool.zeros(
                f"scratch.{key}", min(BLOCK, max(shard, 1)), dtype, "scratch"
            )
        param_views, grad_views = {}, {}
        for spec in self.layout.params:
            lo, hi = spec.offset, spec.offset + spec.size
            param_views[spec.name] = self._flat[spec.dtype][lo:hi].reshape(spec.shape)
            grad_views[spec.name] = self._grad[spec.dtype][lo:hi].reshape(spec.shape)
        order = list(params)  # keep the user's order for iteration
        self.params = FlatArrays({n: param_views[n] for n in order}, "parameter")
        self.grads = FlatArrays({n: grad_views[n] for n in order}, "gradient")
        for name, value in params.items():
            param_views[name][...] = value
        for flat in self._flat.values():
            self.comm.bcast_inplace(flat, root=0)

    # -- training --------------------------------------------------------------

    def zero_grad(self) -> None:
        """Discard every gradient added or accumulated since the last step."""
        for grad in self._grad.values():
            grad.fill(0)
        self._micro_batches = 0

    def accumulate(self) -> None:
        """Collective: end of one micro-batch. Its gradients (added into ``opt.grads``)
        are folded into the accumulated gradient and ``opt.grads`` may take the next
        micro-batch. Stage 2 reduce-scatters here and keeps only the local shard."""
        self._micro_batches += 1
        if self.stage == 1:
            return  # gradients keep summing in the whole-gradient buffer
        first = self._micro_batches == 1
        start = time.perf_counter()
        for bucket in self.layout.buckets:
            reduced = self.comm.reduce_scatter_inplace(
                self._grad[bucket.dtype][bucket.start : bucket.stop], bucket.counts
            )
            lo = bucket.shard_offset
            target = self._grad_shard[bucket.dtype][lo : lo + reduced.shape[0]]
            if first:
                np.copyto(target, reduced)
            else:
                np.add(target, reduced, out=target)
        for grad in self._grad.values():
            grad.fill(0)
        self.timings["reduce_scatter"] += time.perf_counter() - start

    def step(self) -> None:
        """Collective: average the gradients over ranks and micro-batches, run Adam on
        the local shard of every bucket, gather the updated parameters everywhere.
        Leaves ``opt.grads`` zeroed for the next backward."""
        if self._micro_batches == 0:
            self.accumulate()  # the gradients in opt.grads are the one micro-batch
        self.step_count += 1
        divisor = float(self.comm.size * self._micro_batches)
        clock = time.perf_counter
        for bucket in self.layout.buckets:
            dtype = bucket.dtype
            t0 = clock()
            if self.stage == 1:
                grad = self.comm.reduce_scatter_inplace(
                    self._grad[dtype][bucket.start : bucket.stop], bucket.counts
                )
            else:
                lo = bucket.shard_offset
                grad = self._grad_shard[dtype][lo : lo + bucket.counts[self.comm.rank]]
            t1 = clock()
            lo, hi = bucket.local(self.comm.rank)
            flat = self._flat[dtype][bucket.start : bucket.stop]
            s0 = bucket.shard_offset
            s1 = s0 + hi - lo
            adam_step(
                flat[lo:hi],
                grad,
                self._exp_avg[dtype][s0:s1],
                self._exp_avg_sq[dtype][s0:s1],
                self.step_count,
                self.config,
                self._scratch[dtype],
                divisor,
            )
            t2 = clock()
            self.comm.allgatherv_inplace(flat, bucket.counts, bucket.displs)
            t3 = clock()
            self.timings["reduce_scatter"] += t1 - t0
            self.timings["adam"] += t2 - t1
            self.timings["allgather"] += t3 - t2
        # Stage 1 consumed the whole gradient buffer; in stage 2 it only holds what was
        # added after the last accumulate(), which is not part of this step.
        for grad in self._grad.values():
            grad.fill(0)
        self._micro_batches = 0

    # -- inspection ------------------------------------------------------------

    def pop_timings(self) -> dict[str, float]:
        """Seconds spent per phase since the last call, and reset."""
        out, self.timings = self.timings, dict.fromkeys(PHASES, 0.0)
        return out

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank's optimizer holds, per category (the reference's four,
        plus the Adam kernel's scratch)."""
        return self.pool.usage()

    def gather_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Collective: the full (unsharded) ``exp_avg`` and ``exp_avg_sq`` of every
        parameter on every rank. Allocates full-size arrays: for checks and export,
        not for the training loop."""
        out: dict[str, dict[str, np.ndarray]] = {"exp_avg": {}, "exp_avg_sq": {}}
        for key, shards in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
            full = {dtype: np.zeros(size, dtype) for dtype, size in self.layout.sizes.items()}
            for bucket in self.layout.buckets:
                lo, hi = bucket.local(self.comm.rank)
                s0 = bucket.shard_offset
                part = full[bucket.dtype][bucket.start : bucket.stop]
                part[lo:hi] = shards[bucket.dtype][s0 : s0 + hi - lo]
                self.comm.allgatherv_inplace(part, bucket.counts, bucket.displs)
            for spec in self.layout.params:
                flat = full[spec.dtype][spec.offset : spec.offset + spec.size]
                out[key][spec.name] = flat.reshape(spec.shape)
        return out

    def __repr__(self) -> str:
        total = sum(self.layout.sizes.values())
        return (
            f"ZeroOptimizer(stage={self.stage}, params={total}, buckets="
            f"{len(self.layout.buckets)}, rank={self.comm.rank}/{self.comm.size})"
        )

