"""The planner for a training step captured as one CUDA graph (settings.whole_step_graph): its plans hold only what
the graph holds (table-wise, column-wise, data-parallel; no UVM caching), and the hot tables of the MLPerf-shaped
model are cut into column blocks, so no rank looks up a whole hot table of the global batch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from embshard.planner import Topology
from embshard.planner.balance import busy_shares, hot_tables
from embshard.planner.policy import search_plan
from embshard.spec.graph_rules import plan_refusal
from embshard.spec.plan import GRAPH_SHARDING_TYPES, MemoryTier, ShardingType
from embshard.tools.plan_inputs import training_planner_input

MLPERF = "configs/dlrm_dcnv2_mlperf.yaml"


@pytest.fixture(scope="module")
def graphed():
    overrides = ["training.precision=bf16", "lookup.output_dtype=bf16", "training.cuda_graph=false"]
    inp, _ = training_planner_input(MLPERF, overrides)
    settings = replace(inp.settings, whole_step_graph=True)
    out, said = {}, []
    for W in (2, 4, 8):
        topo = Topology.preset("h100", world_size=W)
        plan, report = search_plan(
            inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings, said.append
        )
        out[W] = (plan, report)
    return inp, out, said


def test_graphed_plans_split_the_hot_tables_into_column_blocks(graphed) -> None:
    inp, plans, said = graphed
    tables, B = inp.tables, inp.batch_size
    assert said == []  # a plan the graph holds fits at every size: no fallback to the eager step
    busiest = {}
    for W, (plan, report) in plans.items():
        assert plan_refusal(tables, plan) is None, W
        assert {tp.sharding_type for tp in plan.tables} <= set(GRAPH_SHARDING_TYPES), W
        assert all(tp.tier is not MemoryTier.UVM_CACHING for tp in plan.tables), W
        assert "step: one CUDA graph replay" in report.summary()
        for name in hot_tables(tables, W):  # each block looks up at most a balanced rank's share
            tp = plan[name]
            assert tp.sharding_type in (ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL), (W, name, tp)
            if tp.sharding_type is ShardingType.COLUMN_WISE:
                assert len({s.rank for s in tp.shards}) == len(tp.shards) >= 2, (W, name)
        busiest[W] = max(busy_shares(plan, tables, B))
    assert hot_tables(tables, 4) == ["t_cat_20"] and plans[4][0]["t_cat_20"].sharding_type is ShardingType.COLUMN_WISE
    # the busiest rank's lookups over a balanced rank's (a column block of width d counting d/D of its ids)
    assert busiest[2] < 1.2 and busiest[4] < 1.2, busiest
    assert busiest[8] < 1.35, busiest  # t_cat_20's 100 ids a sample, 8 x over the world batch: see docs/planner.md
