"""zerompi: ZeRO-style sharded data-parallel training over MPI (mpi4py + numpy).

Every rank owns a contiguous, exactly counted shard of the flattened parameters
(:func:`shard_range`); gradients are reduced with ``Reduce_scatter`` and parameters
gathered with ``Allgatherv`` using exact variable counts, with no padding anywhere.

:class:`ZeroConfig` (and its policies) describes an optimizer; :class:`ZeroOptimizer`
runs one. The optimizer (and with it mpi4py) is imported on first use, so that the
pure parts (the partition functions, the config, :mod:`zerompi.checkpoint`'s reader,
:mod:`zerompi.memory`'s estimator) work on a machine without MPI.
"""

from typing import Any

from .adam import AdamConfig
from .config import ElasticPolicy, NodeMemoryPolicy, OverlapPolicy, PrecisionPolicy, ZeroConfig
from .elastic import RankLost
from .mpi.launch import install_abort_hook
from .partition import (
    Deferred,
    Layout,
    gather_shards,
    plan_buckets,
    shard,
    shard_counts,
    shard_range,
)

__version__ = "0.1.0"

# An uncaught exception on any rank ends a multi-rank job from here on, not only once
# an optimizer exists (data loading, argument checks): the hook looks MPI up only
# when it fires, so importing zerompi does not initialise MPI.
install_abort_hook()

__all__ = [
    "AdamConfig",
    "Deferred",
    "ElasticPolicy",
    "Layout",
    "NodeMemoryPolicy",
    "OverlapPolicy",
    "PrecisionPolicy",
    "RankLost",
    "ZeroConfig",
    "ZeroOptimizer",
    "__version__",
    "gather_shards",
    "plan_buckets",
    "shard",
    "shard_counts",
    "shard_range",
]


def __getattr__(name: str) -> Any:
    if name == "ZeroOptimizer":
        from . import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module 'zerompi' has no attribute {name!r}")
