"""Row-wise sharding: a table's rows cut into contiguous blocks of one size `bs` (the last may be shorter) over all
ranks (`embshard.spec.geometry.row_blocks` gives the canonical split), block i on its planned rank.

Data flow: the row-block engine (row_blocks.py): ids bucketed by block and sent to the blocks' ranks, partial
sums pooled there and added up, per feature, on the ranks owning the samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.sharding.base import ShardingContext, planned_as
from embshard.sharding.row_blocks import RowBlockSharding
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


def row_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RowBlockSharding | None:
    """The row-wise part of the collection: row blocks over all ranks (raw-id tables apart: raw_row_wise.py). None
    if no such table is row-wise."""
    entries = [e for e in planned_as(tables, plan, ShardingType.ROW_WISE) if not e[1].raw_ids]
    return RowBlockSharding(entries, ctx) if entries else None
