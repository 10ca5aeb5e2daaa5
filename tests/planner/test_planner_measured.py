"""The cost model against embshard's measured embedding steps: every case of data/measured_steps.json (GPU model,
workload, static or raw ids, batch counts from the device or the host, the plan it ran, the measured ms/step and the
logs they come from) is predicted with its GPU model's preset within the file's tolerance (10%) of the median of its
measured steps. A change to the
model or to a preset that breaks the fit fails here; new measurements go into the JSON file with their source
log."""

from __future__ import annotations

from pathlib import Path

import pytest

from embshard.planner.measured import load_cases

DATA = Path(__file__).parent / "data" / "measured_steps.json"
CASES, TOLERANCE = load_cases(DATA)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.gpu}-{c.workload}-{c.ids}-{c.counts}-{c.step}" for c in CASES])
def test_prediction_within_tolerance_of_the_measured_median(case):
    predicted = case.report().step_time_s * 1e3
    measured = case.median_ms
    assert predicted == pytest.approx(measured, rel=TOLERANCE), (
        f"{case.world} x {case.gpu} {case.label}: predicted {predicted:.2f} ms/step, measured median {measured:.2f} "
        f"({predicted / measured - 1:+.1%}; the rule: within {TOLERANCE:.0%}); sources: {'; '.join(case.sources)}"
    )


def test_the_cases_cover_both_gpu_models_and_the_three_workloads():
    """Every bench/embshard_dmp.py workload is measured with static ids and device counts on every GPU model with a
    preset file, once each; raw-id cases (ids: raw) and eager host-count cases (counts: host; the plans the planner
    made for them, which may differ from the device-count case's) are extra, each beside the static device-count
    case of its GPU model and workload (the MLPerf tables: host counts only); the step as one CUDA graph replay (step: graph) is
    measured on the H100 for the three workloads and the MLPerf tables, with the plans the planner makes for the
    graph; and each case's plan is the kind the logs describe (table-wise, data-parallel, UVM and UVM-caching
    tables as they ran)."""
    from embshard.planner.presets import GPU_FILES

    static = [(c.gpu, c.workload) for c in CASES if c.ids == "static" and c.counts == "device"]
    assert sorted(static) == sorted((g, w) for g in GPU_FILES for w in ("uniform26", "hetero124", "overflow"))
    graphed = [c for c in CASES if c.step == "graph"]
    assert sorted(c.workload for c in graphed if c.gpu == "h100") == ["hetero124", "mlperf", "overflow", "uniform26"]
    for c in graphed:  # the planner's plans for the graph: table-wise and data-parallel tables, no UVM caching
        assert c.counts == "host" and c.ids == "static", c
        assert {t.sharding_type.value for t in c.plan.tables} <= {"table_wise", "data_parallel"}, c
        assert all(t.tier.value in ("hbm", "uvm") for t in c.plan.tables), c
    assert any(t.tier.value == "uvm" for c in graphed for t in c.plan.tables), "UVM's link costs are pinned"
    host = [c for c in CASES if c.counts == "host" and c.step == "eager"]
    assert host, "the host-count step (the training pipeline's, no host_sync_s) is pinned by a measured case"
    assert all(c.counts in ("device", "host") for c in CASES)
    for c in host:  # the MLPerf tables are measured eager with host counts only (the training pipeline's way)
        assert (c.gpu, c.workload) in static or c.workload == "mlperf", c
    raw = [c for c in CASES if c.ids != "static"]
    assert raw, "the raw-id tables' cost (cost.RAW_*) is pinned by at least one measured raw-id case"
    for c in raw:
        assert c.ids == "raw" and (c.gpu, c.workload) in static, c
        assert all(t.raw_ids and t.eviction.value == c.eviction for t in c.tables), c
        assert {(t.sharding_type.value, t.tier.value) for t in c.plan.tables} == {("table_wise", "hbm")}, c
    for c in CASES:
        assert all(not t.raw_ids for t in c.tables) or c.ids == "raw", c
        kinds = {(t.sharding_type.value, t.tier.value, t.kernel.value) for t in c.plan.tables}
        assert all(c.sources) and len(c.measured_ms) >= 1
        if c.workload == "overflow" and c.step == "eager":  # the planner's eager plans: 5 UVM-caching, later 4 UVM
            tiers = [t.tier.value for t in c.plan.tables]
            assert tiers.count("uvm_caching") == 5 or tiers.count("uvm") == 4, c
        if c.workload == "hetero124":  # the 100 tiny tables data-parallel, or table-wise on the small-table kernel
            tiny = [t for t in c.plan.tables if t.table in {f"t{i}" for i in range(24, 124)}]
            assert all(t.sharding_type.value == "data_parallel" or t.kernel.value == "small" for t in tiny), kinds


