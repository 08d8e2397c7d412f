"""``ZeroOptimizer``: plain data parallelism (stage 0) and ZeRO stages 1-3 over MPI.

The model's parameters are packed into one flat buffer per dtype, cut into buckets
and sharded with :func:`zerompi.partition.shard_range`. What a stage keeps and moves
is data (:mod:`zerompi.plan`); ``step()`` is one pipeline for all of them::

    reduce -> agree (statistics + fingerprint) -> skip or clip -> Adam -> gather

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
allocated the first time ``opt.grads`` is used, which must be before the first
``accumulate()``/``step()``: the streamed hand-over is what keeps stage 2's
gradients at ``1/W``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .adam import AdamConfig, adam_step, sr_key
from .allocate import Allocation
from .arrays import check_failure_settings, check_params
from .elastic import is_restored
from .handover import HandOver
from .mpi.agreement import CollectiveError, agree_step
from .mpi.collectives import Comm
from .mpi.launch import check_world, install_abort_hook
from .mpi.nodes import nodes_of
from .mpi.watchdog import resolve_timeout
from .partition import DEFAULT_BUCKET_ELEMS, Deferred, default_group, optimizer_layout
from .plan import choose_shared
from .precision import precision_settings
from .recovery import Elastic, check_elastic, elastic_setup
from .settings import group_configs, settings_token
from .state import PHASES, OptimizerState

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["PHASES", "ZeroOptimizer"]


class ZeroOptimizer(Elastic, HandOver, OptimizerState, Allocation):
    """Sharded Adam/AdamW (stage 0 baseline, ZeRO stages 1-3) over an MPI communicator.

    Building one is collective: the layout (names, order, shapes, dtypes), stage and
    settings are checked to be identical on every rank, and any error is raised on
    every rank. Initial parameter values are broadcast from rank 0.

    Gradients are *added* (``+=``), like torch's ``.grad``. Each rank's contribution
    is averaged over ranks and over the micro-batches counted by ``accumulate()``;
    ``step()`` without any ``accumulate()`` counts one. A parameter whose gradient is
    never handed over in a step has a zero gradient in that step (in every stage).

    ``step()`` agrees over all ranks, in one small collective, on the number of
    non-finite elements of the averaged gradient, its global L2 norm
    (``opt.last_grad_norm``, before clipping), the step and micro-batch counts and
    the fingerprint of the collective calls each rank made since the last step. Ranks
    that handed over different buckets, or a different number of micro-batches, get
    a :class:`CollectiveError` on every rank, naming the first call that differs (the
    step's gradients are discarded, the state is untouched). A non-finite gradient or
    norm skips the step on every rank alike (``opt.skipped_steps``; with
    ``nonfinite="raise"`` every rank raises ``FloatingPointError``). With
    ``max_norm``, gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``,
    torch's ``clip_grad_norm_``.

    Mixed precision (:mod:`zerompi.precision`): ``param_dtype`` (``"bfloat16"``,
    ``"float16"``) is the dtype the model reads and the gather moves, ``reduce_dtype``
    that of the gradients it hands over and of the reduction's wire; ``loss_scale``
    (``"dynamic"``, a number): the model multiplies its loss gradient by
    ``opt.loss_scale``. ``rounding="stochastic"`` rounds the bfloat16 copy so.
    ``param_groups`` (torch's): other settings for the parameters a group lists
    (:mod:`zerompi.settings`); ``set_hyperparameters`` changes them between steps.
    ``gather_buffers=False`` (stage 3): no buffers for ``gathered()``; the caller
    gathers into its own memory with ``gather_into`` (the torch adapter).
    ``timeout`` (seconds; default ``$ZEROMPI_TIMEOUT``, else 600; ``0``/``"none"``:
    off) bounds every wait inside zerompi, then aborts (:mod:`zerompi.mpi.watchdog`).
    ``elastic=True`` (Open MPI with ``mpiexec --with-ft ulfm``): survive a lost rank,
    from in-memory snapshots taken every ``snapshot_every`` batches
    (:mod:`zerompi.elastic`, :mod:`zerompi.recovery`); survivors get ``RankLost``.
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray | Deferred],
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
        shared_memory: bool | None = None,
        timeout: float | str | None = None,
        param_dtype: object = None,
        reduce_dtype: object = None,
        loss_scale: object = None,
        rounding: str = "nearest",
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        gather_buffers: bool = True,
        elastic: bool = False,
        snapshot_every: int = 10,
    ) -> None:
        args = {k: v for k, v in locals().items() if k not in ("self", "params", "comm")}
        install_abort_hook()  # an uncaught exception on any rank aborts the whole job
        self.comm = Comm(comm, timeout=0)  # the watchdog is armed once settings agree
        error: BaseException | None = None
        specs: list[tuple[str, tuple[int, ...], np.dtype]] = []
        keys: list[str] = []
        seconds: float | None = None
        dtypes: tuple[object, ...] = ()
        try:
            check_world()
            specs = check_params(params)
            try:
                b1, b2 = betas
            except (TypeError, ValueError):
                raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
            base = AdamConfig(lr, b1, b2, eps, weight_decay, decoupled_weight_decay)
            names = [name for name, _, _ in specs]
            self.configs, self._member = group_configs(base, param_groups, names)
            self.layout = optimizer_layout(
                specs, self.comm.size, self.comm.rank, stage, bucket_elems, group_of
            )
            keys = [group_of(name) for name, _, _ in specs]
            self.max_norm = check_failure_settings(max_norm, nonfinite)
            self.nonfinite = nonfinite
            for name, flag in (("overlap", overlap), ("shared_memory", shared_memory)):
                if not isinstance(flag, bool) and (name == "overlap" or flag is not None):
                    raise TypeError(f"{name} must be a bool, got {flag!r:.60}")
            seconds = resolve_timeout(timeout)
            shared_memory = check_elastic(elastic, snapshot_every, shared_memory)
            self.precisions, self.scaler, dtypes = precision_settings(
                list(self.layout.sizes), param_dtype, reduce_dtype, loss_scale, nonfinite,
                rounding,
            )  # fmt: skip
            self.rounding = rounding
        except Exception as exc:  # whatever it is, every rank must hear of it
            error = exc
        comm_ = self.comm
        comm_.agree(error)
        comm_.check_same(
            [(n, s, d.str, k) for (n, s, d), k in zip(specs, keys, strict=True)],
            "the parameter layout (name, shape, dtype, group)",
        )
        comm_.check_same(
            (stage, self.configs, sorted(self._member.items()), int(bucket_elems)),
            "the optimizer settings (stage, hyperparameters, param_groups, bucket_elems)",
        )
        comm_.check_same((self.max_norm, nonfinite), "the failure settings (max_norm, nonfinite)")
        comm_.check_same((overlap, shared_memory, bool(gather_buffers)),
                         "(overlap, shared_memory, gather_buffers)")  # fmt: skip
        comm_.check_same(seconds, "the watchdog timeout (timeout or ZEROMPI_TIMEOUT)")
        comm_.check_same((elastic, snapshot_every), "(elastic, snapshot_every)")
        comm_.check_same(dtypes, "the precision settings (param_dtype, reduce_dtype, loss_scale)")
        comm_.timeout = seconds
        self._elastic_args = elastic_setup(comm_, args) if elastic else None
        if not elastic:  # a node heartbeat in shared memory: not with a rank to lose
            comm_.enable_heartbeat()
        comm_.describe = self._describe
        self.stage, self.overlap, self._gather_buffers = stage, overlap, bool(gather_buffers)
        self.nodes = nodes_of(comm_)  # how the ranks sit on nodes (:mod:`zerompi.mpi.nodes`)
        #: Whether node shared memory is in use (:func:`zerompi.plan.choose_shared`).
        self.shared_memory = choose_shared(
            shared_memory, stage, comm_, self.nodes, lambda: self._plan_buffers(True))
        self.plan = self._stage_plan(self.shared_memory)
        self._closed, self.step_count = False, 0
        #: Steps skipped because the averaged gradient was not finite.
        self.skipped_steps = 0
        #: Global L2 norm of the last step's averaged gradient, before clipping
        #: (``nan`` before the first step; ``inf`` or ``nan`` for a skipped step).
        self.last_grad_norm = math.nan
        self.timings = dict.fromkeys(PHASES, 0.0)
        self._order = list(params)
        self._micro_batches = 0
        self._gathered: tuple[int, int] | None = None  # stage 3: (bucket, slot) in use
        self._stats = np.zeros(8)  # this rank's row of the step agreement
        self.recoveries: list[dict[str, Any]] = []
        self._allocate(params)
        comm_.step = 1
        if elastic:
            self._install_guards()
            if not is_restored(params):  # (a recovery snapshots what it restores)
                self._snapshots.restart(self)  # the initial state

    def _describe(self, index: int) -> str:
        """Bucket ``index`` in words, for error messages and the watchdog."""
        bucket = self.layout.buckets[index]
        names = ", ".join(bucket.names[:3]) + (", ..." if len(bucket.names) > 3 else "")
        return f"bucket {index} [{names}]"

    @property
    def loss_scale(self) -> float:
        """What the model multiplies its loss gradient by (1.0 without loss scaling;
        float16 gradients default to dynamic scaling, :class:`zerompi.precision.LossScale`);
        ``step()`` divides it back out."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def zero_grad(self) -> None:
        """Discard every gradient added or accumulated since the last step."""
        self._live("zero_grad")
        self._discard()

    def _discard(self) -> None:
        self.reducer.discard()
        self._micro_batches = 0

    def accumulate(self) -> None:
        """End of one micro-batch: its gradients are folded into the accumulated
        gradient and the gradient buffers take the next one. No collective of its
        own (the step's agreement checks that every rank counted alike), except where
        a micro-batch must be reduced at once: stage 2's ``opt.grads`` mode, and
        16-bit gradients at stages 0-1 (never accumulated in 16 bits); there a rank
        that counts differently is ended by the watchdog."""
        self._live("accumulate")
        self._micro_batches += 1
        start = time.perf_counter()
        self.reducer.end_micro_batch()
        self.timings["reduce_scatter"] += time.perf_counter() - start

    def step(self) -> None:
        """Collective: reduce -> agree -> skip or clip -> Adam -> gather.

        Averages the gradients over ranks and micro-batches, agrees on their
        statistics and on the collective calls made, skips a non-finite step on
        every rank, clips if ``max_norm`` is set, runs Adam on this rank's part of
        every bucket and publishes the updated parameters. Leaves every gradient
        buffer zeroed."""
        self._live("step")
        self._gathers_done()  # stage 3: no gather may read the shards Adam will write
        self._snapshots.settle()  # nor a snapshot's messages still read them
        if self._micro_batches == 0:
            self.accumulate()  # what was handed over is the one micro-batch
        else:
            self.reducer.flush()
        clock = time.perf_counter
        t0 = clock()
        stats = self._reduce()
        norm, nonfinite = self._agree(stats)
        self._snapshots.commit()  # every rank's snapshot messages are complete
        self.timings["reduce_scatter"] += clock() - t0
        divisor = float(self.comm.size * self._micro_batches) * self.loss_scale
        scaler = self.scaler
        if nonfinite or not math.isfinite(norm):
            if scaler is not None:  # an overflow: the scale comes down, on every rank alike
                scaler.update(True, self.step_count + 1)
            return self._skip(nonfinite)
        if scaler is not None:
            scaler.update(False, self.step_count + 1)
        if self.max_norm is not None:
            coef = self.max_norm / (norm + 1e-6)
            if coef < 1.0:  # torch's clip_grad_norm_: scale by min(1, coef)
                divisor /= coef
        self.step_count += 1
        self._adam(divisor)
        t2 = clock()
        self.gatherer.finish()
        self.timings["allgather"] += clock() - t2
        self._end_step()

    def _reduce(self) -> np.ndarray:
        """Every bucket's reduction, and this rank's row of the agreement."""
        stats = self._stats
        stats[:2] = 0.0
        runs, fused = self._stats_runs, self.reducer.fused

        def visit(index: int) -> None:  # bucket `index` is reduced
            runs.add(index, fused, stats)

        self.reducer.reduce(visit)
        stats[2], stats[3] = self.step_count, self._micro_batches
        stats[4:7], stats[7] = self.comm.fingerprint.words(), settings_token(self.configs)
        return stats

    def _agree(self, stats: np.ndarray) -> tuple[float, int]:
        """The step's one small collective (:func:`agree_step`); on disagreement the
        gradients are discarded and every rank raises :class:`CollectiveError`."""
        try:
            nonfinite, sumsq = agree_step(self.comm, stats, self._describe, self.step_count + 1)
        except CollectiveError:
            self._discard()
            raise
        norm = math.sqrt(sumsq) / (float(self.comm.size * self._micro_batches) * self.loss_scale)
        self.last_grad_norm = norm
        return norm, nonfinite

    def _skip(self, nonfinite: int) -> None:
        """A non-finite gradient or norm: the same on every rank, state untouched."""
        self.skipped_steps += 1
        self._discard()
        self.comm.step = self.step_count + 1
        self._snapshots.after_step(self)
        if self.nonfinite == "raise":
            what = (
                f"has {nonfinite} non-finite element(s)" if nonfinite
                else f"has a norm that overflows ({self.last_grad_norm})"
            )  # fmt: skip
            raise FloatingPointError(
                f"step {self.step_count + 1}: the averaged gradient {what} over "
                f"{self.comm.size} rank(s); the step was skipped (parameters and Adam "
                "state unchanged)"
            )

    def _adam(self, divisor: float) -> None:
        """Adam on this rank's part, bucket by bucket, in chunks; each bucket's gather
        starts as soon as its part is updated and advances between the chunks."""
        clock = time.perf_counter
        adam_s = gather_s = 0.0
        step_count, configs, gatherer = self.step_count, self.configs, self.gatherer
        chunk = gatherer.chunk
        key = sr_key(step_count) if self.rounding == "stochastic" else None
        for run, base, segs in zip(self._adam_runs, self._low_bases, self._segments, strict=True):
            (param, grad, m, v, low), scratch = run.arrays, run.scratch
            for lo, hi, config in ((lo, min(lo + chunk, stop), configs[group])
                                   for start, stop, group in segs
                                   for lo in range(start, stop, chunk)):  # fmt: skip
                sr = None if key is None or low is None else (key, base + lo)
                t1 = clock()
                adam_step(param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step_count, config,
                          scratch, divisor, low=None if low is None else low[lo:hi],
                          stochastic=sr)  # fmt: skip
                t2 = clock()
                adam_s += t2 - t1
                gatherer.progress()
                gather_s += clock() - t2
            t2 = clock()
            gatherer.started(run.last)  # a run is one bucket where gathers start per bucket
            gather_s += clock() - t2
        self.timings["adam"] += adam_s
        self.timings["allgather"] += gather_s

    def _end_step(self) -> None:
        self.reducer.consumed()
        self._micro_batches = 0
        self.comm.step = self.step_count + 1
        self._snapshots.after_step(self)

    def close(self) -> None:
        """Collective: finish what is in flight and release the shared-memory
        segments. Arrays handed out before stay valid; the optimizer can still be
        inspected and saved, not trained. ``with ZeroOptimizer(...) as opt:`` calls
        it on a normal exit."""
        if not self._closed:
            self._gathers_done()
            self.reducer.close()
            self.pool.close()
            self._closed = True
