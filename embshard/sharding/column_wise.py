"""Column-wise sharding: a table's columns cut into blocks, each block placed on a rank like a whole table.

Data flow: every column block is read by all of the table's features, under one lookup key per (feature, block),
`column_key(feature, col_offset)` (sharding/base.py). The keys travel exactly like table-wise features (the routed
engine, routed.py: ids to the block's rank, pooled `[B, block width]` back); ShardedEmbeddingBagCollection maps
each key back to its feature and lays the blocks side by side in column order.

Optimizer state is per block: row-wise Adagrad keeps one value per row *of each block* (the mean of g^2 over the
block's columns), so it differs from the unsharded row-wise Adagrad (docs/architecture.md, "Column-wise").
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.lookup import LocalShard
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.base import ShardingContext, column_key
from embshard.sharding.routed import RoutedSharding
from embshard.tables import TableConfig


def column_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RoutedSharding | None:
    """The column-wise part of the collection: each column block on its planned rank, read by one key per
    feature. None if no table is column-wise."""
    shards_per_rank: list[list[LocalShard]] = [[] for _ in range(plan.world_size)]
    key_source: dict[str, str] = {}
    for i, cfg in enumerate(tables):
        tp = plan[cfg.name]
        if tp.sharding_type is not ShardingType.COLUMN_WISE:
            continue
        for shard in sorted(tp.shards, key=lambda s: s.col_offset):
            keys = tuple(column_key(f, shard.col_offset) for f in cfg.feature_names)
            shards_per_rank[shard.rank].append(
                LocalShard(cfg, i, shard, keys, tp.tier, tp.cache_load_factor, tp.cache_algorithm)
            )
            key_source.update({k: f for k, f in zip(keys, cfg.feature_names)})
    return RoutedSharding(shards_per_rank, key_source, ctx) if key_source else None
