"""``ZeroMPIStrategy``: a Lightning strategy whose model is sharded by zerompi.

One process per rank, started by ``mpiexec``/``srun``: Lightning spawns nothing and
``torch.distributed`` is never initialised (no DDP wrapper: zerompi reduces the
gradients itself). At ``fit`` the strategy reads ``configure_optimizers``' optimizer
(AdamW, Adam, SGD, Adafactor, Muon, 8-bit AdamW: :mod:`zerompi.torch._mapping`) and the
Trainer's clipping, calls :func:`zerompi.torch.shard` on the LightningModule
with those settings (:mod:`._optimizers`), and hands Lightning the
:class:`zerompi.torch.ShardedOptimizer` and the re-pointed LR schedulers. Lightning's
collectives (``reduce`` for ``self.log(..., sync_dist=True)``, ``broadcast``,
``all_gather``, ``barrier``) run on zerompi's communicator; checkpoints are
directories (:mod:`._checkpoint`). Every refusal is raised on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ..config import ZeroConfig
from ..mpi.collectives import Comm
from ..torch import ShardedOptimizer, shard
from ..torch._optim import _MANAGED
from . import _checkpoint
from ._environment import ZeroMPIEnvironment, gather_tensor, reduce_tensor
from ._optimizers import repoint_schedulers, shard_settings

#: ``shard()`` settings that come from ``configure_optimizers`` and the Trainer, not
#: from the strategy's keywords.
FROM_THE_OPTIMIZER = ("optimizer", "lr", "betas", "eps", "momentum", "dampening", "nesterov",
                      "weight_decay", "decoupled_weight_decay", "param_groups", "max_norm",
                      "beta2_decay", "eps1", "eps2", "d", "muon_momentum", "muon_nesterov",
                      "ns_steps", "match_rms")  # fmt: skip


class ZeroMPIPrecision(Precision):
    """Lightning's float32 precision, with gradient clipping left to zerompi's step
    (``max_norm``, over the global gradient norm): torch's clipping of ``.grad`` would
    see one rank's unreduced gradients (stages 0-1) or none (stages 2-3)."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__()
        self.max_norm = max_norm

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
        gradient_clip_algorithm: Any = "norm",
    ) -> None:  # fmt: skip
        if not clip_val:
            return
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))
        if algorithm != "norm" or float(clip_val) != self.max_norm:
            raise ValueError(
                f"zerompi.lightning: clip_gradients({clip_val}, {algorithm!r}) differs from the "
                f"max_norm zerompi clips with inside its step ({self.max_norm}): set "
                "Trainer(gradient_clip_val=...) and leave configure_gradient_clipping alone"
            )


