"""The host's floor of an eager step: the slowest rank's host time (topology host_step_s, host_group_s per
model-parallel and host_dp_group_s per data-parallel lookup group, host_sync_s with device counts) bounds the
predicted step from below; a graph replay and CPUs do not pay it; the planner drops data-parallel tables from an
eager plan the host sets when that predicts a shorter step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from embshard.planner import PlannerSettings, Topology, plan_with_report, predict
from embshard.planner.policy import search_plan
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import TableConfig

MS = 1e-3
ROWWISE = FusedOptimizerConfig("rowwise_adagrad")


def _tables() -> list[TableConfig]:
    return [
        TableConfig("big0", 2_000_000, 64, ("f0",), ids_per_bag=4),
        TableConfig("big1", 2_000_000, 64, ("f1",), ids_per_bag=4),
        TableConfig("cold", 1_000_000, 64, ("f2",), ids_per_bag=2),
        TableConfig("tiny", 100, 64, ("f3",), ids_per_bag=1),
    ]


def _plan(tiny_dp: bool = True) -> ShardingPlan:
    def tw(name, rank, rows, tier="hbm"):
        shard = {"rank": rank, "row_offset": 0, "num_rows": rows, "col_offset": 0, "num_cols": 64}
        return {"table": name, "sharding_type": "table_wise", "tier": tier, "shards": [shard]}

    tiny = tw("tiny", 1, 100)
    if tiny_dp:
        tiny = {
            "table": "tiny",
            "sharding_type": "data_parallel",
            "tier": "hbm",
            "shards": [{"rank": r, "row_offset": 0, "num_rows": 100, "col_offset": 0, "num_cols": 64} for r in (0, 1)],
        }
    tables = [tw("big0", 0, 2_000_000), tw("big1", 1, 2_000_000), tw("cold", 0, 1_000_000, "uvm"), tiny]
    return ShardingPlan.from_dict({"world_size": 2, "local_world_size": 2, "tables": tables})


@pytest.mark.parametrize("counts", ["host", "device"])
def test_the_slowest_ranks_host_time_bounds_the_eager_step(counts):
    """Rank 0 has two model-parallel groups (HBM and UVM) and the data-parallel one, all on FBGEMM's TBE, rank 1
    one and the data-parallel one: the host floor is host_step + 3 host_group + host_dp_group (+ host_sync with
    device counts), and the step the larger of it and the GPUs' time; a group on the small-table kernel is free."""
    topo = replace(Topology.preset("h100", 2), host_step_s=1 * MS, host_group_s=0.5 * MS, host_dp_group_s=2 * MS)
    settings = PlannerSettings(batch_counts=counts, whole_step_graph=False)
    r = predict(_plan(), _tables(), topo, 4096, ROWWISE, settings=settings)
    sync = topo.host_sync_s if counts == "device" else 0.0
    assert r.host_step_time_s == pytest.approx(4.5 * MS + sync, rel=1e-12)
    assert r.step_time_s == max(r.gpu_step_time_s, r.host_step_time_s)
    slow = predict(_plan(), _tables(), replace(topo, host_step_s=50 * MS), 4096, ROWWISE, settings=settings)
    assert slow.step_time_s == pytest.approx(53.5 * MS + sync) and slow.gpu_step_time_s == r.gpu_step_time_s
    small = _plan().to_dict()
    small["tables"][1]["kernel"] = "small"  # big1 on rank 1: no FBGEMM group left there but the replicas'
    on_small = predict(ShardingPlan.from_dict(small), _tables(), topo, 4096, ROWWISE, settings=settings)
    assert on_small.host_step_time_s == pytest.approx(4.5 * MS + sync, rel=1e-12)  # rank 0 still the slowest
    fast = predict(_plan(), _tables(), replace(topo, host_step_s=1e-6, host_group_s=0, host_dp_group_s=0), 4096)
    assert fast.step_time_s == fast.gpu_step_time_s > fast.host_step_time_s > 0
    graphed = predict(_plan(), _tables(), topo, 4096, ROWWISE, settings=replace(settings, whole_step_graph=True))
    assert graphed.host_step_time_s == 0 and graphed.step_time_s == graphed.gpu_step_time_s
    cpu = replace(Topology.preset("cpu", 2), host_step_s=1.0, host_group_s=1.0)
    on_cpu = predict(_cpu_plan(), _tables(), cpu, 64, ROWWISE)
    assert on_cpu.host_step_time_s == 0  # the host runs the lookups there: priced as such


def _cpu_plan() -> ShardingPlan:
    plan = _plan(tiny_dp=False).to_dict()
    for t in plan["tables"]:
        t["tier"] = "host"
    return ShardingPlan.from_dict(plan)


def _dp_tables() -> list[TableConfig]:
    """Two big tables and many tiny ones: the search makes the tiny ones data-parallel."""
    big = [TableConfig(f"big{i}", 4_000_000, 128, (f"b{i}",), ids_per_bag=8) for i in range(2)]
    return big + [TableConfig(f"tiny{i}", 40, 128, (f"t{i}",), ids_per_bag=1) for i in range(12)]


def test_an_eager_plan_the_host_sets_drops_its_data_parallel_tables_when_that_is_faster():
    base = Topology.preset("h100", 2)
    tables = _dp_tables()
    eager = PlannerSettings(batch_counts="host", whole_step_graph=False)
    gpu_only = replace(base, host_step_s=0.0, host_group_s=0.0, host_dp_group_s=0.0)
    plan, _ = plan_with_report(tables, gpu_only, 8192, ROWWISE, None, eager)
    assert any(t.sharding_type.value == "data_parallel" for t in plan.tables)  # the GPUs' choice
    # a host whose data-parallel group costs 20 ms: planned without replicas, and it says why
    slow_dp = replace(base, host_step_s=1 * MS, host_group_s=0.5 * MS, host_dp_group_s=20 * MS)
    said: list[str] = []
    plan2, report2 = search_plan(tables, slow_dp, 8192, ROWWISE, None, eager, say=said.append)
    assert all(t.sharding_type.value != "data_parallel" for t in plan2.tables)
    with_dp = predict(plan, tables, slow_dp, 8192, ROWWISE, settings=eager)
    assert report2.step_time_s < with_dp.step_time_s
    assert len(said) == 1 and "data-parallel tables cost the host most" in said[0] and "planned without them" in said[0]
    # the GPUs set the step (a fast host), or the step is one graph replay: the search's plan stands
    fast = replace(slow_dp, host_group_s=0.0, host_dp_group_s=0.0)
    said.clear()
    plan3, _ = search_plan(tables, fast, 8192, ROWWISE, None, eager, say=said.append)
    assert plan3 == plan_with_report(tables, fast, 8192, ROWWISE, None, eager)[0] and not said
    assert any(t.sharding_type.value == "data_parallel" for t in plan3.tables)
    graph = replace(eager, whole_step_graph=True)
    plan5, _ = search_plan(tables, slow_dp, 8192, ROWWISE, None, graph, say=said.append)
    assert plan5 == plan_with_report(tables, slow_dp, 8192, ROWWISE, None, graph)[0] and not said
    # data-parallel is the only type allowed: nothing to drop
    only_dp = replace(eager, sharding_types=("data_parallel",))
    small = tables[2:]
    plan4, _ = search_plan(small, slow_dp, 8192, ROWWISE, None, only_dp, say=said.append)
    assert all(t.sharding_type.value == "data_parallel" for t in plan4.tables) and not said
