"""Table-wise sharding: each table lives whole on one rank.

Data flow (the routed engine, routed.py): the local batch's ids of each table's features go to the table's rank
(sparse all-to-all); that rank pools the table's rows for the global batch (one TBE per group of compatible tables);
the pooled rows go back to the ranks owning the samples (pooled all-to-all).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.lookup import LocalShard
from embshard.sharding.base import ShardingContext, planned_as
from embshard.sharding.routed import RoutedSharding
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


def table_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RoutedSharding | None:
    """The table-wise part of the collection: one shard per table on its planned rank, read under the names of
    its features. None if no table is table-wise."""
    shards_per_rank: list[list[LocalShard]] = [[] for _ in range(plan.world_size)]
    key_source: dict[str, str] = {}
    for i, cfg, tp in planned_as(tables, plan, ShardingType.TABLE_WISE):
        (shard,) = tp.shards
        shards_per_rank[shard.rank].append(LocalShard.planned(cfg, i, shard, cfg.feature_names, tp))
        key_source.update({f: f for f in cfg.feature_names})
    return RoutedSharding(shards_per_rank, key_source, ctx) if key_source else None
