"""Sharding schemes. Each file builds one scheme with a plain function; `build_schemes` applies them in a fixed
order so every rank builds the same schemes, and so issues the same collectives in the same order (forward and
backward: a rank with no shard of a scheme still takes part in its all-to-alls)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.column_wise import column_wise
from embshard.sharding.data_parallel import data_parallel
from embshard.sharding.row_wise import row_wise
from embshard.sharding.table_row_wise import table_row_wise
from embshard.sharding.table_wise import table_wise
from embshard.tables import ConfigError, TableConfig
from embshard.tiers import LookupOptions

# The scheme builders, in the order every rank applies them.
BUILDERS = {
    ShardingType.TABLE_WISE: table_wise,
    ShardingType.COLUMN_WISE: column_wise,
    ShardingType.ROW_WISE: row_wise,
    ShardingType.TABLE_ROW_WISE: table_row_wise,
    ShardingType.DATA_PARALLEL: data_parallel,
}
SUPPORTED = set(BUILDERS)


def build_schemes(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    rank: int,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    seed: int | None,
    options: LookupOptions | None = None,
) -> list:
    """One scheme module per sharding type present in the plan, in a fixed order."""
    for t in plan.tables:
        if t.sharding_type not in SUPPORTED:
            raise ConfigError(
                f"table {t.table!r}: sharding type {t.sharding_type.value!r} is not implemented yet; "
                f"use one of {[s.value for s in SUPPORTED]}"
            )
    schemes = [build(tables, plan, rank, optimizer, device, group, seed, options) for build in BUILDERS.values()]
    return [s for s in schemes if s is not None]