def test_the_presets_are_the_fit_of_the_measured_steps():
    """bench/planner_predict.py --measured --fit: refitting the per-bag cost of the GPU models without a host floor
    (the H200) to their cases, the device sync's cost as the presets have it, gives back the preset's value (so the
    presets are that fit, not hand-tuned per workload)."""
    from embshard.planner.measured import fit_host_and_bag
    from embshard.planner.topology import Topology

    sync, bags, lines = fit_host_and_bag(CASES)
    assert sorted(bags) == ["h200"]  # the H100's preset prices its host's floor instead (batch_bag 0)
    assert len(lines) == sum(c.gpu == "h200" and c.ids == "static" and c.counts == "device" for c in CASES) + 1
    for gpu, bag in bags.items():
        topo = Topology.preset(gpu, 2)
        assert topo.host_sync_s == sync
        assert topo.batch_bag_s == pytest.approx(bag, rel=0.02), gpu


def test_host_counts_pay_no_host_sync():
    """A host-count case is predicted as its plan with device counts less the preset's host_sync_s (the one device
    sync a step the training pipeline's host counts avoid), and every other term the same."""
    from dataclasses import replace

    for c in (c for c in CASES if c.counts == "host" and c.step == "eager"):
        host, device = c.report(), replace(c, counts="device").report()
        sync = host.topology.host_sync_s
        assert sync > 0 and device.step_time_s - host.step_time_s == pytest.approx(sync, rel=1e-6), c.label


def test_the_raw_id_constant_is_the_fit_of_the_raw_cases():
    """bench/planner_predict.py --measured --fit: refitting the remap's cost per id (cost.RAW_ID_BYTES) to the raw-id
    cases, the static constants as they are, gives back its value; and the breakdown adds up to the prediction,
    with the static tables' step as the same plan with static ids predicts it and the remap's launches paid once
    per lookup group (RAW_KERNELS), not per table."""
    from dataclasses import replace

    from embshard.planner import cost
    from embshard.planner.measured import fit_raw_id_bytes, raw_breakdown

    fitted, lines = fit_raw_id_bytes(CASES)
    assert cost.RAW_ID_BYTES == pytest.approx(fitted, rel=0.02)
    assert len(lines) == sum(c.ids == "raw" for c in CASES) + 1
    for c in (c for c in CASES if c.ids == "raw"):
        static = replace(c, tables=tuple(replace(t, ids="index") for t in c.tables), ids="static")
        predicted, plain = c.report().step_time_s, static.report().gpu_step_time_s
        (line,) = raw_breakdown(c)
        assert f"predicted {predicted * 1e3:.2f} ms = static tables {plain * 1e3:.2f}" in line, line
        groups = {(tp.sharding_type, tp.tier, tp.kernel) for tp in c.plan.tables}
        launches = len(groups) * cost.RAW_KERNELS * c.report().topology.kernel_s
        assert f"launches {launches * 1e3:.2f}" in line, line
        tables_per_rank = len(c.plan.tables) / c.world
        assert launches < tables_per_rank * cost.RAW_KERNELS * c.report().topology.kernel_s / 2


def test_the_host_floor_is_the_fit_of_the_eager_steps():
    """bench/planner_predict.py --measured --fit: refitting the host's time to issue an eager step (host_step_s,
    host_group_s, host_dp_group_s) to the H100's eager cases gives back the preset's values; the H200's preset does
    not price the host (its hosts not measured), and a graphed case's host time is 0."""
    from embshard.planner.measured import fit_host_floor
    from embshard.planner.topology import Topology

    fit, lines = fit_host_floor(CASES, "h100")
    topo = Topology.preset("h100", 2)
    for name, value in fit.items():
        assert getattr(topo, name) == pytest.approx(value, abs=60e-6), name
    assert len(lines) == 1 + sum(c.gpu == "h100" and c.ids == "static" and c.step == "eager" for c in CASES)
    h200 = Topology.preset("h200", 2)
    assert h200.host_step_s == h200.host_group_s == h200.host_dp_group_s == 0
    for c in CASES:
        r = c.report()
        assert r.step_time_s == pytest.approx(max(r.gpu_step_time_s, r.host_step_time_s), rel=1e-12)
        if c.step == "graph" or c.gpu == "h200":
            assert r.host_step_time_s == 0, c.label
    mlperf = next(c for c in CASES if c.workload == "mlperf" and c.step == "eager")
    r = mlperf.report()
    assert r.host_step_time_s > 1.5 * r.gpu_step_time_s  # its 11 data-parallel tables: the host sets this step
