"""Sharding schemes. Each file builds one scheme with a plain function; `build_schemes` applies them in a fixed
order so every rank builds the same schemes, and so issues the same collectives in the same order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.table_wise import table_wise
from embshard.tables import ConfigError, TableConfig
from embshard.tiers import LookupOptions

SUPPORTED = {ShardingType.TABLE_WISE}


def build_schemes(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    rank: int,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    seed: int,
    options: LookupOptions | None = None,
) -> list:
    """One scheme module per sharding type present in the plan, in a fixed order."""
    for t in plan.tables:
        if t.sharding_type not in SUPPORTED:
            raise ConfigError(
                f"table {t.table!r}: sharding type {t.sharding_type.value!r} is not implemented yet; "
                f"use one of {[s.value for s in SUPPORTED]}"
            )
    schemes = [table_wise(tables, plan, rank, optimizer, device, group, seed, options)]
    return [s for s in schemes if s is not None]
