"""The simple placement: tables by size, largest first, each onto the least-loaded rank(s) by bytes. No cost model
and no memory budget: for tests, debugging and as a baseline for the search (search.py). Blocks are cut by
embshard.spec.geometry's rules, as every placement's are (options.make_shards).

    plan = simple_plan(tables, world_size=2)                                   # table-wise, host tier
    plan = simple_plan(tables, 8, 4, {"big": "row_wise"}, tier="hbm")          # a type per table
    plan = simple_plan(tables, 8, constraints={"t_*": {"ranks": [3]}})         # the first of each constraint
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.options import Option, make_shards
from embshard.spec.geometry import column_blocks, row_blocks
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType, TablePlan
from embshard.spec.raw_ids import small_block_refused
from embshard.spec.tables import ConfigError, TableConfig, validate_tables


def simple_plan(
    tables: Sequence[TableConfig],
    world_size: int,
    local_world_size: int | None = None,
    sharding_types: Mapping[str, ShardingType | str] | None = None,
    tier: MemoryTier | str = MemoryTier.HOST,
    column_shards: int = 2,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None = None,
) -> ShardingPlan:
    """Greedy placement: tables by size, largest first, each onto the least-loaded rank(s) by bytes.

    `sharding_types` picks a type per table (default: the first of the table's `constraints`, else table-wise);
    every table is in `tier` unless its constraints name tiers (then the first); a table-wise table whose
    constraints name ranks sits on the first. `column_shards` is the number of column blocks a column-wise table
    is cut into (fewer if the width has fewer units of 4: see `geometry.column_blocks`); row-wise and
    table-row-wise tables are split by `geometry.row_blocks`. No memory budget is checked here: that is the
    planner's job.
    """
    tables = validate_tables(tables)
    local_world_size = local_world_size or world_size
    chosen = {name: ShardingType(st) for name, st in (sharding_types or {}).items()}
    unknown = set(chosen) - {t.name for t in tables}
    if unknown:
        raise ConfigError(f"sharding_types names tables that do not exist: {sorted(unknown)}")
    cons = resolve_constraints(tables, constraints, world_size)
    load = [0] * world_size
    plans: dict[str, TablePlan] = {}

    def least_loaded(candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda r: (load[r], r))

    for cfg in sorted(tables, key=lambda t: (-t.weight_bytes, t.name)):
        c = cons[cfg.name]
        st = chosen.get(cfg.name) or (c.sharding_types[0] if c.sharding_types else ShardingType.TABLE_WISE)
        if c.ranks and st is not ShardingType.TABLE_WISE:
            raise ConfigError(
                f"constraints of table {cfg.name!r}: ranks {list(c.ranks)} pin a {st.value} table, but the simple "
                "placement pins only table_wise tables: drop ranks, make the table table_wise, or use the planner "
                "(strategy auto)"
            )
        table_tier = c.tiers[0] if c.tiers else MemoryTier(tier)
        row_bytes = cfg.embedding_dim * cfg.data_type.bytes
        if st is ShardingType.TABLE_WISE:
            ranks = [c.ranks[0] if c.ranks else least_loaded(range(world_size))]
        elif st in (ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE):
            ranks = list(range(world_size))
        elif st is ShardingType.TABLE_ROW_WISE:
            hosts = range(world_size // local_world_size)
            host = min(hosts, key=lambda h: (sum(load[h * local_world_size : (h + 1) * local_world_size]), h))
            ranks = list(range(host * local_world_size, (host + 1) * local_world_size))
        else:  # column-wise: each block onto the least-loaded rank, counting the blocks placed before it
            ranks = []
            for width in column_blocks(cfg.embedding_dim, column_shards, cfg.name):
                ranks.append(least_loaded(range(world_size)))
                load[ranks[-1]] += cfg.num_embeddings * width * cfg.data_type.bytes
        parts = column_shards if st is ShardingType.COLUMN_WISE else len(ranks)
        if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            ranks = ranks[: len(row_blocks(cfg.num_embeddings, parts))]  # few rows: fewer blocks than ranks
        shards = make_shards(cfg, Option(st, table_tier, parts), ranks)
        if st is not ShardingType.COLUMN_WISE:
            for s in shards:
                load[s.rank] += s.num_rows * row_bytes
        plans[cfg.name] = TablePlan(cfg.name, st, table_tier, shards)
    plan = ShardingPlan(world_size, local_world_size, tuple(plans[t.name] for t in tables))
    plan.check(tables)
    for t in tables:  # a raw-id table's row block of 1 row: refused here, not only on the rank that builds it
        refused = t.raw_ids and small_block_refused(t, [s.num_rows for s in plan[t.name].shards])
        if refused:
            raise ConfigError(refused)
    return plan
