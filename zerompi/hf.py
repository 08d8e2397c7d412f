"""The Hugging Face ``transformers.Trainer`` on zerompi: :class:`ZeroMPITrainer`.

Under ``mpiexec -n W python train.py`` every process is one rank. The trainer runs
each rank as a *single* process as far as transformers and accelerate know (no
``torch.distributed``, no DDP wrapper) and zerompi does the data parallelism: the
training data is sliced by rank (accelerate's own ``BatchSamplerShard`` /
``IterableDatasetShard``, driven by the MPI rank), the model is sharded by
:func:`zerompi.torch.shard` with the optimizer ``TrainingArguments`` describe
(AdamW, HF's no-decay groups, ``max_grad_norm`` as zerompi's ``max_norm``) and
HF's scheduler is built over the :class:`zerompi.torch.ShardedOptimizer`.
``save_model`` writes full weights from any stage (only rank 0 writes; every rank
takes part in the gathers), and checkpoints hold zerompi's own single-file
checkpoint, which resumes at any world size and stage.

Importing this module does one thing outside the trainer: accelerate's
``PartialState`` no longer reads the launcher's world size (``PMI_SIZE``,
``OMPI_COMM_WORLD_SIZE``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) when the MPI world
has more than one process, so ``TrainingArguments(use_cpu=True)`` built under
``mpiexec`` sets up no CPU DDP of its own (which would reduce gradients a second
time, and fails without ``MASTER_ADDR``). transformers and torch are imported here,
never by ``import zerompi``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import random
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import has_length

from .config import ZeroConfig
from .mpi.collectives import Comm
from .torch import ShardedOptimizer, shard
from .torch._mapping import ACCEPTED, rule_of_class, torch_settings
from .torch._shard import torch_config

__all__ = ["ADAMW_OPTIMS", "OPTIMS", "ZERO_CHECKPOINT", "ZeroMPITrainer",
           "install_single_process_state"]

logger = logging.getLogger(__name__)

#: zerompi's checkpoint inside an HF checkpoint folder (``checkpoint-N/``).
ZERO_CHECKPOINT = "optimizer.zmpi"
#: HF's names of the files the scheduler and the torch optimizer's groups go to.
SCHEDULER_FILE = "scheduler.pt"
GROUPS_FILE = "optimizer.pt"
#: ``TrainingArguments.optim`` values zerompi steps as AdamW (the kernel differs only).
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
#: Every ``TrainingArguments.optim`` zerompi steps, and its rule: HF's ``"sgd"`` is
#: torch's SGD (``optim_args``: momentum, dampening, weight_decay, nesterov), its
#: ``"lion_32bit"`` bitsandbytes' Lion (betas from ``adam_beta1/2``), which zerompi
#: runs itself (bitsandbytes is not needed); ``"adamw_bnb_8bit"`` / ``"adamw_8bit"``
#: bitsandbytes' 8-bit AdamW, for which zerompi runs its own 8-bit states.
OPTIMS = {**dict.fromkeys(ADAMW_OPTIMS, "adam"), "sgd": "sgd", "lion_32bit": "lion",
          "adamw_bnb_8bit": "adam8bit", "adamw_8bit": "adam8bit"}  # fmt: skip
#: What accelerate reads to decide that this process is one of several.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_SIZE",
                      "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # fmt: skip


# -- one process as far as accelerate knows ----------------------------------------


@contextlib.contextmanager
def _hidden(names: tuple[str, ...]) -> Iterator[None]:
    """The environment without ``names`` inside the block (restored after)."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@functools.cache
def _mpi_world_size() -> int:
    return Comm(timeout=0).size


def install_single_process_state() -> None:
    """Make accelerate's first ``PartialState`` (built by ``TrainingArguments``) a
    single process when the MPI world has several: the launcher's variables are
    hidden while it decides. Idempotent; called on import."""
    original = PartialState.__init__
    if getattr(original, "_zerompi", False):
        return

    @functools.wraps(original)
    def __init__(self: PartialState, *args: Any, **kwargs: Any) -> None:
        if PartialState._shared_state or _mpi_world_size() == 1:
            original(self, *args, **kwargs)
            return
        with _hidden(LAUNCHER_VARIABLES):
            original(self, *args, **kwargs)

    __init__._zerompi = True  # type: ignore[attr-defined]
    PartialState.__init__ = __init__  # type: ignore[method-assign]


