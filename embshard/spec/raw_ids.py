"""Raw-id tables' rules that need no torch: which placements a raw-id table may have (sharding types whose blocks
own whole rows: table-wise, one block holds the whole map; row-wise, each block maps the ids routed to it),
fbgemm's lookup kernel, and a tier whose weights the map can re-initialise in place (hbm, uvm, host: not
uvm_caching, whose cache would keep stale rows); and the id -> row map's layout and bytes per row, which the
planner prices (the map itself: embshard.rawids.idmap)."""

from __future__ import annotations

from collections.abc import Sequence

from embshard.spec.plan import LookupKernel, MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, Eviction, TableConfig

RAW_SHARDING_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
RAW_TIERS = (MemoryTier.HBM, MemoryTier.UVM, MemoryTier.HOST)

P = 16
"""Slots per bucket of the map's index (an id is looked up in 2 buckets: 2P slots)."""
SLOTS_PER_ROW = 2
"""Index slots per usable row (load factor 1/2)."""
SKETCH_DEPTH = 2
"""Counters per id in the count-min sketch of admission counting."""


def index_buckets(usable: int) -> int:
    """Buckets of P slots the index of a shard with `usable` rows for ids has (SLOTS_PER_ROW slots a row)."""
    return max(1, -(-usable * SLOTS_PER_ROW // P))


def index_itemsize(rows: int, slots: int) -> int:
    """Bytes per entry of the map's slot -> row and row -> slot arrays: 4 (int32) while rows and slots fit, else 8."""
    return 4 if max(rows, slots) + 1 < 2**31 else 8


def map_bytes_per_row(rows: int, eviction: Eviction | str = Eviction.LRU, admit_min_count: int = 1) -> float:
    """Bytes the id -> row map keeps per row of a raw-id shard of `rows` rows (the planner's price of the map):
    index slots (id and row, 2 per row), the row's id, last use, use count and slot, its segment and (LRU) its
    place in the LRU order, and (admit_min_count > 1) the sketch's counters."""
    usable = max(rows - 1, 1)
    slots = index_buckets(usable) * P
    idx = index_itemsize(rows, slots)
    total = slots * (8 + idx) + rows * (24 + idx) + usable * 8 + slots // P * 8  # the last: the buckets' list heads
    if Eviction(eviction) is Eviction.LRU:
        total += 2 * usable * 8 + rows  # the order and the one a step writes (rawids/graph.py keeps both), used marks
    if admit_min_count > 1:
        total += (SKETCH_DEPTH + 1) * max(usable, 16) * 8  # the counters and each column's shard
    return total / rows


def sharding_refused(table: TableConfig, sharding: ShardingType) -> str:
    """Why a raw-id table cannot be `sharding`: the error text, naming table, type and the fix."""
    return (
        f"table {table.name!r} has ids: raw, which supports sharding types "
        f"{[t.value for t in RAW_SHARDING_TYPES]} (its id -> row map lives with whole rows: one map per table-wise "
        f"table, one per row block), not {sharding.value}: plan it table_wise or row_wise "
        f"(planner.constraints.{table.name}.sharding_types)"
    )


def check_raw_plan(tables: Sequence[TableConfig], plan: ShardingPlan) -> None:
    """Raise ConfigError for a raw-id table planned with a sharding type, tier or kernel it cannot use."""
    for t in tables:
        if not t.raw_ids:
            continue
        tp = plan[t.name]
        if tp.sharding_type not in RAW_SHARDING_TYPES:
            raise ConfigError(sharding_refused(t, tp.sharding_type))
        if tp.tier not in RAW_TIERS:
            raise ConfigError(
                f"table {t.name!r} has ids: raw and is planned in tier {tp.tier.value}; raw-id tables live in "
                f"{[x.value for x in RAW_TIERS]} (their map re-initialises rows in place, which a UVM cache would "
                f"hide): plan it in hbm or uvm (planner.constraints.{t.name}.tiers)"
            )
        if tp.kernel is not LookupKernel.FBGEMM:
            raise ConfigError(
                f"table {t.name!r} has ids: raw and is planned with the {tp.kernel.value} kernel; raw-id tables use "
                f"fbgemm's: plan it with kernel fbgemm (planner.constraints.{t.name}.kernels: [fbgemm])"
            )
