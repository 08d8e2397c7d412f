"""zerompi: ZeRO-style sharded data-parallel training over MPI (mpi4py + numpy).

Every rank owns a contiguous, exactly counted shard of the flattened parameters
(:func:`shard_range`); gradients are reduced with ``Reduce_scatter`` and parameters
gathered with ``Allgatherv`` using exact variable counts, with no padding anywhere.
"""

from .adam import AdamConfig
from .engine import Deferred, ZeroOptimizer
from .partition import Layout, gather_shards, plan_buckets, shard, shard_counts, shard_range

__version__ = "0.1.0"

__all__ = [
    "AdamConfig",
    "Deferred",
    "Layout",
    "ZeroOptimizer",
    "__version__",
    "gather_shards",
    "plan_buckets",
    "shard",
    "shard_counts",
    "shard_range",
]
