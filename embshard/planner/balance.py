"""How evenly a plan spreads the lookups over the ranks, and the hot tables a rank cannot carry alone.

Weak scaling (the batch per rank fixed, W ranks): a table-wise shard looks up its table's ids of the whole global
batch, W*B*F*L, so the rank that holds a hot table does more work the more ranks there are; a column block of width
d of a D-wide table looks up every one of those ids at d/D of the bytes, which counts as W*B*F*L * d/D ids (the cost
model's price: cost.py); a row-wise or table-row-wise block of r of the table's R rows looks up W*B*F*L * r/R
(row-wise over the W ranks of a sharding group: B*F*L, constant in W); a data-parallel replica B*F*L. A balanced
rank looks up B * sum(F*L) whatever W is.

`rank_ids` counts each rank's ids under a plan (cost.py's n, summed per rank); `hot_tables` names the tables whose
whole-table lookups exceed a balanced rank's share, which the search splits (search.py's hot start; row-wise
blocks, column blocks where the step is one CUDA graph (its exchanges are sized from the host's counts, which
row-wise bucketing is not), or, over several hosts, 2D sharding: twod.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig

HOT_SHARE = 1.0
"""A table whose whole-table lookups (W*B*F*L) exceed this share of a balanced rank's lookups (B * sum(F*L)) is
hot: no placement of it as one block keeps its rank at the balanced load."""


def table_ids_per_sample(t: TableConfig) -> float:
    """Ids one sample looks up in table `t`: features x ids per bag."""
    return len(t.feature_names) * float(t.ids_per_bag)


def rank_ids(plan: ShardingPlan, tables: Sequence[TableConfig], batch_size: int) -> list[float]:
    """Ids each rank of one sharding group looks up per step (forward), for `batch_size` samples per rank: a list
    of plan.shard_world_size numbers (cost.py's n, summed over the rank's shards; a column block's ids weighed by
    its share of the table's columns)."""
    W = plan.shard_world_size
    out = [0.0] * W
    by_name = {t.name: t for t in tables}
    for tp in plan.tables:
        t = by_name[tp.table]
        per = table_ids_per_sample(t) * batch_size
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            for s in tp.shards:
                out[s.rank] += per
            continue
        for s in tp.shards:
            share = s.num_rows / t.num_embeddings if tp.sharding_type in _ROW_SPLITS else 1.0
            if tp.sharding_type is ShardingType.COLUMN_WISE:
                share = s.num_cols / t.embedding_dim
            out[s.rank] += W * per * share
    return out


_ROW_SPLITS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


def balanced_ids(tables: Sequence[TableConfig], batch_size: int) -> float:
    """Ids a rank looks up per step when every rank carries the same share: B * sum over tables of F*L."""
    return batch_size * sum(table_ids_per_sample(t) for t in tables)


def busy_shares(plan: ShardingPlan, tables: Sequence[TableConfig], batch_size: int) -> list[float]:
    """Each rank's lookups over a balanced rank's (1.0: its even share; 2.0: twice that)."""
    even = max(balanced_ids(tables, batch_size), 1e-12)
    return [n / even for n in rank_ids(plan, tables, batch_size)]


def hot_tables(tables: Sequence[TableConfig], world_size: int, share: float = HOT_SHARE) -> list[str]:
    """Names of the tables whose whole-table lookups, W*F*L ids per sample of the rank's batch, exceed `share` of a
    balanced rank's, sum(F*L): the ones that one rank cannot hold whole without being the step's busiest."""
    if world_size <= 1:
        return []
    even = sum(table_ids_per_sample(t) for t in tables)
    return [t.name for t in tables if world_size * table_ids_per_sample(t) > share * even]
