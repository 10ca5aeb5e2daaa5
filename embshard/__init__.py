"""embshard: sharded embedding tables on FBGEMM TBE kernels."""

from embshard import notices  # noqa: F401  (first: its import drops known library notices, embshard/notices.py)
from embshard.optim import FusedOptimizerConfig, OptimizerKind
from embshard.options import BoundsCheck, LookupOptions, OutputDtype
from embshard.plan import CacheAlgorithm, Exchange, MemoryTier, Shard, ShardingPlan, ShardingType, TablePlan
from embshard.planner.simple import simple_plan
from embshard.tables import ConfigError, DataType, Pooling, TableConfig

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
    "ShardingPlan",
    "ShardingType",
    "TableConfig",
    "TablePlan",
    "simple_plan",
]


def __getattr__(name: str):
    # Lazy: importing the distributed module pulls in torch and fbgemm_gpu.
    if name == "ShardedEmbeddingBagCollection":
        from embshard.sharded import ShardedEmbeddingBagCollection

        return ShardedEmbeddingBagCollection
    raise AttributeError(name)
