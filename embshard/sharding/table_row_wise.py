"""Table-row-wise sharding: a table's rows cut into blocks over the ranks of one host (row-wise inside the host,
table-wise across hosts), so the table's partial sums can be added up over the host's fast links.

Data flow: the row-block engine's (row_blocks.py), with the blocks on the host's ranks: the ids are bucketed by block
into that host's ranks and sent with the one global all-to-all, whose sends to the other hosts' ranks are empty
(zero-sized) for these features. The partial sums reach the ranks owning the samples by one of two output
exchanges, the plan's `table_row_wise_exchange`:
- flat: the row-block engine's pooled all-to-all over every rank, then a sum on each sample's rank; every block's
  partials cross the links between hosts;
- hierarchical (hierarchical.py): a reduce-scatter inside each host, then one all-to-all between the hosts' peer
  ranks, so each sample's pooled row crosses hosts once. The same pooled outputs, bit for bit; the lookup's backward
  adds a row's gradients over its bags in another order, so the weights agree to rounding.
With one host, or one rank per host, both are the same exchange and the flat one runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.sharding.base import ShardingContext, planned_as
from embshard.sharding.hierarchical import HierarchicalRowBlockSharding
from embshard.sharding.row_blocks import RowBlockSharding
from embshard.spec.plan import Exchange, ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


def table_row_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RowBlockSharding | None:
    """The table-row-wise part of the collection: each table's row blocks over one host's ranks, with the plan's
    output exchange. None if no table is table-row-wise."""
    entries = planned_as(tables, plan, ShardingType.TABLE_ROW_WISE)
    if not entries:
        return None
    lws = plan.local_world_size
    hosts = plan.world_size // lws
    if plan.table_row_wise_exchange is Exchange.HIERARCHICAL and hosts > 1 and lws > 1:
        return HierarchicalRowBlockSharding(entries, ctx, lws)
    return RowBlockSharding(entries, ctx, "table_row_wise")
