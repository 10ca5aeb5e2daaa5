"""Sharding schemes. Each file builds one scheme with a plain function `(tables, plan, ctx) -> Scheme | None`;
`build_schemes` applies them in a fixed order so every rank builds the same schemes, and so issues the same
collectives in the same order (forward and backward: a rank with no shard of a scheme still takes part in its
all-to-alls). The contract is `Scheme` in base.py; the engines are routed.py and row_blocks.py."""

from __future__ import annotations

from collections.abc import Sequence

from embshard.sharding.base import Scheme, ShardingContext
from embshard.sharding.column_wise import column_wise
from embshard.sharding.data_parallel import data_parallel
from embshard.sharding.raw_row_wise import raw_row_wise
from embshard.sharding.row_wise import row_wise
from embshard.sharding.table_row_wise import table_row_wise
from embshard.sharding.table_wise import table_wise
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig

# The scheme builders, in the order every rank applies them.
BUILDERS = {
    ShardingType.TABLE_WISE: table_wise,
    ShardingType.COLUMN_WISE: column_wise,
    ShardingType.ROW_WISE: row_wise,
    "row_wise_raw": raw_row_wise,  # raw-id tables planned row-wise
    ShardingType.TABLE_ROW_WISE: table_row_wise,
    ShardingType.DATA_PARALLEL: data_parallel,
}


def build_schemes(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> list[Scheme]:
    """One scheme per sharding type present in the plan, in the fixed order of BUILDERS."""
    schemes = [build(tables, plan, ctx) for build in BUILDERS.values()]
    return [s for s in schemes if s is not None]
