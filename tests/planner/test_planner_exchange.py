"""The table-row-wise output exchange in the plan and the planner: the plan field, the per-level pricing of the
hierarchical exchange (planner/exchange.py), the bytes per level, and the planner's choice of table-row-wise and of
the exchange where it predicts a win, shown in the report. No processes (the runtime: tests/sharding)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embshard import FusedOptimizerConfig, TableConfig
from embshard.planner import PlannerSettings, Topology, loads, plan_with_report, predict
from embshard.planner import exchange as twrw
from embshard.planner.constraints import ParameterConstraints
from embshard.planner.cost import CostModel, TableStats
from embshard.planner.options import table_options
from embshard.spec.plan import Exchange, Shard, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError

TWRW = ShardingType.TABLE_ROW_WISE
HIER, FLAT = Exchange.HIERARCHICAL, Exchange.FLAT
HEAVY = [TableConfig(f"big{i}", 50_000_000, 128, (f"f{i}",), ids_per_bag=30) for i in range(4)]
OPT = FusedOptimizerConfig("rowwise_adagrad")


def _twrw_plan(exchange: Exchange = HIER) -> tuple[list[TableConfig], ShardingPlan]:
    """4 ranks as 2 hosts x 2: t0 in two blocks on host 1, t1 in one block on rank 0, t2 table-wise."""
    tables = [TableConfig("t0", 10, 8, ("a", "b")), TableConfig("t1", 5, 4, ("c",)), TableConfig("t2", 7, 4, ("d",))]
    plan = ShardingPlan(
        4,
        2,
        (
            TablePlan("t0", TWRW, "host", (Shard(3, 0, 5, 0, 8), Shard(2, 5, 5, 0, 8))),
            TablePlan("t1", TWRW, "host", (Shard(0, 0, 5, 0, 4),)),
            TablePlan("t2", "table_wise", "host", (Shard(1, 0, 7, 0, 4),)),
        ),
        exchange,
    )
    plan.check(tables)
    return tables, plan


def test_plan_field_round_trip_default_and_errors():
    tables, plan = _twrw_plan()
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["table_row_wise_exchange"] == "hierarchical"
    old = {k: v for k, v in plan.to_dict().items() if k != "table_row_wise_exchange"}
    assert ShardingPlan.from_dict(old).table_row_wise_exchange is FLAT  # plans saved before the field
    assert "table_row_wise_exchange=hierarchical" in str(plan).splitlines()[0]
    no_twrw = replace(plan, tables=(plan["t2"],))
    assert "exchange" not in str(no_twrw)
    with pytest.raises(ConfigError, match=r"table_row_wise_exchange='ring' is invalid: choose one of \['flat'"):
        ShardingPlan.from_dict({**plan.to_dict(), "table_row_wise_exchange": "ring"})
    with pytest.raises(ConfigError, match="table_row_wise_exchange='ring' is invalid: choose one of auto"):
        PlannerSettings(table_row_wise_exchange="ring")


def test_hierarchical_loads_are_the_bytes_of_each_level():
    """A table of 3 blocks on ranks 4-6 of host 1 (8 ranks, 2 hosts x 4): per rank, the reduce inside host 1, the
    rows to the peers and their gradients, as the module docstring of planner/exchange.py counts them."""
    topo = Topology.preset("h100", 8, 4)
    H, L, bi, bx = 2, 4, topo.intra_host_bw, topo.inter_host_bw
    model = CostModel(topo, 1024, OPT, exchange=HIER)
    t = TableConfig("t", 3000, 64, ("f", "g"), ids_per_bag=4)
    rows = np.array([1000.0, 1000.0, 1000.0])
    wk = model.work(TableStats.one(t), TWRW, "hbm", rows, np.full(3, 64.0))
    P = 1024 * 2 * 64 * 4
    m = loads.spread(np.array([4, 5, 6]), *model.block_vecs(wk, TWRW, 3), 8, 4)
    approx = lambda x: pytest.approx(x, rel=1e-12)  # noqa: E731
    assert m[loads.OUT_RS_SEND].tolist() == approx([0, 0, 0, 0, *[(L - 1) * H * P / bi] * 3, 0])
    assert m[loads.OUT_RS_RECV].tolist() == approx([0, 0, 0, 0, *[2 * H * P / bi] * 3, 3 * H * P / bi])
    assert m[loads.OUT_SEND_X].tolist() == approx([0] * 4 + [(H - 1) * P / bx] * 4)
    assert m[loads.OUT_RECV_X].tolist() == approx([P / bx] * 4 + [0] * 4)
    assert m[loads.GRAD_SEND_X].tolist() == approx(m[loads.OUT_RECV_X].tolist())
    assert m[loads.GRAD_RECV_X].tolist() == approx(m[loads.OUT_SEND_X].tolist())
    assert m[loads.GRAD_AG_SEND].tolist() == approx(m[loads.OUT_RS_RECV].tolist())
    assert m[loads.GRAD_AG_RECV].tolist() == approx(m[loads.OUT_RS_SEND].tolist())
    for row in (loads.OUT_SEND_I, loads.OUT_RECV_I, loads.GRAD_SEND_I, loads.GRAD_RECV_I):
        assert not m[row].any()
    flat = loads.spread(np.array([4, 5, 6]), *CostModel(topo, 1024, OPT, exchange=FLAT).block_vecs(wk, TWRW, 3), 8, 4)
    assert flat[loads.OUT_SEND_X, 4] == approx((8 - L) * P / bx) and not flat[loads.OUT_RS_SEND].any()
    assert flat[loads.OUT_RECV_X, 0] == approx(3 * P / bx)  # every block's partials cross hosts
    assert (m[: loads.OUT_RS_SEND] == flat[: loads.OUT_RS_SEND]).all()  # the input side is the same


def test_exchange_bytes_per_level():
    tables, plan = _twrw_plan()
    B = [3, 0, 5, 2]  # S_0 = ranks 0 and 2: 8 samples, S_1 = ranks 1 and 3: 2
    got = twrw.exchange_bytes(plan, tables, B)
    row0, row1 = 2 * 8 * 4, 1 * 4 * 4  # t0: 2 features x 8 columns; t1: 1 x 4 (fp32)
    # flat: each block sends every other rank its samples: t0's blocks on host 1 (ranks 2, 3), t1's on rank 0
    flat_intra = (B[2] + B[3] - B[3]) * row0 + (B[2] + B[3] - B[2]) * row0 + (B[1]) * row1
    flat_cross = 2 * (B[0] + B[1]) * row0 + (B[2] + B[3]) * row1
    assert got[FLAT] == {"intra_host": flat_intra, "cross_host": flat_cross}
    # hierarchical: each block sends the other local rank its sample set; each sample's row crosses hosts once
    hier_intra = (2 + 8) * row0 + 2 * row1  # rank 3 (local 1) sends S_0, rank 2 (local 0) S_1; rank 0 sends S_1
    hier_cross = (B[0] + B[1]) * row0 + (B[2] + B[3]) * row1
    assert got[HIER] == {"intra_host": hier_intra, "cross_host": hier_cross}
    one_host = replace(plan, local_world_size=4, tables=(replace(plan["t0"]), replace(plan["t1"]), plan["t2"]))
    same = twrw.exchange_bytes(one_host, tables, B)
    assert same[HIER] == same[FLAT] and same[FLAT]["cross_host"] == 0  # one host: the flat exchange runs


def test_unit_times_and_resolve():
    h100 = Topology.preset("h100", 16, 8)
    t = twrw.unit_times(h100)
    assert t[HIER] == pytest.approx(2 * (7 * 2 / 290e9 + 1 / 45e9))
    assert t[FLAT] == pytest.approx(2 * 8 / 45e9)
    assert twrw.resolve("auto", h100) is HIER and twrw.resolve("flat", h100) is FLAT
    cpu = Topology.preset("cpu", 4, 2)
    assert twrw.resolve("auto", cpu) is FLAT  # 2 x 2 on the cpu preset: a tie per byte, flat has fewer collectives
    assert twrw.resolve("hierarchical", cpu) is HIER
    assert twrw.resolve("auto", Topology.preset("h100", 8, 8)) is FLAT  # one host: the same exchange


def test_planner_chooses_table_row_wise_and_the_hierarchical_exchange_where_it_wins():
    """4 tables of 50M x 128 with 30 ids per bag on 2 hosts x 8 H100: table-wise leaves 12 ranks idle; split over
    a host's ranks they are faster, and the hierarchical exchange faster than the flat one."""
    topo = Topology.preset("h100", 16, 8)
    plan, report = plan_with_report(HEAVY, topo, 8192, OPT)
    assert {tp.sharding_type for tp in plan.tables} == {TWRW}
    assert plan.table_row_wise_exchange is HIER
    times = report.exchange_step_s
    assert times["hierarchical"] == pytest.approx(report.step_time_s) and times["hierarchical"] < times["flat"]
    assert report.search_step_time_s == pytest.approx(report.gpu_step_time_s, rel=1e-9)
    by = report.exchange_bytes
    assert by["hierarchical"]["cross_host"] * 8 == pytest.approx(by["flat"]["cross_host"])  # L times fewer
    text = report.summary()
    assert "table-row-wise exchange: hierarchical; predicted step: hierarchical" in text and "flat" in text
    assert "(2 host(s) x 8)" in text
    assert report.to_dict()["table_row_wise_exchange"]["plan"] == "hierarchical"
    phases = dict(zip(loads.PHASES, report.phase_s))
    assert phases["output intra-host reduce"] > 0 and phases["gradient intra-host gather"] > 0
    # The same plan loaded and predicted; the flat setting; table-wise when all 16 ranks share one host.
    assert predict(ShardingPlan.from_dict(plan.to_dict()), HEAVY, topo, 8192, OPT).step_time_s == pytest.approx(
        report.step_time_s
    )
    flat_plan, flat_report = plan_with_report(
        HEAVY, topo, 8192, OPT, settings=PlannerSettings(table_row_wise_exchange="flat")
    )
    assert flat_plan.table_row_wise_exchange is FLAT and flat_report.step_time_s > report.step_time_s
    one, one_report = plan_with_report(HEAVY, Topology.preset("h100", 16, 16), 8192, OPT)
    assert TWRW not in {tp.sharding_type for tp in one.tables} and not one_report.exchange_step_s


def test_cpu_topology_says_hosts():
    """4 CPU processes as 2 hosts x 2 or as 1 host x 4: the topology says which, and only 2 hosts offer
    table-row-wise; there the planner predicts both exchanges for a table-row-wise plan."""
    t = TableConfig("t", 100_000, 64, ("f",), ids_per_bag=10)
    two, one = Topology.preset("cpu", 4, 2), Topology.preset("cpu", 4, 4)
    assert "(2 host(s) x 2)" in two.describe() and "(1 host(s) x 4)" in one.describe()
    kinds = lambda topo: {o.sharding for o in table_options(t, ParameterConstraints(), topo, PlannerSettings())}  # noqa: E731
    assert TWRW in kinds(two) and TWRW not in kinds(one)
    only = {"t": ParameterConstraints(sharding_types=(TWRW,))}
    for setting, want in (("auto", None), ("hierarchical", HIER), ("flat", FLAT)):
        plan, report = plan_with_report([t], two, 512, OPT, only, PlannerSettings(table_row_wise_exchange=setting))
        assert set(report.exchange_step_s) == {"flat", "hierarchical"}
        best = min(report.exchange_step_s, key=report.exchange_step_s.get)
        assert plan.table_row_wise_exchange is (want or Exchange(best))