class ZeroMPIStrategy(ParallelStrategy):
    """Train a ``LightningModule`` sharded by zerompi, under ``mpiexec -n W`` or ``srun``.

    ``ZeroMPIStrategy(stage=2)`` or ``Trainer(strategy="zerompi")``; ``config`` (a
    :class:`zerompi.ZeroConfig`) and ``keywords`` are :func:`zerompi.torch.shard`'s
    (``stage``, ``shared_memory``, ``param_dtype``, ``bucket_elems``, ...), except what
    the optimizer and the Trainer say (:data:`FROM_THE_OPTIMIZER`: the optimizer's settings and
    groups from ``configure_optimizers``, ``max_norm`` from ``gradient_clip_val``).
    ``comm``: an mpi4py intracommunicator (default ``COMM_WORLD``). Collective to
    build: construct it on every rank."""

    strategy_name = "zerompi"

    def __init__(
        self, config: ZeroConfig | None = None, *, comm: Any = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None, precision_plugin: Precision | None = None,
        **keywords: Any,
    ) -> None:  # fmt: skip
        given = sorted(set(keywords) & set(FROM_THE_OPTIMIZER))
        if given:
            raise ValueError(
                f"zerompi.lightning: {', '.join(given)} come from configure_optimizers' "
                "optimizer (and max_norm from Trainer(gradient_clip_val=...)), not from "
                "ZeroMPIStrategy"
            )
        self.comm = Comm(comm)
        environment = ZeroMPIEnvironment(self.comm)
        super().__init__(accelerator=accelerator, cluster_environment=environment,
                         checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)  # fmt: skip
        self._mpi_comm = comm
        self._config = config
        self._keywords = keywords
        self._requested_nodes = 1
        #: The optimizer ``fit`` sharded the module with (``None`` before it).
        self.sharded_optimizer: ShardedOptimizer | None = None

    # -- where the ranks are ----------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Lightning syncs logged values (``sync_dist``) and splits the data
        (``DistributedSampler``) only for a distributed strategy."""
        return True

    @property
    def num_nodes(self) -> int:
        """The nodes the ranks are on (the launcher decides, not ``Trainer(num_nodes=)``)."""
        assert isinstance(self.cluster_environment, ZeroMPIEnvironment)
        return self.cluster_environment.nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._requested_nodes = num_nodes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Lightning's rank-zero-only printing and logging follow the communicator."""
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Check the Trainer's devices (one CPU per process) and set the device up;
        no process group: zerompi talks MPI."""
        with self.comm.verdict():
            if not isinstance(self.accelerator, CPUAccelerator):
                raise ValueError("zerompi.lightning trains CPU models: Trainer(accelerator='cpu')")
            if self.parallel_devices and len(self.parallel_devices) > 1:
                raise ValueError(
                    f"zerompi.lightning runs one process per rank, started by mpiexec/srun: "
                    f"Trainer(devices=1), not {len(self.parallel_devices)}"
                )
            if self._layer_sync is not None:
                raise ValueError("zerompi.lightning: sync_batchnorm needs torch.distributed")
        super().setup_environment()

    def model_to_device(self) -> None:
        """Nothing to move: ``shard()`` refuses a tensor that is not on the CPU (and at
        stage 3 parameters are empty outside a forward: no ``.to()`` on them)."""

    # -- sharding at fit --------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._use_zerompi_precision()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _use_zerompi_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) is Precision:
            self.precision_plugin = ZeroMPIPrecision()
        elif not isinstance(plugin, ZeroMPIPrecision):
            raise ValueError(
                f"zerompi.lightning: precision plugin {type(plugin).__name__} is not supported: "
                "use Trainer(precision='32-true') and ZeroMPIStrategy(param_dtype=torch.bfloat16) "
                "for 16-bit compute"
            )

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Collective: shard the LightningModule with ``configure_optimizers``' settings
        and give Lightning the sharded optimizer and the re-pointed schedulers."""
        module = self.lightning_module
        assert module is not None
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        settings: dict[str, Any] = {}
        with self.comm.verdict():
            if any(_MANAGED.get(id(p)) is p for p in module.parameters()):
                raise RuntimeError("zerompi.lightning: this LightningModule is sharded already "
                                   "(fit once per module instance)")  # fmt: skip
            if is_overridden("configure_gradient_clipping", module):
                raise ValueError(
                    "zerompi.lightning: configure_gradient_clipping is overridden; zerompi clips "
                    "the global gradient norm inside its step: set Trainer(gradient_clip_val=...)"
                )
            settings = shard_settings(optimizers, module, trainer.gradient_clip_val,
                                      trainer.gradient_clip_algorithm)  # fmt: skip
        _, sharded = shard(module, self._config, comm=self._mpi_comm, **self._keywords, **settings)
        repoint_schedulers(schedulers, optimizers[0], sharded)
        assert isinstance(self.precision_plugin, ZeroMPIPrecision)
        self.precision_plugin.max_norm = settings["max_norm"]
        self.sharded_optimizer = sharded
        self.optimizers = [sharded]
        self.lr_scheduler_configs = schedulers

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Collective: inside the block every trainable parameter holds its full value
        (stage 3 gathers them; :meth:`zerompi.torch.ShardedOptimizer.full_parameters`)."""
        if self.sharded_optimizer is None:
            yield
            return
        with self.sharded_optimizer.full_parameters():
            yield

    # -- Lightning's collectives over zerompi's communicator ---------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Collective: ``tensor`` reduced over ranks (``sum``/``mean``/``max``/``min``); a
        value that is not a tensor is returned as is, as Lightning's DDP does."""
        if group is not None:
            raise ValueError("zerompi.lightning: process groups are not supported (group=None)")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return reduce_tensor(self.comm, tensor, reduce_op)

    def barrier(self, name: str | None = None) -> None:
        self.comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.comm.bcast_object(obj, root=src)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        """Collective: every rank's ``tensor`` stacked, ``(world_size, *shape)``."""
        if group is not None or sync_grads:
            raise ValueError("zerompi.lightning: all_gather without group and sync_grads")
        return gather_tensor(self.comm, tensor)

    # -- checkpoints ------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the sharded module: after ``setup`` has sharded it."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Collective: the module's full ``state_dict`` (read inside ``full_parameters``:
        at stage 3 parameters are empty outside a forward), cloned, since the
        parameters are views of zerompi's buffers."""
        module = self.lightning_module
        assert module is not None
        with self.full_parameters():
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The groups' settings (what schedulers change); the state is zerompi's file."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if optimizer is not self.sharded_optimizer:
            return super().optimizer_state(optimizer)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {_checkpoint.KEY: True, "param_groups": groups}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        """Collective: ``filepath`` becomes a directory with Lightning's dictionary and,
        unless weights only, zerompi's checkpoint file (:mod:`._checkpoint`)."""
        path = Path(filepath)
        with_state = "optimizer_states" in checkpoint and self.sharded_optimizer is not None
        _checkpoint.prepare_directory(self.comm, path, with_state)
        if with_state:
            assert self.sharded_optimizer is not None
            self.sharded_optimizer.save(str(path / _checkpoint.ZERO_FILE))
            checkpoint = {**checkpoint, _checkpoint.KEY: {
                "file": _checkpoint.ZERO_FILE, "world_size": self.world_size,
                "stage": self.sharded_optimizer.zero.stage,
            }}  # fmt: skip

        def save(data: dict, target: Path) -> None:
            self.checkpoint_io.save_checkpoint(data, target, storage_options=storage_options)

        _checkpoint.write_meta(self.comm, checkpoint, path, save)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        _checkpoint.remove(self.comm, Path(filepath))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        """Collective: a checkpoint directory this strategy saved, or a plain Lightning
        checkpoint file (weights for validate/test/predict)."""
        path = Path(checkpoint_path)

        def load(meta: Path) -> dict[str, Any]:
            return self.checkpoint_io.load_checkpoint(meta, weights_only=weights_only)

        if path.is_dir():
            return _checkpoint.read_meta(self.comm, path, load)
        checkpoint: dict[str, Any] = {}
        with self.comm.verdict():
            checkpoint = load(path)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Collective: the trainable parameters (with Adam's state and step count) from
        zerompi's file, at this world size and stage; frozen parameters and buffers
        from the ``state_dict``. Before ``fit`` shards the module: the ``state_dict``."""
        module = self.lightning_module
        assert module is not None
        state = checkpoint["state_dict"]
        if self.sharded_optimizer is None:
            module.load_state_dict(state, strict=strict)
            return
        info = checkpoint.get(_checkpoint.KEY)
        if info is None:  # (the same dictionary on every rank: raised on all alike)
            raise ValueError(
                "zerompi.lightning: fit(ckpt_path=...) resumes from a checkpoint directory "
                "ZeroMPIStrategy saved with its optimizer state (it holds zerompi.zmpi); "
                "load other weights with LightningModule.load_from_checkpoint first"
            )
        self.sharded_optimizer.load(info["path"])
        trained = {n for n, p in module.named_parameters(remove_duplicate=False)
                   if p.requires_grad}  # fmt: skip
        rest = {k: v for k, v in state.items() if k not in trained}
        missing, unexpected = module.load_state_dict(rest, strict=False)
        missing = [k for k in missing if k not in trained]
        if strict and (missing or unexpected):
            raise RuntimeError(f"zerompi.lightning: the checkpoint's state_dict misses {missing} "
                               f"and has unexpected {unexpected}")  # fmt: skip

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The groups' settings (``lr`` as the scheduler left it, ...): zerompi's file
        restored the rest in :meth:`load_model_state_dict`."""
        if self.sharded_optimizer is None:
            return
        states = checkpoint["optimizer_states"]
        groups = self.sharded_optimizer.param_groups
        if len(states) != 1 or not states[0].get(_checkpoint.KEY) or len(
            states[0]["param_groups"]) != len(groups):  # fmt: skip
            raise ValueError("zerompi.lightning: the checkpoint's optimizer state is not "
                             f"zerompi's for {len(groups)} parameter groups")  # fmt: skip
        for group, saved in zip(groups, states[0]["param_groups"], strict=True):
            group.update(saved)

    def teardown(self) -> None:
        """Release Lightning's plugins; the module stays as it is (sharded: its
        parameters are zerompi's views, readable inside :meth:`full_parameters`)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
