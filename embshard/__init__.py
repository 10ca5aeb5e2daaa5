"""embshard: sharded embedding tables on FBGEMM TBE kernels."""

from embshard.planner.simple import simple_plan
from embshard.runtime import notices  # noqa: F401  (first: its import drops known library notices, embshard/runtime/notices.py)
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import BoundsCheck, LookupOptions, OutputDtype
from embshard.spec.plan import CacheAlgorithm, Exchange, MemoryTier, Shard, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError, DataType, Pooling, TableConfig

__all__ = [
    "BoundsCheck",
    "CacheAlgorithm",
    "ConfigError",
    "DataType",
    "Exchange",
    "FusedOptimizerConfig",
    "LookupOptions",
    "MemoryTier",
    "OptimizerKind",
    "OutputDtype",
    "Pooling",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "ShardingType",
    "TableConfig",
    "TablePlan",
    "simple_plan",
]


def __getattr__(name: str):
    # Lazy: importing the distributed module pulls in torch and fbgemm_gpu.
    if name == "ShardedEmbeddingBagCollection":
        from embshard.collection.sharded import ShardedEmbeddingBagCollection

        return ShardedEmbeddingBagCollection
    if name == "ShardedEmbeddingCollection":
        from embshard.collection.sequence import ShardedEmbeddingCollection

        return ShardedEmbeddingCollection
    raise AttributeError(name)