install_single_process_state()


def _single_process(args: TrainingArguments) -> None:
    """``args`` set up as one process, redone if they were built distributed (before
    this module was imported, or with a configured state)."""
    state = args.distributed_state
    if state is not None and state.distributed_type == DistributedType.NO:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    args.__dict__.pop("_setup_devices", None)  # a cached_property: computed again
    with _hidden(LAUNCHER_VARIABLES):
        args._setup_devices  # noqa: B018 - the property sets the state up
    state = args.distributed_state
    if state is None or state.distributed_type != DistributedType.NO:
        kind = None if state is None else state.distributed_type
        raise ValueError(f"ZeroMPITrainer: accelerate set up {kind} parallelism; zerompi "
                         "needs each rank as one process (no torch.distributed)")  # fmt: skip


def _local_rank(comm: Comm) -> int:
    """This rank's index among the ranks on its host (collective)."""
    hosts = comm.allgather(socket.gethostname())
    return hosts[: comm.rank].count(hosts[comm.rank])


def _claim_ranks(rank: int, local: int) -> None:
    """accelerate's process index = the MPI rank (its process count stays 1), so that
    ``args.should_save``/``should_log`` and ``is_world_process_zero()`` hold on rank
    0 only: files are written once."""
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared["process_index"] = rank
            shared["local_process_index"] = local


# -- what is mapped, what is refused -------------------------------------------------


def _refusals(args: TrainingArguments, keywords: dict[str, Any], config: Any) -> None:
    """Raise on what zerompi does not do (the same on every rank)."""
    given, cls_and_kwargs = _given_optimizer(keywords)
    if given is None and cls_and_kwargs is None:  # (else HF ignores optim too)
        optim = _optim(args)
        if optim not in OPTIMS:
            hint = (" (HF's own Adafactor variant; torch's: optimizer_cls_and_kwargs="
                    "(torch.optim.Adafactor, {...}))" if optim == "adafactor" else "")  # fmt: skip
            raise ValueError(f"ZeroMPITrainer: optim={optim!r} is not supported{hint}: zerompi "
                             f"steps the optimizer itself (accepted: {', '.join(OPTIMS)}; or "
                             f"one of {ACCEPTED} through optimizers=(optimizer, None) or "
                             "optimizer_cls_and_kwargs)")  # fmt: skip
        _optim_args(args)  # (malformed: an error here, on every rank)
    if args.deepspeed or args.fsdp:
        raise ValueError("ZeroMPITrainer: deepspeed/fsdp are other sharding engines; use "
                         "zero_config/stage instead")  # fmt: skip
    if args.fp16:
        raise ValueError("ZeroMPITrainer: fp16=True (torch's GradScaler) is not supported; "
                         "zerompi's own precision is ZeroConfig(param_dtype=...)")  # fmt: skip
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"zero_config must be a zerompi.ZeroConfig, got {type(config).__name__}")
    if config is not None and config.param_groups is not None:
        raise ValueError("ZeroMPITrainer: zero_config.param_groups are the trainer's (HF's "
                         "decay groups); override get_decay_parameter_names instead")  # fmt: skip


def _given_optimizer(keywords: dict[str, Any]) -> tuple[Any, Any]:
    """``optimizers=(optimizer, None)``'s optimizer and ``optimizer_cls_and_kwargs``,
    checked: a class zerompi maps (:mod:`zerompi.torch._mapping`), no scheduler of
    the user's (HF builds its own over the sharded optimizer), not both."""
    pair = keywords.get("optimizers") or (None, None)
    try:
        given, scheduler = pair
    except (TypeError, ValueError):
        raise ValueError(f"ZeroMPITrainer: optimizers must be a pair (optimizer, "
                         f"lr_scheduler), got {pair!r:.80}") from None  # fmt: skip
    if scheduler is not None:
        raise ValueError("ZeroMPITrainer: optimizers=(optimizer, lr_scheduler) with a "
                         "scheduler is not supported: it drives the torch optimizer, which "
                         "zerompi only reads; pass (optimizer, None) and HF builds the "
                         "scheduler TrainingArguments describe over zerompi's")  # fmt: skip
    if given is not None:
        rule_of_class(given, "ZeroMPITrainer")
    cls_and_kwargs = keywords.get("optimizer_cls_and_kwargs")
    if cls_and_kwargs is not None:
        if given is not None:
            raise ValueError("ZeroMPITrainer: optimizers=(optimizer, None) and "
                             "optimizer_cls_and_kwargs are two optimizers; give one")  # fmt: skip
        try:
            cls, kwargs = cls_and_kwargs
            dict(kwargs)
        except (TypeError, ValueError):
            raise ValueError(f"ZeroMPITrainer: optimizer_cls_and_kwargs must be (class, "
                             f"kwargs), got {cls_and_kwargs!r:.80}") from None  # fmt: skip
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
            raise TypeError(f"ZeroMPITrainer: optimizer_cls_and_kwargs[0] must be a "
                            f"torch.optim.Optimizer class, got {cls!r:.80}")  # fmt: skip
        rule_of_class(cls, "ZeroMPITrainer")
    return given, cls_and_kwargs


