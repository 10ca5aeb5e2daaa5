"""Planner search: feasible, deterministic, constraint-respecting plans that pass ShardingPlan.check, the choices
that matter (data-parallel tiny tables, HBM before UVM), errors with numbers, round trips, explain, the CLI."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from embshard.planner import PlannerSettings, PlanningError, Topology, plan_with_report, predict
from embshard.planner.explain import explain
from embshard.planner.topology import GIB
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig
from embshard.tools.plan import main as plan_main

DP, TW, RW = ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.ROW_WISE
ROWWISE = FusedOptimizerConfig("rowwise_adagrad")


def hetero124() -> list[TableConfig]:
    tables = [TableConfig(f"big_{i}", 100_000_000, 128, (f"big_{i}",), ids_per_bag=1) for i in range(4)]
    tables += [TableConfig(f"mid_{i}", 5_000_000, 64, (f"mid_{i}",), ids_per_bag=5) for i in range(20)]
    tables += [TableConfig(f"small_{i}", 10_000, 16, (f"small_{i}",), ids_per_bag=30) for i in range(100)]
    return tables


def random_tables(seed: int, n: int) -> list[TableConfig]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = rng.choice([50, 3_000, 200_000, 5_000_000, 40_000_000])
        dim = rng.choice([8, 16, 32, 64, 128, 256])
        out.append(
            TableConfig(
                f"t{i}",
                rows,
                dim,
                tuple(f"f{i}_{k}" for k in range(rng.choice([1, 1, 2]))),
                ids_per_bag=rng.choice([1, 3, 20]),
                weighted=rng.random() < 0.2,
                data_type=rng.choice(["fp32", "fp16"]),
            )
        )
    return out


def assert_valid(plan: ShardingPlan, report, tables) -> None:
    plan.check(tables)
    for r in report.ranks:
        assert r.storage.hbm <= r.hbm_budget + 1 and r.storage.ddr <= r.ddr_budget + 1
    for t in plan.tables:
        assert all(s.num_cols % 4 == 0 for s in t.shards) or t.sharding_type is not ShardingType.COLUMN_WISE
    assert report.search_step_time_s == pytest.approx(report.gpu_step_time_s, rel=1e-9)


def test_hetero124_makes_tiny_tables_data_parallel():
    tables = hetero124()
    plan, report = plan_with_report(tables, Topology.preset("h200", 2), 8192, ROWWISE)
    assert_valid(plan, report, tables)
    assert all(plan[f"small_{i}"].sharding_type is DP for i in range(100))
    assert all(plan[f"big_{i}"].sharding_type is not DP and plan[f"big_{i}"].tier is MemoryTier.HBM for i in range(4))
    # The same tables table-wise (TorchRec's plan) are predicted slower.
    torchrec_like = ShardingPlan(
        2, 2, tuple(t if not t.table.startswith("small") else _as_tw(t, i % 2) for i, t in enumerate(plan.tables))
    )
    slower = predict(torchrec_like, tables, Topology.preset("h200", 2), 8192, ROWWISE)
    # Routing their 24.6M ids per rank costs more than the all-reduce and update of 64 MB of replicas. (TorchRec
    # 1.6 measured 19.8 against 7.5 ms; its kernels do not explain that gap, so the model does not claim it.)
    assert slower.step_time_s > 1.03 * report.step_time_s
    assert "data_parallel hbm" in explain(report, "small_7") and "<- chosen" in explain(report, "small_7")


def _as_tw(tp, rank):
    from embshard.spec.plan import Shard, TablePlan

    s = tp.shards[0]
    return TablePlan(tp.table, TW, MemoryTier.HBM, (Shard(rank, 0, s.num_rows, 0, s.num_cols),))


@pytest.mark.parametrize(
    "device,world,local,seed",
    [("h100", 1, 1, 0), ("h100", 3, 3, 1), ("h200", 8, 8, 2), ("h100", 16, 8, 3), ("a100", 12, 4, 4), ("cpu", 3, 3, 5)],
)
def test_random_models_give_valid_plans(device, world, local, seed):
    tables = random_tables(seed, 40)
    topo = Topology.preset(device, world, local, ddr_gib=4096)
    plan, report = plan_with_report(tables, topo, 512, FusedOptimizerConfig("adam"))
    assert_valid(plan, report, tables)
    if device == "cpu":
        assert {t.tier for t in plan.tables} == {MemoryTier.HOST}


def test_tight_hbm_moves_large_tables_to_uvm_and_keeps_busy_ones_in_hbm():
    tables = [TableConfig(f"large_{i}", 20_000_000, 128, (f"l{i}",), ids_per_bag=1) for i in range(6)]
    tables += [TableConfig(f"busy_{i}", 1_000_000, 64, (f"b{i}",), ids_per_bag=20) for i in range(10)]
    topo = Topology.preset("h200", 2, hbm_gib=16)
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE)
    assert_valid(plan, report, tables)
    assert all(plan[f"busy_{i}"].tier is MemoryTier.HBM for i in range(10))
    assert sum(plan[f"large_{i}"].tier is not MemoryTier.HBM for i in range(6)) >= 3
    moved = [n for t in report.tables for n in t.notes if "GPU memory over budget" in n]
    assert moved


def test_deterministic():
    tables = random_tables(7, 60)
    topo = Topology.preset("h100", 16, 8)
    a = plan_with_report(tables, topo, 1024)[0]
    b = plan_with_report(list(tables), topo, 1024)[0]
    assert a.to_dict() == b.to_dict()


def test_constraints_are_honoured():
    tables = random_tables(11, 12)
    cons = {
        "t0": {"sharding_types": ["row_wise"]},
        "t1": {"tiers": ["uvm"]},
        "t2": {"ranks": [3]},
        "t3": {"colocate_with": "t2"},
        "t4": {"sharding_types": ["column_wise"], "column_shards": [2]},
        "t5": {"sharding_types": ["table_wise"], "ranks": [1, 2]},
    }
    tables[4] = TableConfig("t4", 1000, 64, ("f4",))
    plan, report = plan_with_report(tables, Topology.preset("h100", 4), 256, constraints=cons)
    assert_valid(plan, report, tables)
    assert plan["t0"].sharding_type is RW and len(plan["t0"].shards) == len(set(plan["t0"].ranks))
    assert plan["t1"].tier is MemoryTier.UVM
    assert set(plan["t2"].ranks) == {3} and plan["t3"].ranks == plan["t2"].ranks
    assert plan["t4"].sharding_type is ShardingType.COLUMN_WISE and len(plan["t4"].shards) == 2
    assert plan["t5"].sharding_type is TW and plan["t5"].ranks[0] in (1, 2)
    assert "co-located with 't2'" in explain(report, "t3")


def test_table_too_large_for_any_rank_names_the_numbers():
    t = TableConfig("huge", 400_000_000, 128, ("f",))  # 190.7 GiB of weights
    topo = Topology.preset("h100", 4, ddr_gib=64)
    with pytest.raises(PlanningError) as e:
        plan_with_report([t], topo, 1024, constraints={"huge": {"sharding_types": ["table_wise"]}})
    msg = str(e.value)
    assert "'huge'" in msg and "190.73 GiB" in msg and "fixes:" in msg and "row_wise" in msg
    budget = e.value.details["hbm_budget"] / GIB
    assert f"{budget:.2f} GiB" in msg


def test_totals_over_budget_say_needed_available_and_ranks_to_use():
    tables = [TableConfig(f"t{i}", 50_000_000, 128, (f"f{i}",)) for i in range(8)]  # 190 GiB of weights
    topo = Topology.preset("h100", 2, hbm_gib=40, ddr_gib=48)
    with pytest.raises(PlanningError) as e:
        plan_with_report(tables, topo, 1024, ROWWISE)
    msg, d = str(e.value), e.value.details
    assert "no plan fits" in msg and "host memory: needed at least" in msg
    assert f"{d['ddr_needed'] / GIB:.2f} GiB" in msg and f"{d['ddr_available'] / GIB:.2f} GiB" in msg
    m = re.search(r"use at least (\d+) ranks", msg)
    assert m and int(m.group(1)) == d["min_world_size"] >= 3


def test_plan_round_trip_and_report_json(tmp_path):
    tables = random_tables(3, 20)
    plan, report = plan_with_report(tables, Topology.preset("h100", 4), 256)
    for name in ("p.yaml", "p.json"):
        plan.save(tmp_path / name)
        back = ShardingPlan.load(tmp_path / name)
        assert back == plan
        back.check(tables)
        again = predict(back, tables, Topology.preset("h100", 4), 256)
        assert again.step_time_s == pytest.approx(report.step_time_s)
    data = json.loads(report.to_json())
    assert data["plan"] == plan.to_dict() and len(data["ranks"]) == 4
    assert data["step_time_ms"] == pytest.approx(report.step_time_s * 1e3)


def test_settings_reserve_shrinks_budget():
    tables = random_tables(5, 10)
    a = plan_with_report(tables, Topology.preset("h100", 2), 256)[1]
    b = plan_with_report(tables, Topology.preset("h100", 2), 256, settings=PlannerSettings(hbm_reserve_gib=30))[1]
    assert b.ranks[0].hbm_budget == pytest.approx(a.ranks[0].hbm_budget - (30 * GIB - a.ranks[0].hbm_reserve))


def test_bad_inputs():
    with pytest.raises(ConfigError, match="batch_size=0 is invalid"):
        plan_with_report(random_tables(0, 2), Topology.preset("h100", 2), 0)


def test_cli(tmp_path, capsys):
    out, rep = tmp_path / "plan.yaml", tmp_path / "report.json"
    plan_main(
        ["configs/planner/hetero124.yaml", "--world-size", "2", "--out", str(out), "--report", str(rep)]
        + ["--explain", "small_3"]
    )
    text = capsys.readouterr().out
    assert "predicted step time" in text and "table 'small_3'" in text
    plan = ShardingPlan.load(out)
    assert plan["small_3"].sharding_type is DP
    assert json.loads(rep.read_text())["plan"] == plan.to_dict()
    plan_main(["configs/planner/uniform26.yaml", "--world-size", "4", "--device", "h100", "--format", "json"])
    assert json.loads(capsys.readouterr().out)["world_size"] == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: 8\ntables: [{name: a, num_embeddings: 4, embedding_dim: 4, idsperbag: 2}]\n")
    with pytest.raises(SystemExit):
        plan_main([str(bad), "--world-size", "2"])
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "unknown key 'idsperbag'" in err
    with pytest.raises(SystemExit):
        plan_main(["configs/planner/overflow.yaml", "--world-size", "2", "--hbm-gib", "4", "--ddr-gib", "8"])
    assert "no plan fits" in capsys.readouterr().err


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from embshard.tools.plan_plot import plot_report

    report = plan_with_report(random_tables(2, 10), Topology.preset("h100", 4), 256)[1]
    path = plot_report(report, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loads_match_between_search_and_predict_on_multi_host():
    tables = random_tables(9, 30)
    plan, report = plan_with_report(tables, Topology.preset("h100", 16, 4), 512)
    assert np.all(report.loads >= 0)
    assert report.search_step_time_s == pytest.approx(report.gpu_step_time_s, rel=1e-9)


def test_alone_times_and_explain_of_a_loaded_plan(tmp_path):
    from embshard.planner import loads
    from embshard.planner.cost import CostModel, TableStats

    tables = random_tables(13, 25)
    topo = Topology.preset("h100", 8, 4)
    plan, _ = plan_with_report(tables, topo, 512)
    plan.save(tmp_path / "p.yaml")
    report = predict(ShardingPlan.load(tmp_path / "p.yaml"), tables, topo, 512)
    model = CostModel(topo, 512, FusedOptimizerConfig(), exchange=plan.table_row_wise_exchange)
    for t in tables:
        tp = plan[t.name]
        rows = np.array([s.num_rows for s in tp.shards], dtype=float)
        cols = np.array([s.num_cols for s in tp.shards], dtype=float)
        wk = model.work(TableStats.one(t), tp.sharding_type, tp.tier, rows, cols, tp.cache_load_factor, 0.0, tp.kernel)
        shape = (len(rows), loads.NROWS)
        vecs = [np.broadcast_to(v, shape) for v in model.block_vecs(wk, tp.sharding_type, len(rows))]
        alone = loads.step_time(loads.spread(np.array(tp.ranks), *vecs, 8, 4))
        assert report.table(t.name).time_s == pytest.approx(alone, rel=1e-9)
    text = explain(report, "t3")
    assert "table 't3'" in text and "<- chosen" in text and "balanced ms" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="calibrate measures the GPUs on a machine that has them")
def test_calibrate_on_cpu(tmp_path):
    from embshard.tools.calibrate import main as calibrate_main

    out = tmp_path / "topo.yaml"
    calibrate_main(["--out", str(out), "--size-mib", "8", "--iters", "2", "--no-collectives"])
    topo = Topology.load(out)
    assert "ddr_bw" in topo.measured and topo.ddr_bw > 0 and topo.source.startswith("calibrated")
    assert {"fwd_id_s", "bwd_id_s", "bwd_row_s"} <= set(topo.measured) and topo.cost_model == 2
    # The fitted constants depend on this machine's timing (0 when the modelled bytes explain it all): finite, >= 0.
    fitted = [topo.fwd_id_s, topo.fwd_byte_s, topo.bwd_id_s, topo.bwd_byte_s, topo.bwd_row_s]
    assert all(np.isfinite(x) and x >= 0 for x in fitted) and "fwd_id_ns" in out.read_text()
    # the small-table kernel's constants are GPU-only: the preset's estimates stay, not marked measured
    assert list(vars(topo.kernel_constants).values()) == pytest.approx(
        list(vars(Topology.preset("cpu", 2).kernel_constants).values())
    )
    assert not {"small_fwd_id_s", "regroup_efficiency"} & set(topo.measured)
    plan, report = plan_with_report(random_tables(1, 6), topo.with_sizes(2, ddr_gib=256), 64)
    assert {t.tier for t in plan.tables} == {MemoryTier.HOST}


def test_calibrate_fit_recovers_known_constants():
    """The lookup fit on synthetic timings made from known constants gives those constants back (no clock)."""
    from embshard.tools.calibrate import CPU_CASES, _bytes_model, fit_lookup

    topo = Topology.preset("cpu", 2)
    true = {"fwd_id_s": 2e-9, "fwd_byte_s": 3e-12, "bwd_id_s": 4e-9, "bwd_byte_s": 1e-12, "bwd_row_s": 5e-9}
    measured = []
    for case in CPU_CASES:
        f0, b0, n, u, rb = _bytes_model(topo, case)
        fwd = f0 + n * (true["fwd_id_s"] + rb * true["fwd_byte_s"])
        bwd = b0 + n * (true["bwd_id_s"] + rb * true["bwd_byte_s"]) + u * true["bwd_row_s"]
        measured.append((fwd, bwd))
    got = fit_lookup(topo, CPU_CASES, measured)
    for k, v in true.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    # A backward measured as 0 (the step's time less the forward's, under a noisy clock) is left out, not divided by:
    # the other cases still give the forward's constants, and no backward time leaves its constants at 0.
    zero_bwd = fit_lookup(topo, CPU_CASES, [(f, 0.0) for f, _ in measured])
    assert [zero_bwd[k] for k in ("bwd_id_s", "bwd_byte_s", "bwd_row_s")] == [0.0, 0.0, 0.0]
    assert zero_bwd["fwd_id_s"] == pytest.approx(true["fwd_id_s"], rel=1e-6)
    one_zero = fit_lookup(topo, CPU_CASES, [measured[0], (measured[1][0], 0.0), measured[2]])
    assert all(np.isfinite(v) and v >= 0 for v in one_zero.values())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_greedy_is_close_to_the_exact_optimum_on_small_models(seed):
    tables = random_tables(100 + seed, 4)
    topo = Topology.preset("h100", 3, 3, ddr_gib=4096)
    off = PlannerSettings(exact_limit=0)
    greedy = plan_with_report(tables, topo, 256, settings=off)[1]
    best = plan_with_report(tables, topo, 256, settings=PlannerSettings(exact_limit=10**6))[1]
    assert best.step_time_s <= greedy.step_time_s + 1e-12
    assert greedy.step_time_s <= 1.15 * best.step_time_s
    assert_valid(best.plan, best, tables)


# ---- memory of the step, and the measured workloads ---------------------------------------------------------
def _tw(t, rank, tier=MemoryTier.HBM):
    from embshard.spec.plan import Shard, TablePlan

    kw = {"cache_load_factor": 0.2} if tier is MemoryTier.UVM_CACHING else {}
    return TablePlan(t.name, TW, tier, (Shard(rank, 0, t.num_embeddings, 0, t.embedding_dim),), **kw)


def overflow() -> list[TableConfig]:
    tables = [TableConfig(f"large_{i}", 20_000_000, 128, (f"l{i}",), ids_per_bag=2) for i in range(6)]
    return tables + [TableConfig(f"busy_{i}", 1_000_000, 64, (f"b{i}",), ids_per_bag=20) for i in range(10)]


def overflow_measured_plan(tables) -> ShardingPlan:
    """The plan the planner made before step buffers were counted; it measured 16.35 GiB on a 16 GiB budget."""
    U, C = MemoryTier.UVM, MemoryTier.UVM_CACHING
    where = [(0, U), (0, C), (1, MemoryTier.HBM), (0, C), (1, C), (0, MemoryTier.HBM), (0, MemoryTier.HBM)]
    where += [(1, MemoryTier.HBM)] * 9
    return ShardingPlan(2, 2, tuple(_tw(t, r, tier) for t, (r, tier) in zip(tables, where)))


def test_overflow_at_16_gib_fits_with_its_step_buffers():
    tables = overflow()
    topo = Topology.preset("h200", 2, hbm_gib=16)
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE)
    assert_valid(plan, report, tables)
    assert not report.over_budget
    for r in report.ranks:
        assert r.storage.hbm_buffers > 0 and r.peak_hbm <= 16 * GIB - r.hbm_reserve + 1
    # The plan made without the step buffers is over budget on rank 0 now, and says so.
    old = predict(overflow_measured_plan(tables), tables, topo, 8192, ROWWISE)
    assert old.over_budget == [0] and "OVER BUDGET on rank(s) [0]" in old.summary()


def test_a_plan_that_fits_only_without_its_step_buffers_is_refused_with_numbers():
    from embshard.planner.cost import CostModel, TableStats
    from embshard.planner.errors import gib

    t = TableConfig("t", 1_000_000, 64, ("f",), ids_per_bag=50)
    model = CostModel(Topology.preset("h200", 1), 8192, ROWWISE)
    mem = model.storage(TableStats.one(t), TW, MemoryTier.HBM, 1e6, 64.0)
    static = float(mem.hbm_weights + mem.hbm_state)
    own = model.batch_bytes([t])
    gib_ = (static + own + 0.5 * float(mem.hbm_buffers)) / GIB  # room for half the step's buffers
    topo = Topology.preset("h200", 1, hbm_gib=gib_)
    only = {"t": {"sharding_types": ["table_wise"], "tiers": ["hbm"]}}
    settings = PlannerSettings(hbm_reserve_gib=0)
    with pytest.raises(PlanningError) as e:
        plan_with_report([t], topo, 8192, ROWWISE, only, settings)
    msg = str(e.value)
    shard = gib(float(mem.hbm_weights + mem.hbm_state + mem.hbm_buffers))
    assert (
        f"largest shard: GPU {shard}, host {gib(0.0)} (1 shard(s); of which {gib(mem.hbm_buffers)} step buffers)" in msg
    )
    assert f"{e.value.details['hbm_budget'] / GIB:.2f} GiB" in msg
    more = Topology.preset("h200", 1, hbm_gib=gib_ + float(mem.hbm_buffers) / GIB)
    plan, report = plan_with_report([t], more, 8192, ROWWISE, only, settings)
    assert report.peak_hbm == pytest.approx(static + float(mem.hbm_buffers) + own)


def test_the_host_sync_is_paid_once_per_step():
    """With device batch counts the first model-parallel table brings the step's one host sync, the next ones do
    not, and removing the last takes it away; with host counts (the training pipeline's, the default) there is
    none: the phase holds only the exchange's collective latencies."""
    from embshard.planner import PlannerSettings, loads
    from embshard.planner.choices import build_items
    from embshard.planner.constraints import resolve_constraints
    from embshard.planner.cost import CostModel
    from embshard.planner.state import State

    tables = [TableConfig(f"t{i}", 100_000, 32, (f"f{i}",)) for i in range(3)]
    topo = Topology.preset("h200", 2)
    host = CostModel(topo, 256, ROWWISE)
    assert not host.step_fixed().any() and not host.device_counts
    items = build_items(host, tables, resolve_constraints(tables, {}, 2))
    tw = next(ch for ch in items[0].choices if ch.option.sharding is TW and ch.option.tier is MemoryTier.HBM)
    assert 0 < State(host, 1e12, 1e12).delta(items[0], tw, (0,))[loads.PHASE_ROWS[0]].max() < topo.host_sync_s
    model = CostModel(topo, 256, ROWWISE, PlannerSettings(batch_counts="device"))
    assert model.step_fixed()[loads.PHASE_ROWS[0]].max() == topo.host_sync_s
    items = build_items(model, tables, resolve_constraints(tables, {}, 2))
    state = State(model, 1e12, 1e12)
    pick = {
        i: next(c for c, ch in enumerate(it.choices) if ch.option.sharding is st and ch.option.tier is MemoryTier.HBM)
        for i, (it, st) in enumerate(zip(items, (TW, RW, DP)))
    }
    sync = topo.host_sync_s
    first = state.delta(items[0], items[0].choices[pick[0]], (0,))
    assert first[loads.PHASE_ROWS[0]].max() >= sync
    state.apply(0, items[0], pick[0], (0,))
    second = state.delta(items[1], items[1].choices[pick[1]], (0, 1))
    assert second[loads.PHASE_ROWS[0]].max() < sync  # row-wise joins: its collectives, no second sync
    state.apply(1, items[1], pick[1], (0, 1))
    state.remove(0, items[0])
    assert state.loads[loads.PHASE_ROWS[0]].max() >= sync  # still one model-parallel table
    state.remove(1, items[1])
    assert state.loads[loads.PHASE_ROWS[0]].max() < 1e-12


def test_predictions_of_the_measured_workloads():
    """2 H200, batch 8192, row-wise Adagrad (docs/benchmarks.md): step time within 20% of what the runtime
    measured (uniform26 3.57 and 4.15 ms in two runs, hetero124 with its tiny tables data-parallel 6.62 ms, the
    planner's overflow plan at 16 GiB 5.06 ms); peak memory within 10% of the measured 6.64, 110.39 and 14.26 GiB."""
    from embshard.planner import simple_plan

    topo = Topology.preset("h200", 2)
    u26 = [TableConfig(f"t{i}", 1_000_000, 128, (f"f{i}",), ids_per_bag=10) for i in range(26)]
    r = predict(simple_plan(u26, 2, tier=MemoryTier.HBM), u26, topo, 8192, ROWWISE)
    assert r.step_time_s == pytest.approx(3.86e-3, rel=0.2) and r.peak_hbm / GIB == pytest.approx(6.64, rel=0.1)
    het = hetero124()
    dp = {t.name: DP for t in het if t.name.startswith("small")}
    r = predict(simple_plan(het, 2, sharding_types=dp, tier=MemoryTier.HBM), het, topo, 8192, ROWWISE)
    assert r.step_time_s == pytest.approx(6.62e-3, rel=0.2) and r.peak_hbm / GIB == pytest.approx(110.39, rel=0.1)
    ovf = overflow()  # the measured plan: the large tables UVM-cached (the search now moves them off whole)
    cached = PlannerSettings(tiers=(MemoryTier.HBM, MemoryTier.UVM_CACHING))
    plan, r = plan_with_report(ovf, topo.with_sizes(hbm_gib=16), 8192, ROWWISE, settings=cached)
    assert r.step_time_s == pytest.approx(5.06e-3, rel=0.2) and r.peak_hbm / GIB == pytest.approx(14.26, rel=0.1)


def test_raw_id_tables_pay_the_remap_launches_once_per_group_and_rank():
    """Raw-id tables form lookup groups of their own (the runtime's LocalShard.group_key): a rank pays RAW_KERNELS
    launches once for all its raw-id shards of one group, plus each shard's per-id, per-row and reset terms; a
    raw-id table beside static ones on a rank adds a second group's lookup launches. The search prices plans
    with raw-id tables as predict does."""
    import dataclasses

    from embshard.planner import cost, loads, simple_plan
    from embshard.planner.cost import CostModel, TableStats

    topo = Topology.preset("h100", 2)
    static = [TableConfig(f"r{i}", 200_000 + 1000 * i, 64, (f"g{i}",), ids_per_bag=5) for i in range(6)]
    raw = [dataclasses.replace(t, ids="raw") for t in static]
    plan = simple_plan(static, 2, tier=MemoryTier.HBM)
    model = CostModel(topo, 1024, ROWWISE)
    remap = np.zeros(2)
    for tp, t in zip(plan.tables, raw, strict=True):
        (sh,) = tp.shards
        n, _ = model.volumes(TableStats.one(t), TW, sh.num_rows)
        terms = model.raw_terms(TableStats.one(t), tp.tier, n, sh.num_rows, 64 * 4.0, model.state_bytes(64))
        remap[sh.rank] += sum(terms.values())
    launches = cost.RAW_KERNELS * topo.kernel_s
    base = predict(plan, static, topo, 1024, ROWWISE).loads[loads.FWD]
    every = predict(plan, raw, topo, 1024, ROWWISE).loads[loads.FWD]
    assert every - base == pytest.approx(remap + launches, rel=1e-9)  # one group a rank, not one per table
    one = [raw[0], *static[1:]]
    r0 = plan[raw[0].name].ranks[0]
    mixed = predict(plan, one, topo, 1024, ROWWISE).loads
    n, _ = model.volumes(TableStats.one(raw[0]), TW, raw[0].num_embeddings)
    alone = sum(model.raw_terms(TableStats.one(raw[0]), MemoryTier.HBM, n, raw[0].num_embeddings, 256.0, 4.0).values())
    group = model.group_fixed(TW, MemoryTier.HBM)  # the static group's launches, now paid twice on r0
    extra = mixed[:, r0] - predict(plan, static, topo, 1024, ROWWISE).loads[:, r0]
    assert extra[loads.FWD] == pytest.approx(alone + launches + group[loads.FWD], rel=1e-9)
    assert extra[loads.BWD] == pytest.approx(group[loads.BWD], rel=1e-9)
    for tables in (raw, one, [*one, *random_tables(3, 8)]):
        p, report = plan_with_report(tables, Topology.preset("h100", 8, 4), 512)
        assert report.search_step_time_s == pytest.approx(report.gpu_step_time_s, rel=1e-9)
        assert_valid(p, report, tables)


def test_a_graphed_step_is_priced_without_the_per_bag_term_and_a_fallback_as_eager():
    """A plan the whole-step graph holds is predicted without the eager step's per-bag term (bags x batch_bag_s:
    the host's work per feature and bag); where no graph-held plan fits, the search plans without the graph and
    prices the step as eager."""
    from embshard.planner.policy import search_plan

    tables = hetero124()[4:30]  # 20 mid tables and 6 small ones
    topo = Topology.preset("h200", world_size=2)  # its per-bag term (the H100 prices its host's floor instead)
    eager = plan_with_report(tables, topo, 8192, ROWWISE, None, PlannerSettings(whole_step_graph=False))
    graphed = search_plan(tables, topo, 8192, ROWWISE, None, PlannerSettings(whole_step_graph=True))
    bags = 8192 * sum(len(t.feature_names) for t in tables)
    assert graphed[0] == eager[0]  # the same plan here (table-wise and data-parallel, all in HBM)
    gap = eager[1].gpu_step_time_s - graphed[1].step_time_s  # the GPUs' time: the host's is priced apart
    assert gap == pytest.approx(bags * topo.batch_bag_s, rel=1e-6) and gap > 0.1e-3, gap
    again = predict(eager[0], tables, topo, 8192, ROWWISE, settings=PlannerSettings(whole_step_graph=True))
    assert again.step_time_s == pytest.approx(graphed[1].step_time_s, rel=1e-9)
    # the summary says how the step is priced: the graph's, or the eager step's GPU and host times
    assert "step: one CUDA graph replay" in graphed[1].summary()
    r = eager[1]
    assert "step: eager" in r.summary()
    assert r.host_step_time_s == 0 and "which this topology does not price" in r.summary()
    h100 = predict(eager[0], tables, Topology.preset("h100", world_size=2), 8192, ROWWISE)
    line = f"the GPUs run it in {h100.gpu_step_time_s * 1e3:.3f} ms, the host issues it in {h100.host_step_time_s * 1e3:.3f}"
    assert h100.host_step_time_s > 0 and line in h100.summary()
    cpu = plan_with_report(tables[:3], Topology.preset("cpu", world_size=2), 64, ROWWISE)[1]
    assert "step:" not in cpu.summary()
    # only row-wise allowed: no plan the graph holds; planned and priced as the eager step
    cw = PlannerSettings(whole_step_graph=True, sharding_types=(ShardingType.ROW_WISE,))
    said = []
    mid = tables[:20]
    fallback = search_plan(mid, topo, 8192, ROWWISE, None, cw, say=said.append)
    eager_cw = plan_with_report(mid, topo, 8192, ROWWISE, None, PlannerSettings(sharding_types=cw.sharding_types))
    assert said and fallback[1].step_time_s == pytest.approx(eager_cw[1].step_time_s, rel=1e-9)
