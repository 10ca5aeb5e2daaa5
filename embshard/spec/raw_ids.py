"""Raw-id tables' rules that need no torch: which placements a raw-id table may have (sharding types whose blocks
own whole rows: table-wise, one block holds the whole map; row-wise, each block maps the ids routed to it),
fbgemm's lookup kernel, and a tier whose weights the map can re-initialise in place (hbm, uvm, host: not
uvm_caching, whose cache would keep stale rows). The id -> row map's sizes, which the planner prices, are in
embshard/spec/id_map.py."""

from __future__ import annotations

from collections.abc import Sequence

from embshard.spec.geometry import row_blocks
from embshard.spec.plan import LookupKernel, MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig

RAW_SHARDING_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
RAW_TIERS = (MemoryTier.HBM, MemoryTier.UVM, MemoryTier.HOST)


def sharding_refused(table: TableConfig, sharding: ShardingType) -> str:
    """Why a raw-id table cannot be `sharding`: the error text, naming table, type and the fix."""
    return (
        f"table {table.name!r} has ids: raw, which supports sharding types "
        f"{[t.value for t in RAW_SHARDING_TYPES]} (its id -> row map lives with whole rows: one map per table-wise "
        f"table, one per row block), not {sharding.value}: plan it table_wise or row_wise "
        f"(planner.constraints.{table.name}.sharding_types)"
    )


def small_block_refused(table: TableConfig, sizes: Sequence[int]) -> str | None:
    """Why a raw-id table cannot be cut into row blocks of `sizes` rows (a block of fewer than 2 rows: it needs a
    zero row and a row for ids), the error text naming the table, the blocks and the fix; None when it can."""
    if min(sizes) >= 2:
        return None
    more = next(r for r in range(max(table.num_embeddings, 2), 10**18) if min(row_blocks(r, len(sizes))) >= 2)
    return (
        f"table {table.name!r} has ids: raw and {table.num_embeddings} rows, cut into row blocks of {list(sizes)} "
        f"rows over {len(sizes)} ranks: a raw-id block needs >= 2 rows (a zero row for ids without a row, and rows "
        f"for ids), and a block has {min(sizes)}: plan it on fewer ranks (table_wise: "
        f"planner.constraints.{table.name}.sharding_types) or give it more rows (e.g. num_embeddings: {more})"
    )


def check_raw_plan(tables: Sequence[TableConfig], plan: ShardingPlan) -> None:
    """Raise ConfigError for a raw-id table planned with a sharding type, tier or kernel it cannot use, or with a
    row block of fewer than 2 rows."""
    for t in tables:
        if not t.raw_ids:
            continue
        tp = plan[t.name]
        if tp.sharding_type not in RAW_SHARDING_TYPES:
            raise ConfigError(sharding_refused(t, tp.sharding_type))
        refused = small_block_refused(t, [s.num_rows for s in sorted(tp.shards, key=lambda s: s.row_offset)])
        if refused:
            raise ConfigError(refused)
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
