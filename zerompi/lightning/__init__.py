"""zerompi for PyTorch Lightning: ``Trainer(strategy=ZeroMPIStrategy(stage=2))``.

Under ``mpiexec -n W python train.py`` (or ``srun``) every rank runs the same
``Trainer.fit``; the strategy shards the ``LightningModule`` with
:func:`zerompi.torch.shard` using the AdamW/Adam/SGD and LR schedulers that
``configure_optimizers`` returns and the Trainer's ``gradient_clip_val``, runs
Lightning's collectives on zerompi's communicator (no ``torch.distributed``), and
saves checkpoints that resume at another world size and stage. Importing this module
registers the strategy under the names ``"zerompi"`` (``shard()``'s defaults: stage 2)
and ``"zerompi_stage_0"`` ... ``"zerompi_stage_3"`` in Lightning's strategy registry.
``import zerompi`` never imports Lightning; this module does.

Modules: :mod:`._strategy` (the strategy, its precision plugin), :mod:`._optimizers`
(``configure_optimizers`` mapped onto ``shard()``), :mod:`._environment` (ranks and
Lightning's collectives), :mod:`._checkpoint` (checkpoint directories).
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from ._environment import ZeroMPIEnvironment
from ._strategy import ZeroMPIPrecision, ZeroMPIStrategy

__all__ = ["ZeroMPIEnvironment", "ZeroMPIPrecision", "ZeroMPIStrategy"]


def _register() -> None:
    """``"zerompi"`` and ``"zerompi_stage_S"`` in Lightning's strategy registry."""
    StrategyRegistry.register(
        "zerompi", ZeroMPIStrategy, description="zerompi: ZeRO sharding over MPI (stage 2)",
        override=True,
    )  # fmt: skip
    for stage in range(4):
        StrategyRegistry.register(
            f"zerompi_stage_{stage}", ZeroMPIStrategy,
            description=f"zerompi: ZeRO stage {stage} over MPI", override=True, stage=stage,
        )  # fmt: skip


_register()
