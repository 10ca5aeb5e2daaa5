"""The ground floor: what a table is and where its shards live, with no torch import.

- `tables`: `TableConfig`, its enums (pooling, data type, raw ids, eviction) and the error types (`ConfigError`).
- `plan`: `ShardingPlan` / `TablePlan` / `Shard`, sharding types, memory tiers, lookup kernels.
- `geometry`: the block sizes of row-wise and column-wise splits (one set of rules for plan, planner and schemes).
- `options`: `LookupOptions`, the numerics and runtime choices of a collection's lookups.
- `optim`: the fused sparse optimizer's kind and hyper-parameters (the update math is `embshard.lookup.updates`).
- `raw_ids`: which placements a raw-id table may have; `id_map`: the sizes and bytes per row of its id -> row map.

The planner (`embshard.planner`) and the YAML config (`embshard.config`) depend on this layer alone, so `embshard
plan` runs where torch is not installed.
"""
