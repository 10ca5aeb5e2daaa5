"""Table-row-wise sharding: a table's rows cut into blocks over the ranks of one host (row-wise inside the host,
table-wise across hosts), so the table's partial sums stay within one host's fast links.

Data flow: the row-block engine's (row_blocks.py), with the blocks on the host's ranks: the ids are bucketed by block
into that host's ranks and sent with the one global all-to-all, whose sends to the other hosts' ranks are empty
(zero-sized) for these features; the partial sums come back with the global pooled all-to-all and are added up
on the rank owning each sample. A hierarchical version (ids first to one peer per host, then within the host;
reduce-scatter within the host, then one all-to-all across hosts) moves the same bytes over fewer inter-host
messages; this one is the simple correct form of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.base import ShardingContext, planned_as
from embshard.sharding.row_blocks import RowBlockSharding
from embshard.tables import TableConfig


def table_row_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RowBlockSharding | None:
    """The table-row-wise part of the collection: each table's row blocks over one host's ranks. None if no
    table is table-row-wise."""
    entries = planned_as(tables, plan, ShardingType.TABLE_ROW_WISE)
    return RowBlockSharding(entries, ctx, "table_row_wise") if entries else None
