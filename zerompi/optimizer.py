"""``ZeroOptimizer``: plain data parallelism (stage 0) and ZeRO stages 1-3 over MPI.

The front object a training loop holds. Its settings are one :class:`ZeroConfig`
(:mod:`zerompi.config`); everything it keeps and does is its
:class:`zerompi.engine.Engine` (``opt.engine``), built once by
:func:`zerompi.engine.build_engine`. Model code reads parameters and hands over
gradients layer by layer::

    for name in layers:                          # forward
        with opt.gathered(name) as p:            # stage 3 gathers the layer here
            h = forward(p, h)
    for name in reversed(layers):                # backward
        with opt.gathered(name) as p, opt.gradients(name) as g:
            d = backward(p, g, d)                # adds into g[...]; stages 2-3 reduce on exit
    opt.step()

Every method that can communicate is guarded (:func:`zerompi.guard.communicates`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from . import state
from . import step as pipeline
from .arrays import FlatArrays
from .config import ZeroConfig, settle
from .engine import Engine, build_engine
from .guard import communicates, survive
from .handover import Block, Found
from .mpi.collectives import Comm, Pending
from .mpi.launch import install_abort_hook
from .partition import Deferred, Layout
from .timings import PHASES

if TYPE_CHECKING:
    from mpi4py import MPI

    from .mpi.nodes import Nodes
    from .recovery import Recovery

__all__ = ["PHASES", "ZeroOptimizer"]


class ZeroOptimizer:
    """Sharded Adam/AdamW (stage 0 baseline, ZeRO stages 1-3) over an MPI communicator.

    ``ZeroOptimizer(params, config=None, *, comm=None, **keywords)``: ``params`` maps
    names to numpy arrays (or :class:`zerompi.Deferred`); ``config`` is a
    :class:`ZeroConfig` (default ``ZeroConfig()``) and ``keywords`` its settings by
    their flat names (``stage=3, lr=3e-3, param_dtype="bfloat16"``; see
    :meth:`ZeroConfig.replace`), applied over it. Building one is collective: the
    layout (names, order, shapes, dtypes) and every setting are checked to be
    identical on every rank, in one exchange, and any error is raised on every rank.
    Initial parameter values are broadcast from rank 0.

    Gradients are *added* (``+=``), like torch's ``.grad``. Each rank's contribution
    is averaged over ranks and over the micro-batches counted by ``accumulate()``;
    ``step()`` without any ``accumulate()`` counts one. A parameter whose gradient is
    never handed over in a step has a zero gradient in that step (in every stage).

    ``step()`` agrees over all ranks, in one small collective, on the number of
    non-finite elements of the averaged gradient, its global L2 norm
    (``opt.last_grad_norm``, before clipping), the step and micro-batch counts, every
    parameter group's settings and the fingerprint of the collective calls each rank
    made since the last step. Ranks that handed over different buckets, or a
    different number of micro-batches, get a
    :class:`zerompi.mpi.agreement.CollectiveError` on every rank, naming the first
    call that differs (the step's gradients are discarded, the state is untouched).
    A non-finite gradient or norm skips the step on every rank alike
    (``opt.skipped_steps``; with ``nonfinite="raise"`` every rank raises
    ``FloatingPointError``). With ``max_norm``, gradients are scaled by
    ``min(1, max_norm / (norm + 1e-6))``, torch's ``clip_grad_norm_``.

    In stages 0-2 ``opt.params[name]`` are persistent views of the full parameters,
    and ``opt.grads[name]`` full-size gradient views (in stage 2 a full staging buffer
    is allocated the first time ``opt.grads`` is used, which must be before the first
    ``accumulate()``/``step()``: the streamed hand-over is what keeps stage 2's
    gradients at ``1/W``). With ``elastic=True`` (Open MPI with ``mpiexec --with-ft
    ulfm``) a lost rank is survived from in-memory snapshots (:mod:`zerompi.recovery`):
    the survivors get :class:`zerompi.elastic.RankLost`.
    """

    def __init__(
        self, params: Mapping[str, np.ndarray | Deferred], config: ZeroConfig | None = None,
        *, comm: MPI.Intracomm | None = None, **keywords: Any,
    ) -> None:  # fmt: skip
        install_abort_hook()  # an uncaught exception on any rank aborts the whole job
        world = Comm(comm, timeout=0)  # the watchdog is armed once the settings agree
        settings, layout = settle(world, params, config, keywords)
        #: Every lost rank survived so far (:meth:`zerompi.elastic.RankLost.record`).
        self.recoveries: list[dict[str, Any]] = []
        self._recovery: Recovery | None = None
        #: Called, without arguments, at the end of every recovery, once the engine
        #: for the survivors is in place and before :class:`zerompi.elastic.RankLost`
        #: is raised: what holds views of the old engine's buffers re-points them
        #: (the torch adapter's module, :func:`zerompi.torch.shard`).
        self.on_recovery: list[Callable[[], None]] = []
        if settings.config.elastic.enabled:
            from .recovery import Recovery

            self._recovery = Recovery()
        #: The engine: every buffer, strategy and counter of this optimizer.
        self.engine: Engine = build_engine(settings, world, layout, params, self._handed_over)
        self.engine.snapshots.restart(self.engine)  # elastic: the initial state

    # -- what it is ------------------------------------------------------------------

    @property
    def config(self) -> ZeroConfig:
        return self.engine.config

    @property
    def comm(self) -> Comm:
        """The communicator (:class:`zerompi.mpi.collectives.Comm`; ``.mpi`` is mpi4py's)."""
        return self.engine.comm

    @property
    def layout(self) -> Layout:
        return self.engine.layout

    @property
    def nodes(self) -> Nodes:
        """How the ranks sit on nodes (:class:`zerompi.mpi.nodes.Nodes`)."""
        return self.engine.nodes

    @property
    def stage(self) -> int:
        return self.engine.stage

    @property
    def shared_memory(self) -> bool:
        """Whether node shared memory is in use (:func:`zerompi.engine.choose_shared`)."""
        return self.engine.shared_memory

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because the averaged gradient was not finite."""
        return self.engine.skipped_steps

    @property
    def last_grad_norm(self) -> float:
        """Global L2 norm of the last step's averaged gradient, before clipping."""
        return self.engine.last_grad_norm

    @property
    def loss_scale(self) -> float:
        """What the model multiplies its loss gradient by (1.0 without loss scaling);
        ``step()`` divides it back out (:class:`zerompi.precision.LossScale`)."""
        return self.engine.loss_scale

    def __repr__(self) -> str:
        e = self.engine
        return (f"ZeroOptimizer(stage={e.stage}, params={sum(e.layout.sizes.values())}, "
                f"buckets={len(e.layout.buckets)}, rank={e.comm.rank}/{e.comm.size})")  # fmt: skip

    # -- hand-over ---------------------------------------------------------------------

    @property
    def params(self) -> FlatArrays:
        """Name -> full parameter (a view into the flat buffer). Stages 0-2 only."""
        return self.engine.access.params

    @property
    def resident_params(self) -> FlatArrays | None:
        """Name -> full parameter view where this rank holds every parameter all the
        time (stages 0-2; stage 3 on one node with node memory: the node's copy), in
        ``param_dtype``; else ``None`` (stage 3 gathers: :meth:`gather_into`)."""
        return self.engine.access.resident

    @property
    def grads(self) -> FlatArrays:
        """Name -> full-size gradient view to add into. Stages 0-2; in stage 2 this
        allocates a full staging buffer on first use, which must come before the first
        ``accumulate()``/``step()`` on that rank (hand gradients over with
        ``opt.gradients(names)`` instead to keep them at ``1/W``)."""
        return self.engine.reducer.grads

    @communicates
    def gathered(self, *names: str) -> Block:
        """``with opt.gathered(*names) as p``: the full parameters ``names`` (parameter
        or group names) for the duration of the block. Stage 3 gathers their bucket
        (collective: every rank must enter it) and releases it on exit; the arrays must
        not be used after the block (``ZEROMPI_DEBUG=1`` fills them with NaN on exit).
        Stages 0-2: the persistent views."""
        self._live("gathered")
        engine = self.engine
        return engine.access.gathered(engine.names.find(names))

    @communicates
    def gradients(self, *names: str) -> Block:
        """``with opt.gradients(*names) as g``: arrays to *add* the gradients of
        ``names`` into. On a normal exit they are handed over: in stages 2-3, once
        every parameter of a bucket has been handed over in this micro-batch, the
        bucket is reduce-scattered (collective) and only this rank's shard kept.
        Stages 0-1: views into the full gradient buffer."""
        self._live("gradients")
        engine = self.engine
        with engine.timings.reduce:
            return engine.reducer.block(engine.names.find(names))

    @communicates
    def add_gradients(self, grads: Mapping[str, np.ndarray]) -> None:
        """``with opt.gradients(*grads) as g:`` adding each array of ``grads`` (name
        -> gradient of that parameter's shape or size) into ``g[name]``, in one call
        and one pass over memory: in stages 2-3 a parameter's first hand-over in a
        micro-batch is copied into its staging region, not added to a zero-filled one.
        The names must be of one bucket at stages 2-3, as for ``gradients``."""
        self._live("gradients")
        engine = self.engine
        engine.reducer.add(engine.names.find(tuple(grads)), grads, engine.timings.reduce)

    @communicates
    def _handed_over(self, found: Found) -> None:
        """The end of an ``opt.gradients`` block (collective in stages 2-3)."""
        self.engine.handed_over(found)

    @communicates
    def gather_into(self, index: int, out: np.ndarray) -> None:
        """Collective: bucket ``index``'s full parameters (in ``param_dtype``) into
        ``out``, memory the caller owns (the torch adapter's per-module storages).
        Stage 3 without a node copy; recorded in the step's fingerprint like a
        ``gathered`` block."""
        engine = self.engine
        bucket = engine.layout.buckets[index]
        with engine.timings.gather:
            engine.comm.plan_allgatherv(out, bucket.counts, bucket.displs, index,
                                        send=engine.parts[index].gather_source).run()  # fmt: skip

    @communicates
    def start_gather_into(self, index: int, out: np.ndarray) -> Pending:
        """Collective, nonblocking: :meth:`gather_into` started; ``out`` belongs to MPI
        until the returned request's ``wait()`` (the torch adapter's stage-3 prefetch:
        the next module's gather moves while the current one computes)."""
        engine = self.engine
        bucket = engine.layout.buckets[index]
        source = engine.parts[index].gather_source
        planned = engine.comm.plan_allgatherv(out, bucket.counts, bucket.displs, index,
                                              send=source)  # fmt: skip
        return planned.start()

    # -- the step ----------------------------------------------------------------------

    @communicates
    def accumulate(self) -> None:
        """End of one micro-batch: its gradients are folded into the accumulated
        gradient and the gradient buffers take the next one. No collective of its
        own (the step's agreement checks that every rank counted alike), except where
        a micro-batch must be reduced at once: stage 2's ``opt.grads`` mode, and
        gradients narrower than the master at stages 0-1 (never accumulated in 16
        bits); there a rank that counts differently is ended by the watchdog."""
        self._live("accumulate")
        pipeline.accumulate(self.engine)

    @communicates
    def fold(self) -> None:
        """Fold the gradients added so far into the accumulated gradient *without*
        counting a micro-batch (torch's semantics: several ``backward()`` calls are
        summed). Only gradients narrower than the master at stages 0-1 are held in a
        buffer of their own dtype until folded (a collective there; elsewhere nothing
        to do), so the torch adapter folds after every backward."""
        self._live("fold")
        with self.engine.timings.reduce:
            self.engine.reducer.fold()

    @communicates
    def step(self) -> None:
        """Collective: reduce -> agree -> skip or clip -> Adam -> gather
        (:mod:`zerompi.step`). Leaves every gradient buffer zeroed."""
        self._live("step")
        pipeline.step(self.engine)

    @communicates
    def zero_grad(self) -> None:
        """Discard every gradient added or accumulated since the last step (it waits
        for the reductions in flight)."""
        self._live("zero_grad")
        self.engine.discard()

    def pop_timings(self) -> dict[str, float]:
        """Seconds spent per phase (:data:`zerompi.timings.PHASES`) since the last call."""
        return self.engine.timings.pop()

    # -- state ---------------------------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds, per category (:data:`zerompi.buffers.CATEGORIES`): a
        node-shared buffer counts this rank's share."""
        return self.engine.memory_usage()

    def memory_buffers(self) -> dict[str, int]:
        """Bytes per named buffer (``grad_bucket.float32``, ``exp_avg.float32``, ...)."""
        return self.engine.memory_buffers()

    @communicates
    def full_params(self) -> dict[str, np.ndarray]:
        """Collective: a copy of every full parameter in its master dtype, on every rank."""
        return state.full_params(self.engine)

    @communicates
    def gather_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Collective: the full states of the update rule (Adam: ``exp_avg`` and
        ``exp_avg_sq``; SGD: ``momentum_buffer``; Lion: ``exp_avg``) of every parameter,
        by state name, then parameter name."""
        return state.gather_state(self.engine)

    def hyperparameters(self) -> dict[str, Any]:
        """The update rule, its states and every parameter group's settings, as a
        checkpoint records them."""
        return state.hyperparameters(self.engine)

    def param_group(self, name: str) -> int:
        """The parameter group of parameter ``name`` (0: the config's settings)."""
        return self.engine.member[name]

    def set_hyperparameters(self, group: int = 0, **settings: float) -> None:
        """Change a parameter group's settings (the rule's
        :attr:`zerompi.rules.Rule.settings`: Adam's ``lr``, ``beta1``, ``beta2``,
        ``eps``, ``weight_decay``) from the next step on (a schedule). Call it alike
        on every rank: while the ranks' settings differ, every ``step()`` fails on
        every rank with :class:`zerompi.mpi.agreement.CollectiveError` before Adam runs."""
        state.set_hyperparameters(self.engine, group, **settings)

    @communicates
    def save(self, path: str) -> None:
        """Collective: the state to the single file ``path`` (:mod:`zerompi.checkpoint`),
        each rank writing its shards with MPI-IO; ``path`` holds either the previous
        checkpoint or the complete new one, and an error on any rank is raised on every
        rank."""
        from . import checkpoint  # not at import: keeps `python -m zerompi.checkpoint` clean

        checkpoint.save(self.engine, path)

    @communicates
    def load(self, path: str) -> dict:
        """Collective: restore parameters, Adam moments and counters from a checkpoint
        saved at any world size and stage (this optimizer keeps its settings). Every
        checksum is verified first: on any error every rank raises
        :class:`zerompi.checkpoint.CheckpointError` and the state is untouched."""
        from . import checkpoint

        return checkpoint.load(self.engine, path)

    @communicates
    def load_safetensors(self, path: str, strict: bool = True) -> None:
        """Collective: the parameters from the safetensors file or directory ``path``
        (``model.safetensors``, or a ``model.safetensors.index.json`` and its files, as
        Hugging Face writes them; :mod:`zerompi.checkpoint.safetensors`), each rank
        reading only the bytes of its own shards. Every parameter must be in the file
        with its shape; values are converted to the master dtype (``same_kind``).
        ``strict``: refuse tensors that are not parameters here. The Adam moments and
        counters are kept. On any error every rank raises
        :class:`zerompi.checkpoint.CheckpointError` and the state is untouched."""
        from . import checkpoint

        checkpoint.load_safetensors(self.engine, path, strict)

    # -- lifetime ------------------------------------------------------------------------

    def survive(self) -> AbstractContextManager[None]:
        """``with opt.survive():`` around the caller's own collectives on ``opt.comm``:
        a failed peer seen inside becomes a recovery, and
        :class:`zerompi.elastic.RankLost` is raised on every survivor. Without
        ``elastic=True`` it does nothing."""
        return survive(self)

    @communicates
    def close(self) -> None:
        """Collective: finish what is in flight and release the shared-memory segments.
        Arrays handed out before stay valid; the optimizer can still be inspected and
        saved, not trained. ``with ZeroOptimizer(...) as opt:`` calls it on a normal
        exit."""
        self.engine.close()

    def _live(self, what: str) -> None:
        """Refuse training calls after ``close()``, before touching any state."""
        if self.engine.closed:
            raise RuntimeError(
                f"opt.{what}() after close(): this optimizer was closed (its staging and "
                "shared-memory buffers are released); its parameters can still be read "
                "and saved, not trained"
            )

    def __enter__(self) -> ZeroOptimizer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Not while an exception propagates: it may be on this rank only, and close()
        # is collective; the abort hook ends the world instead.
        if exc_type is None:
            self.close()

