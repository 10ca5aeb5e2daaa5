"""The 2D tests' tables and plans: every sharding type in one collection, planned for one sharding group and
made 2D over hosts of 2 ranks."""

from __future__ import annotations

from dataclasses import replace

from embshard import TableConfig, simple_plan
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType

TW, RW, CW, TWRW, DP = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.DATA_PARALLEL,
)
MIXED = [
    TableConfig("m_tw", 30, 8, ("g_a",)),
    TableConfig("m_cw", 20, 16, ("g_b", "g_c"), pooling="mean", ids_per_bag=2),
    TableConfig("m_rw", 61, 12, ("g_d",), weighted=True, ids_per_bag=2),
    TableConfig("m_twrw", 45, 4, ("g_e",), pooling="mean", ids_per_bag=2),
    TableConfig("m_dp", 10, 8, ("g_f", "g_g"), weighted=True, ids_per_bag=2),
]
TYPES = {"m_tw": TW, "m_cw": CW, "m_rw": RW, "m_twrw": TWRW, "m_dp": DP}
WORLD, LOCAL = 4, 2  # 2 hosts x 2 ranks


def twod_plan(
    tables,
    group_size: int | None,
    tier: MemoryTier,
    sync: str = "exact",
    every: int = 1,
    world: int = WORLD,
    local: int = LOCAL,
) -> ShardingPlan:
    """The plan of `tables` for `world` ranks (hosts of `local`), 2D with sharding groups of `group_size` ranks
    (None: no 2D): one group's layout planned for `group_size` ranks, the groups replicas of it."""
    types = {t.name: TYPES[t.name] for t in tables}
    if group_size is None:
        return simple_plan(tables, world, local, types, tier=tier, column_shards=2)
    group = simple_plan(tables, group_size, min(local, group_size), types, tier=tier, column_shards=2)
    return replace(
        group,
        world_size=world,
        local_world_size=local,
        sharding_group_size=group_size,
        replica_sync=sync,
        replica_sync_every=every,
    )
