"""The planner and the small-table kernel (TablePlan.kernel 'small'): its cost terms, where the planner picks it
(small hot tables on GPUs: yes; large tables, fp16, CPU topologies, the setting off, a kernels constraint: no),
one kernel for the data-parallel tables, the hot-row chain paid once per group (search state and predict agree),
the group check after the search, topology files with the kernel constants, and the printed plan and report."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embshard.planner import ParameterConstraints, PlannerSettings, Topology, plan_with_report, predict
from embshard.planner.cost import CostModel, TableStats
from embshard.planner.explain import explain
from embshard.planner.topology import GIB
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import LookupKernel, MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig

SMALL, FBGEMM = LookupKernel.SMALL, LookupKernel.FBGEMM
DP, TW, RW = ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.ROW_WISE
HBM = MemoryTier.HBM
ROWWISE = FusedOptimizerConfig("rowwise_adagrad")


def hetero124(small: int = 100) -> list[TableConfig]:
    tables = [TableConfig(f"big_{i}", 100_000_000, 128, (f"big_{i}",), ids_per_bag=1) for i in range(4)]
    tables += [TableConfig(f"mid_{i}", 5_000_000, 64, (f"mid_{i}",), ids_per_bag=5) for i in range(20)]
    tables += [TableConfig(f"small_{i}", 10_000, 16, (f"small_{i}",), ids_per_bag=30) for i in range(small)]
    return tables


def tiny(n: int, prefix: str = "s", **kw) -> list[TableConfig]:
    return [TableConfig(f"{prefix}{i}", 10_000, 16, (f"{prefix}{i}",), ids_per_bag=30, **kw) for i in range(n)]


def checked(plan: ShardingPlan, report, tables) -> None:
    plan.check(tables)  # includes: every data-parallel table on one kernel
    assert report.search_step_time_s == pytest.approx(report.gpu_step_time_s, rel=1e-9)
    for r in report.ranks:
        assert r.storage.hbm <= r.hbm_budget + 1 and r.storage.ddr <= r.ddr_budget + 1


# ---- where the planner picks it -----------------------------------------------------------------------------------
def test_hetero124_small_tables_take_the_small_kernel_on_h200():
    tables, topo = hetero124(), Topology.preset("h200", 2)
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE)
    checked(plan, report, tables)
    small = [t for t in plan.tables if t.table.startswith("small")]
    assert all(t.kernel is SMALL and t.sharding_type is DP for t in small)
    assert all(t.kernel is FBGEMM for t in plan.tables if not t.table.startswith("small"))
    off, off_report = plan_with_report(tables, topo, 8192, ROWWISE, settings=PlannerSettings(small_table_kernel=False))
    assert all(t.kernel is FBGEMM for t in off.tables) and off_report.step_time_s > 1.2 * report.step_time_s
    # the same placement on FBGEMM, predicted: the kernel is what makes the difference
    fb = ShardingPlan(2, 2, tuple(replace(t, kernel=FBGEMM) for t in plan.tables))
    assert predict(fb, tables, topo, 8192, ROWWISE).step_time_s == pytest.approx(off_report.step_time_s, rel=1e-6)
    text = explain(report, "small_3")
    assert "with kernel small" in text and "data_parallel hbm small" in text and "kernel small for all" in text
    assert "kernel" in str(plan).splitlines()[1] and "kernel" not in str(off).splitlines()[1]
    assert " small " in report.format_tables() and "kernel" not in off_report.format_tables()
    assert [t["kernel"] for t in report.to_dict()["tables"]][-1] == "small"


@pytest.mark.parametrize("device", ["cpu", "h200"])
def test_no_small_kernel_for_large_tables_or_on_cpus(device):
    tables = [TableConfig(f"t{i}", 1_000_000, 128, (f"t{i}",), ids_per_bag=10) for i in range(6)]  # uniform26-like
    tables += tiny(8) if device == "cpu" else []
    topo = Topology.preset(device, 2, ddr_gib=256)
    plan, report = plan_with_report(tables, topo, 512 if device == "cpu" else 8192, ROWWISE)
    checked(plan, report, tables)
    assert all(t.kernel is FBGEMM for t in plan.tables)


def test_fp16_and_constraints_keep_fbgemm_and_a_forced_kernel_is_honoured():
    topo = Topology.preset("h200", 2)
    tables = tiny(6) + tiny(2, "h", data_type="fp16")
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE)
    checked(plan, report, tables)
    # fp16 tables cannot run on it, and data-parallel tables share one kernel: the fp32 ones are data-parallel on
    # the small kernel (cheaper in sum), the fp16 ones table-wise on FBGEMM
    assert {(plan[f"h{i}"].sharding_type, plan[f"h{i}"].kernel) for i in range(2)} == {(TW, FBGEMM)}
    assert {(plan[f"s{i}"].sharding_type, plan[f"s{i}"].kernel) for i in range(6)} == {(DP, SMALL)}
    cons = {"s*": {"kernels": ["fbgemm"]}}
    plan, _ = plan_with_report(tiny(6), topo, 8192, ROWWISE, cons)
    assert {t.kernel for t in plan.tables} == {FBGEMM}
    # forced: a 2M-row table, too large for the size rule, runs on the kernel when asked to
    big = [TableConfig("big", 2_000_000, 64, ("big",), ids_per_bag=4)]
    auto = plan_with_report(big, topo, 8192, ROWWISE)[0]
    forced, report = plan_with_report(big, topo, 8192, ROWWISE, {"big": {"kernels": ["small"]}})
    assert auto["big"].kernel is FBGEMM and forced["big"].kernel is SMALL and forced["big"].tier is HBM
    checked(forced, report, big)
    with pytest.raises(ConfigError, match="table 'h0': kernels: \\[small\\]"):
        plan_with_report(tables, topo, 8192, ROWWISE, {"h0": {"kernels": ["small"]}})
    with pytest.raises(ConfigError, match="kernels=.*choose from \\['fbgemm', 'small'\\]"):
        ParameterConstraints.from_dict({"kernels": ["triton"]})


def test_data_parallel_tables_get_one_kernel():
    """Tiny tables, cheapest data-parallel: all on the small kernel; one constrained to FBGEMM is sharded
    (the others' savings are larger); nine of ten constrained: those are data-parallel on FBGEMM (one lookup serves
    them, the notes say so) and so is the tenth where the step's batch counts come from the device: at the kernel's
    measured H200 speed its table-wise form alone would bring the input exchange and its host sync into a plan that
    has none; with host counts (the training pipeline's, the default) the exchange brings no sync and the tenth goes
    table-wise on the small kernel."""
    topo = Topology.preset("h200", 2)
    tables = tiny(10)
    all_dp, report = plan_with_report(tables, topo, 8192, ROWWISE)
    checked(all_dp, report, tables)
    assert {(t.sharding_type, t.kernel) for t in all_dp.tables} == {(DP, SMALL)}
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE, {"s3": {"kernels": ["fbgemm"]}})
    checked(plan, report, tables)
    assert plan["s3"].sharding_type is not DP and plan["s3"].kernel is FBGEMM
    assert {(t.sharding_type, t.kernel) for t in plan.tables if t.table != "s3"} == {(DP, SMALL)}
    nine = {"s[1-9]": {"kernels": ["fbgemm"]}}
    plan, report = plan_with_report(tables, topo, 8192, ROWWISE, nine, PlannerSettings(batch_counts="device"))
    checked(plan, report, tables)
    assert {(t.sharding_type, t.kernel) for t in plan.tables} == {(DP, FBGEMM)}
    assert any("local search: table_wise hbm small" in n for n in report.table("s0").notes)
    assert any("kernel fbgemm for all of them" in n for n in report.table("s1").notes)
    host, report = plan_with_report(tables, topo, 8192, ROWWISE, nine)
    checked(host, report, tables)
    assert (host["s0"].sharding_type, host["s0"].kernel) == (TW, SMALL)
    assert {(t.sharding_type, t.kernel) for t in host.tables if t.table != "s0"} == {(DP, FBGEMM)}
    bad = ShardingPlan(2, 2, tuple(replace(t, kernel=FBGEMM) if t.table == "s0" else t for t in all_dp.tables))
    with pytest.raises(ConfigError, match="data-parallel tables share one lookup"):
        predict(bad, tables, topo, 8192, ROWWISE)


# ---- the hot-row chain: once per group, and the group check -----------------------------------------------------
def test_hot_tables_take_the_kernel_alone_and_together():
    """Zipf 1.2 ids: the hottest row of a 10k-row table takes ~20% of its ids. The skew-robust backward adds the hot
    row once per bag chunk holding it (embshard/planner/kernel_model.py), so its chain stays shorter than FBGEMM's step for
    the table: alone and in a group of 40 sharing one launch per rank, the tables take the kernel."""
    topo = Topology.preset("h200", 2)
    tw = {"kernels": [], "sharding_types": ["table_wise"], "zipf_alpha": 1.2}
    for n in (1, 40):
        tables = tiny(n)
        plan, report = plan_with_report(tables, topo, 8192, ROWWISE, {"s*": tw})
        checked(plan, report, tables)
        assert {t.kernel for t in plan.tables} == {SMALL}, report.table("s0").notes


def test_the_search_state_pays_the_longest_chain_of_a_group_once():
    from embshard.planner import loads
    from embshard.planner.choices import build_items
    from embshard.planner.constraints import resolve_constraints
    from embshard.planner.state import State

    topo = Topology.preset("h200", 2)
    tables = tiny(3)
    model = CostModel(topo, 8192, ROWWISE)
    cons = resolve_constraints(tables, {"s0": {"zipf_alpha": 1.2}, "s1": {"zipf_alpha": 0.8}}, 2)
    items = build_items(model, tables, cons)
    pick = [next(c for c, ch in enumerate(it.choices) if ch.option.label == "table_wise hbm small") for it in items]
    hot = [float(items[i].choices[pick[i]].hot[0]) for i in range(3)]
    assert hot[0] > hot[1] > hot[2] > 0
    state = State(model, 1e12, 1e12)
    for i in (1, 0, 2):
        state.apply(i, items[i], pick[i], (0,))
    owners = sum(items[i].choices[pick[i]].owner[0] for i in range(3))
    fixed = model.group_fixed(TW, HBM, SMALL) + model.step_fixed() + model.scheme_fixed(TW, False)
    assert state.loads[loads.BWD, 0] == pytest.approx(owners[loads.BWD] + fixed[loads.BWD] + hot[0])
    state.remove(0, items[0])  # the longest chain leaves: the next longest is paid
    rest = owners - items[0].choices[pick[0]].owner[0]
    assert state.loads[loads.BWD, 0] == pytest.approx(rest[loads.BWD] + fixed[loads.BWD] + hot[1])
    plan = ShardingPlan(2, 2, tuple(_tw(t, SMALL) for t in tables))
    report = predict(plan, tables, topo, 8192, ROWWISE, cons)
    own_batch = model.batch_loads(tables)[loads.BWD]
    assert report.loads[loads.BWD, 0] == pytest.approx(owners[loads.BWD] + fixed[loads.BWD] + hot[0] + own_batch)


def _tw(t, kernel, rank=0):
    from embshard.spec.plan import Shard, TablePlan

    return TablePlan(t.name, TW, HBM, (Shard(rank, 0, t.num_embeddings, 0, t.embedding_dim),), kernel=kernel)


# ---- cost terms --------------------------------------------------------------------------------------------------
def _times(model, table, sharding=TW, rows=None, kernel=SMALL, alpha=0.0):
    t = TableStats.one(table)
    rows = float(rows or table.num_embeddings)
    wk = model.work(t, sharding, HBM, rows, float(table.embedding_dim), 0.0, alpha, kernel)
    return float(wk.fwd_s - wk.route_s), float(wk.bwd_s), float(wk.hot_s)


def test_cost_terms_move_the_expected_way():
    m = CostModel(Topology.preset("h200", 2), 8192, ROWWISE)
    base = TableConfig("t", 10_000, 16, ("f",), ids_per_bag=30)
    f0, b0, h0 = _times(m, base)
    for more in (replace(base, ids_per_bag=60), replace(base, embedding_dim=64), replace(base, weighted=True)):
        f, b, _ = _times(m, more)
        assert f > f0 and b > b0
    assert _times(m, base, alpha=1.2)[2] > _times(m, base, alpha=0.8)[2] > h0 > 0
    # collisions make the kernel win: its share of FBGEMM's time falls as ids per row grow
    ratio = []
    for ids in (1, 5, 30):
        t = replace(base, ids_per_bag=ids)
        small, fb = _times(m, t), _times(m, t, kernel=FBGEMM)
        ratio.append((small[0] + small[1]) / (fb[0] + fb[1]))
    assert ratio[0] > ratio[1] > ratio[2] and ratio[2] < 0.5
    # data-parallel: the dense gradient only, the all-reduce and the update stay
    dp = m.work(TableStats.one(base), DP, HBM, 1e4, 16.0, kernel=SMALL)
    dp_fb = m.work(TableStats.one(base), DP, HBM, 1e4, 16.0)
    assert dp.ar_s == dp_fb.ar_s and dp.upd_s == dp_fb.upd_s and dp.bwd_s < dp_fb.bwd_s
    # constants: slower atomics, slower kernel
    slow = CostModel(replace(m.topo, small_atomic_sector_s=3 * m.topo.small_atomic_sector_s), 8192, ROWWISE)
    assert _times(slow, base)[1] > b0 and _times(slow, base)[0] == pytest.approx(f0)
    # launches: fewer per group than FBGEMM's backward; CPUs: FBGEMM's terms
    assert m.group_fixed(TW, HBM, SMALL).sum() < m.group_fixed(TW, HBM).sum()
    cpu = CostModel(Topology.preset("cpu", 2), 256, ROWWISE)
    t = TableStats.one(base)
    assert (
        cpu.work(t, TW, MemoryTier.HOST, 1e4, 16.0, kernel=SMALL).fwd_s
        == cpu.work(t, TW, MemoryTier.HOST, 1e4, 16.0).fwd_s
    )


def test_memory_of_small_kernel_shards():
    m = CostModel(Topology.preset("h200", 2), 8192, ROWWISE)
    t = TableStats.one(TableConfig("t", 10_000, 16, ("f",), ids_per_bag=30))
    small, fb = m.storage(t, TW, HBM, 1e4, 16.0, kernel=SMALL), m.storage(t, TW, HBM, 1e4, 16.0)
    assert small.hbm_weights == fb.hbm_weights and small.hbm_state == fb.hbm_state
    n, bags = m.volumes(t, TW, 1e4)
    # no sort workspace; a persistent fp32 gradient buffer as large as the weights
    assert small.hbm_buffers == pytest.approx(n * 16 + bags * 16 * 4 * 2 + 1e4 * 16 * 4)
    assert small.hbm_buffers < fb.hbm_buffers


def test_own_batch_regroup_is_the_triton_kernel_on_gpus():
    from embshard.planner import loads
    from embshard.planner.kernel_model import regroup_seconds

    topo = Topology.preset("h200", 2)
    m = CostModel(topo, 8192, ROWWISE)
    tables = tiny(4)
    v = m.batch_loads(tables)
    P = 8192 * 4 * 16 * 4.0  # pooled bytes: read once and written once each way
    expect = float(regroup_seconds(2 * P, topo.hbm_bw, topo.kernel_s, topo.kernel_constants)) + 2 * P / topo.hbm_bw
    assert v[loads.BWD] == pytest.approx(expect)
    worse = CostModel(replace(topo, regroup_efficiency=0.4), 8192, ROWWISE).batch_loads(tables)
    assert worse[loads.BWD] > v[loads.BWD] and worse[loads.FWD] - v[loads.FWD] == pytest.approx(
        worse[loads.BWD] - v[loads.BWD]
    )


# ---- topology files ------------------------------------------------------------------------------------------------
def test_topology_files_carry_the_kernel_constants(tmp_path):
    h200 = Topology.preset("h200", 2)
    from embshard.planner.kernel_model import KernelConstants

    h100 = Topology.preset("h100", 2)
    assert h200.kernel_constants != KernelConstants()  # measured (bench/results/2026-11-23-h200), not the estimates
    ratio = h100.small_fwd_id_s / h200.small_fwd_id_s  # H100: the H200's scaled by the copy bandwidth ratio
    assert ratio == pytest.approx(3.9 / 2.8, rel=1e-3)
    for name in ("small_atomic_sector_s", "small_dense_sector_s", "bwd_id_s", "bwd_row_s"):
        assert getattr(h100, name) == pytest.approx(getattr(h200, name) * ratio, rel=1e-3), name
    measured = replace(
        h200, small_fwd_id_s=12e-12, small_atomic_sector_s=5e-12, small_same_row_s=2e-9, regroup_efficiency=0.7
    )
    measured.save(tmp_path / "t.yaml")
    text = (tmp_path / "t.yaml").read_text()
    assert "small_fwd_id_ns: 0.012" in text and "regroup_efficiency: 0.7" in text
    back = Topology.load(tmp_path / "t.yaml")
    k = back.kernel_constants
    assert (k.fwd_id_s, k.atomic_sector_s, k.same_row_s) == pytest.approx((12e-12, 5e-12, 2e-9))
    assert k.regroup_efficiency == 0.7 and k.sorted_id_s == pytest.approx(h200.small_sorted_id_s)
    # a file written before the kernel constants: its preset's
    old = {"world_size": 2, "local_world_size": 2, "device_name": "a100", "hbm_gib": 40, "cost_model": 2}
    a100 = Topology.from_dict(old)
    assert a100.kernel_constants == Topology.preset("a100", 2).kernel_constants
    assert a100.small_fwd_id_s > h200.small_fwd_id_s  # A100: scaled like its other per-id constants
    assert Topology.load("configs/topology/h200x2_calibrated.yaml").kernel_constants == h200.kernel_constants
    with pytest.raises(ConfigError, match="regroup_efficiency=1.5 is invalid"):
        Topology(2, 2, hbm_bytes=GIB, regroup_efficiency=1.5)
    with pytest.raises(ConfigError, match="small_same_row_s=-1e-09 is invalid"):
        Topology(2, 2, hbm_bytes=GIB, small_same_row_s=-1e-9)


def test_settings_and_constraints_fields():
    assert PlannerSettings().small_table_kernel is True
    with pytest.raises(ConfigError, match="small_table_kernel='no' is invalid"):
        PlannerSettings(small_table_kernel="no")
    c = ParameterConstraints.from_dict({"kernels": ["fbgemm"]})
    assert c.kernels == (FBGEMM,) and c.to_dict() == {"kernels": ["fbgemm"]}
    assert np.isfinite(CostModel(Topology.preset("h100", 2), 64, ROWWISE).group_fixed(DP, HBM, SMALL)).all()