def _base_config(config: ZeroConfig | None, stage: int | None) -> ZeroConfig:
    """The settings the trainer starts from: ``config`` (else ``shard()``'s torch
    defaults), with ``stage`` when given."""
    return torch_config(config, {} if stage is None else {"stage": stage})


def _optim(args: TrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _optim_args(args: TrainingArguments) -> dict[str, str]:
    """``optim_args`` (``"momentum=0.9,nesterov=True"``) as HF reads it."""
    text = (args.optim_args or "").replace(" ", "")
    pairs = [item.split("=") for item in text.split(",") if item]
    bad = [item for item in pairs if len(item) != 2]
    if bad:
        raise ValueError(f"ZeroMPITrainer: optim_args={args.optim_args!r} is not a "
                         "comma-separated list of key=value")  # fmt: skip
    return dict(pairs)  # type: ignore[arg-type]


def adamw_settings(args: TrainingArguments) -> dict[str, Any]:
    """``TrainingArguments``' AdamW as zerompi settings (``adamw_torch``: decoupled
    weight decay; ``max_grad_norm`` <= 0: no clipping)."""
    return {
        "optimizer": "adam", "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay, "decoupled_weight_decay": True,
        "max_norm": _max_norm(args),
    }  # fmt: skip


def _max_norm(args: TrainingArguments) -> float | None:
    norm = args.max_grad_norm
    return norm if norm and norm > 0 else None


def optimizer_settings(args: TrainingArguments) -> dict[str, Any]:
    """The optimizer ``args.optim`` names as zerompi settings, as HF builds it: AdamW
    (:func:`adamw_settings`); ``"sgd"``: torch's SGD with ``optim_args``' momentum,
    dampening and nesterov (its weight decay an L2 term; the decay groups' values
    are ``args.weight_decay`` and 0, as HF's groups, which override ``optim_args``');
    ``"lion_32bit"``: Lion with betas ``(adam_beta1, adam_beta2)``, decoupled decay;
    ``"adamw_bnb_8bit"``/``"adamw_8bit"``: AdamW's settings with 8-bit states."""
    rule = OPTIMS[_optim(args)]
    if rule in ("adam", "adam8bit"):
        return {**adamw_settings(args), "optimizer": rule}
    common = {"optimizer": rule, "lr": args.learning_rate, "weight_decay": args.weight_decay,
              "max_norm": _max_norm(args)}  # fmt: skip
    if rule == "lion":
        return {**common, "betas": (args.adam_beta1, args.adam_beta2)}
    extra = _optim_args(args)
    return {**common, "momentum": float(extra.get("momentum", 0.0)),
            "dampening": float(extra.get("dampening", 0.0)),
            "nesterov": extra.get("nesterov", "false").lower() in ("true", "1", "yes"),
            "decoupled_weight_decay": False}  # fmt: skip


def decay_groups(
    model: torch.nn.Module, decay: set[str], weight_decay: float
) -> list[dict[str, Any]]:
    """HF's two groups by parameter name: ``decay`` with ``weight_decay``, the rest
    (biases, norms) without; an empty group left out."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [n for n in names if n in decay], "weight_decay": weight_decay},
              {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]  # fmt: skip
    return [g for g in groups if g["params"]]


# -- the training data by rank ---------------------------------------------------------


def _prepare_on_ranks(
    accelerator: Any, comm: Comm, data_loader: torch.utils.data.DataLoader,
    device_placement: bool | None = None, slice_fn_for_dispatch: Callable | None = None,
) -> torch.utils.data.DataLoader:  # fmt: skip
    """``Accelerator.prepare_data_loader`` with the MPI ranks as its processes: each
    rank gets its per-device batches of every global batch (as under DDP), the same
    number on every rank (``even_batches``), from one permutation (rank 0's seed).
    Batches are never dispatched (that would need torch.distributed)."""
    from accelerate.data_loader import prepare_data_loader

    config = accelerator.dataloader_config
    seed = config.data_seed if config.data_seed is not None else torch.random.initial_seed()
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=comm.size, process_index=comm.rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=list(accelerator.rng_types), dispatch_batches=False,
        even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=True, data_seed=comm.allgather(seed)[0],
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )  # fmt: skip
    accelerator._dataloaders.append(prepared)
    return prepared


# -- random states per rank ------------------------------------------------------------


def _rng_file(folder: str, comm: Comm) -> str:
    name = "rng_state.pth" if comm.size == 1 else f"rng_state_{comm.rank}.pth"
    return os.path.join(folder, name)


def _save_rng(folder: str, comm: Comm) -> None:
    states = {"python": random.getstate(), "numpy": np.random.get_state(),  # noqa: NPY002
              "cpu": torch.random.get_rng_state()}  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    torch.save(states, _rng_file(folder, comm))


def _load_rng(folder: str, comm: Comm) -> None:
    """This rank's random states (``rng_state_R.pth``, or ``rng_state.pth`` for rank
    0 of a one-process checkpoint); none there (another world size): kept as is."""
    path = _rng_file(folder, comm)
    if not os.path.isfile(path) and comm.rank == 0:
        path = os.path.join(folder, "rng_state.pth" if comm.size > 1 else "rng_state_0.pth")
    if not os.path.isfile(path):
        logger.info("no random state for rank %d in %s: not restored", comm.rank, folder)
        return
    with safe_globals():  # (numpy's state, allowlisted as HF does)
        states = torch.load(path, weights_only=True)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])  # noqa: NPY002 (HF's legacy global state)
    torch.random.set_rng_state(states["cpu"])


# -- the trainer ------------------------------------------------------------------------


class ZeroMPITrainer(Trainer):
    """``transformers.Trainer`` whose data parallelism is zerompi's, over MPI ranks.

    ``ZeroMPITrainer(model, args, ..., zero_config=ZeroConfig(...), stage=3,
    comm=None)``: every ``Trainer`` argument as usual, plus zerompi's config (stage,
    precision, shared memory, buckets, ...; default :data:`zerompi.torch.TORCH_DEFAULTS`,
    stage 2), ``stage`` over it, and the mpi4py communicator (default
    ``COMM_WORLD``). The optimizer (AdamW, SGD, Lion or 8-bit AdamW: :data:`OPTIMS`) and
    its settings, the decay groups and ``max_grad_norm`` come from ``args``; or the
    optimizer is a torch one zerompi maps (:mod:`zerompi.torch._mapping`: Adafactor,
    Muon, ...), given as ``optimizers=(optimizer, None)`` (its groups) or
    ``optimizer_cls_and_kwargs`` (built over HF's decay groups), read, never stepped;
    another ``optim``, a scheduler in ``optimizers``, deepspeed, fsdp and fp16 are
    refused. Build it,
    train, save and evaluate alike on every rank: an error found at construction or
    while saving is raised on every rank."""

    def __init__(
        self, model: Any = None, args: TrainingArguments | None = None, *trainer_args: Any,
        zero_config: ZeroConfig | None = None, stage: int | None = None, comm: Any = None,
        **trainer_kwargs: Any,
    ) -> None:  # fmt: skip
        self.comm = Comm(comm)
        #: The ShardedOptimizer, once training has built it (``create_optimizer``).
        self.sharded: ShardedOptimizer | None = None
        #: The model's parameters but its embeddings, counted before sharding (stage 3
        #: leaves them empty between forwards), for HF's FLOP estimate.
        self._counted: int | None = None
        self._ranks = (self.comm.rank, _local_rank(self.comm))
        with self.comm.verdict():
            if args is None:
                args = TrainingArguments(output_dir="tmp_trainer", use_cpu=True)
            _refusals(args, trainer_kwargs, zero_config)
            #: The user's torch optimizer (``optimizers=(optimizer, None)``) or class and
            #: keywords (``optimizer_cls_and_kwargs``), read at ``create_optimizer``;
            #: HF never sees them (it would step the torch optimizer).
            self._given, self._cls_and_kwargs = _given_optimizer(trainer_kwargs)
            trainer_kwargs.pop("optimizers", None)
            trainer_kwargs.pop("optimizer_cls_and_kwargs", None)
            self.zero_config = _base_config(zero_config, stage)
            _single_process(args)
            if args.device.type != "cpu":
                raise ValueError(f"ZeroMPITrainer trains on the CPU; args.device is "
                                 f"{args.device} (pass use_cpu=True)")  # fmt: skip
            _claim_ranks(*self._ranks)
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
            _claim_ranks(*self._ranks)  # (the Accelerator copied the state)

    # -- the optimizer ----------------------------------------------------------------

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Collective: shard the model (in place) with ``args``' optimizer and HF's decay
        groups; the ShardedOptimizer is the trainer's optimizer."""
        if self.optimizer is None:
            target = self.model if model is None else model
            if self.sharded is not None:  # a new model (model_init): the old one goes
                self.sharded.close()
            if hasattr(target, "num_parameters"):
                self._counted = target.num_parameters(exclude_embeddings=True)
            config = self.zero_config.replace(**self._settings(target))
            _, self.sharded = shard(target, config, comm=self.comm.mpi)
            self.optimizer = self.sharded
        return self.optimizer

    def _settings(self, model: torch.nn.Module) -> dict[str, Any]:
        """``shard()``'s optimizer settings: the user's torch optimizer read
        (:func:`zerompi.torch._mapping.torch_settings`; ``optimizer_cls_and_kwargs``
        built over HF's decay groups first, as HF does), else ``args.optim``'s with
        HF's decay groups; ``max_grad_norm`` as ``max_norm`` either way."""
        decay = set(self.get_decay_parameter_names(model))
        given = self._given
        if given is None and self._cls_and_kwargs is not None:
            cls, kwargs = self._cls_and_kwargs
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in trainable if n in decay],
                       "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in trainable if n not in decay],
                       "weight_decay": 0.0}]  # fmt: skip
            given = cls([g for g in groups if g["params"]], **dict(kwargs))
        if given is not None:
            return {**torch_settings(given, model, "ZeroMPITrainer"),
                    "max_norm": _max_norm(self.args)}  # fmt: skip
        groups = decay_groups(model, decay, self.args.weight_decay)
        return {**optimizer_settings(self.args), "param_groups": groups}

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        """Nothing: zerompi clips the global norm inside its step (``max_norm``); the
        gradients torch sees here are unreduced (stages 0-1) or handed over (2-3)."""
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm  # zerompi's norm is known after the step (see the log)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """HF's count of label tokens in the accumulated batch; with
        ``average_tokens_across_devices`` the count over all ranks divided by their
        number, so that zerompi's average over ranks makes the loss the mean over
        every rank's tokens (what HF does under DDP)."""
        local = super()._get_num_items_in_batch(batch_samples, device)
        if self.comm.size == 1 or not self.args.average_tokens_across_devices:
            return local
        value = np.nan if local is None else float(local)
        counts = self.comm.allgather_float64(np.array([value]))[:, 0]
        if local is None or np.isnan(counts).any():
            return local
        return torch.tensor(float(counts.sum()) / self.comm.size, device=device)

    # -- data ---------------------------------------------------------------------------

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """HF's training loader, sliced by rank (every rank: the same number of
        batches; checked)."""
        self.accelerator.prepare_data_loader = functools.partial(
            _prepare_on_ranks, self.accelerator, self.comm)  # fmt: skip
        try:
            loader = super().get_train_dataloader()
        finally:
            del self.accelerator.prepare_data_loader
        self.comm.check_same(len(loader) if has_length(loader) else None,
                             "the number of training batches per epoch")  # fmt: skip
        return loader

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        return super().get_total_train_batch_size(args) * self.comm.size

    # -- logging --------------------------------------------------------------------------

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any,
                                 *rest: Any, **keywords: Any) -> None:  # fmt: skip
        """The logged loss averaged over ranks (DDP's gather + mean) and zerompi's
        global gradient norm of the last step."""
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            if self.comm.size > 1:
                tr_loss.fill_(self.comm.sum(float(tr_loss)) / self.comm.size)
            if grad_norm is None and self.sharded is not None:
                grad_norm = self.sharded.zero.last_grad_norm
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *rest, **keywords)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """HF's estimate (6 x tokens x parameters) with the parameters counted before
        sharding."""
        if self._counted is None or not hasattr(self.model, "estimate_tokens"):
            return super().floating_point_ops(inputs)
        return 6 * self.model.estimate_tokens(inputs) * self._counted

    def store_flos(self) -> None:
        """Collective (HF calls it at the same points on every rank): the FLOPs of
        every rank, as HF sums them under DDP."""
        self.state.total_flos += self.comm.sum(float(self.current_flos))
        self.current_flos = 0

    # -- saving ---------------------------------------------------------------------------

    def train(self, *args: Any, **keywords: Any) -> Any:
        """HF's ``train()`` with the objects alive before it frozen for the garbage
        collector (``gc.freeze()``, undone after; left alone where the program froze
        some itself). HF's training begins with a full ``gc.collect()`` (accelerate's
        ``free_memory``, for GPU caches), which with transformers imported scans some
        440,000 objects that cannot be garbage — the modules, the model — for
        0.24-0.31 s on the development machine (``scripts/bench_hf_trainer.py``
        prints it), as does every full collection during the run; frozen, they are
        not scanned, and garbage the run makes still is."""
        _claim_ranks(*self._ranks)
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return super().train(*args, **keywords)
        finally:
            if freeze:
                gc.unfreeze()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: full weights with ``save_pretrained`` (safetensors), from any
        stage: rank 0 writes while every rank holds the gathered parameters; an error
        on rank 0 is raised on every rank, and the files exist once it returns."""
        _claim_ranks(*self._ranks)
        sharded = self.sharded
        full = sharded.full_parameters() if sharded is not None else contextlib.nullcontext()
        with full, self.comm.verdict():
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Collective: zerompi's checkpoint (parameters, moments, step; any world size
        and stage) as ``optimizer.zmpi``; the scheduler and the torch groups'
        settings (lr, betas, ...) as HF's files, written by rank 0."""
        self.sharded.save(os.path.join(output_dir, ZERO_CHECKPOINT))
        with self.comm.verdict():
            if self.args.should_save:
                torch.save(self.optimizer.state_dict(), os.path.join(output_dir, GROUPS_FILE))
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _save_rng_state(self, output_dir: str) -> None:
        with self.comm.verdict():
            _save_rng(output_dir, self.comm)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """HF's checkpoint (each collective part agreed on its own); trainer state and
        rotation on rank 0, agreed as well."""
        with self.comm.verdict():
            super()._save_checkpoint(model, trial)

    # -- resuming -------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights: HF's way into a model not sharded yet (``shard()`` then takes
        rank 0's); a sharded one gets them from zerompi's checkpoint later."""
        with self.comm.verdict():
            if self.sharded is None:
                super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Collective: zerompi's checkpoint (saved at any world size and stage), then
        the torch groups' settings and the scheduler."""
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ZERO_CHECKPOINT)
        found = os.path.isfile(path)
        self.comm.check_same(found, f"whether {path} exists")
        if found:
            self.sharded.load(path)
        else:
            logger.warning("%s has no %s: zerompi's optimizer state starts afresh",
                           checkpoint, ZERO_CHECKPOINT)  # fmt: skip
        with self.comm.verdict():
            groups = os.path.join(checkpoint, GROUPS_FILE)
            if found and os.path.isfile(groups):
                self.optimizer.load_state_dict(torch.load(groups, weights_only=True))
            scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
            if os.path.isfile(scheduler):
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            with self.comm.verdict():
                _load_rng(checkpoint, self.comm)

    def _load_best_model(self) -> None:
        """Collective: the best checkpoint's weights into the sharded model (each rank
        reads its own shards)."""
        if self.sharded is None:
            super()._load_best_model()
            return
        self.sharded.load_safetensors(self.state.best_model_checkpoint, strict=False)

    def close(self) -> None:
        """Collective: release zerompi's buffers' shared memory (the model keeps its
        parameters)."""
        if self.sharded is not None:
            self.sharded.close()
