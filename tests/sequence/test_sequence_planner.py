"""The planner with sequence tables (pooling none): it plans them, and prices their output per id, not per bag:
the output exchange moves ids x D x bytes (table-wise: every id of the table's features; row-wise: the shard's
share), and the step's memory holds a row per id."""

from __future__ import annotations

import pytest

from embshard import FusedOptimizerConfig, TableConfig
from embshard.planner import PlannerSettings, Topology, plan_sharding
from embshard.planner.cost import CostModel
from embshard.planner.memory import TableStats
from embshard.spec.plan import MemoryTier, ShardingType

L = 20.0  # ids per history


def _pair(rows: int = 100_000, dim: int = 64) -> tuple[TableConfig, TableConfig]:
    pooled = TableConfig("bag", rows, dim, ("f",), ids_per_bag=L)
    seq = TableConfig("seq", rows, dim, ("f",), pooling="none", ids_per_bag=L)
    return pooled, seq


def test_output_bytes_and_memory_per_id():
    model = CostModel(Topology.preset("h100", 4), 1024, FusedOptimizerConfig("rowwise_adagrad"))
    pooled, seq = (TableStats.one(t) for t in _pair())
    R, D = 100_000, 64
    tw = [model.work(t, ShardingType.TABLE_WISE, MemoryTier.HBM, R, D) for t in (pooled, seq)]
    assert tw[0].out_b == pytest.approx(1024 * D * 4)
    assert tw[1].out_b == pytest.approx(1024 * L * D * 4)  # ids x D x fp32 to each rank
    rw = [model.work(t, ShardingType.ROW_WISE, MemoryTier.HBM, R // 4, D) for t in (pooled, seq)]
    assert rw[0].out_b == pytest.approx(1024 * D * 4)  # a partial sum of every bag
    assert rw[1].out_b == pytest.approx(1024 * L / 4 * D * 4)  # a row per id of the shard's quarter
    mem = [model.storage(t, ShardingType.TABLE_WISE, MemoryTier.HBM, R, D) for t in (pooled, seq)]
    assert mem[1].hbm_buffers > mem[0].hbm_buffers + (L - 1) * 4 * 1024 * D * 4 * 0.9
    assert model.batch_bytes([_pair()[1]]) > model.batch_bytes([_pair()[0]]) * 5


def test_dedup_prices_the_unique_ids():
    topo, opt = Topology.preset("h100", 4), FusedOptimizerConfig("rowwise_adagrad")
    small = TableConfig("hot", 1000, 64, ("f",), pooling="none", ids_per_bag=L)  # 20k ids a rank over 1000 rows
    plain, dedup = (CostModel(topo, 1024, opt, PlannerSettings(sequence_dedup=d)) for d in (False, True))
    t = TableStats.one(small)
    a, b = (m.work(t, ShardingType.TABLE_WISE, MemoryTier.HBM, 1000, 64) for m in (plain, dedup))
    assert b.out_b < a.out_b / 15 and b.in_b < a.in_b / 10  # at most 1000 distinct rows of 20480 ids
    pooled = TableStats.one(_pair()[0])
    same = [m.work(pooled, ShardingType.TABLE_WISE, MemoryTier.HBM, 100_000, 64).out_b for m in (plain, dedup)]
    assert same[0] == same[1]  # pooled tables are not deduplicated


def test_plans_sequence_tables():
    tables = [
        TableConfig("hist", 2_000_000, 64, ("h", "h2"), pooling="none", ids_per_bag=50),
        TableConfig("small", 1000, 16, ("s",), pooling="none", ids_per_bag=5),
        TableConfig("bag", 500_000, 32, ("b",), ids_per_bag=3),
    ]
    plan = plan_sharding(tables, Topology.preset("h100", 2), 512, FusedOptimizerConfig("adam"))
    plan.check(tables)
    assert all(plan[t.name].shards for t in tables)
