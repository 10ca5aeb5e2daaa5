"""The cost model against embshard's measured embedding steps: every case of data/measured_steps.json (GPU model,
workload, the plan it ran, the measured ms/step and the logs they come from) is predicted with its GPU model's
preset within the file's tolerance (10%) of the median of its measured steps. A change to the model or to a
preset that breaks the fit fails here; new measurements go into the JSON file with their source log."""

from __future__ import annotations

from pathlib import Path

import pytest

from embshard.planner.tools.measured import load_cases

DATA = Path(__file__).parent / "data" / "measured_steps.json"
CASES, TOLERANCE = load_cases(DATA)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.gpu}-{c.workload}" for c in CASES])
def test_prediction_within_tolerance_of_the_measured_median(case):
    predicted = case.report().step_time_s * 1e3
    measured = case.median_ms
    assert predicted == pytest.approx(measured, rel=TOLERANCE), (
        f"2 x {case.gpu} {case.workload}: predicted {predicted:.2f} ms/step, measured median {measured:.2f} "
        f"({predicted / measured - 1:+.1%}; the rule: within {TOLERANCE:.0%}); sources: {'; '.join(case.sources)}"
    )


def test_the_cases_cover_both_gpu_models_and_the_three_workloads():
    """Every bench/embshard_dmp.py workload is measured on every GPU model with a preset file, and each case's plan
    is the kind the logs describe (table-wise, data-parallel and UVM-caching tables as they ran)."""
    from embshard.planner.topology import GPU_FILES

    assert {(c.gpu, c.workload) for c in CASES} == {
        (g, w) for g in GPU_FILES for w in ("uniform26", "hetero124", "overflow")
    }
    for c in CASES:
        kinds = {(t.sharding_type.value, t.tier.value, t.kernel.value) for t in c.plan.tables}
        assert all(c.sources) and len(c.measured_ms) >= 1
        if c.workload == "overflow":
            assert sum(t.tier.value == "uvm_caching" for t in c.plan.tables) == 5, c
        if c.workload == "hetero124":
            assert sum(t.sharding_type.value == "data_parallel" for t in c.plan.tables) == 100, kinds


def test_the_presets_are_the_fit_of_the_measured_steps():
    """bench/planner_predict.py --measured --fit: refitting the shared host cost and the per-bag cost to the cases
    gives back the presets' values (so the presets are that fit, not hand-tuned per workload)."""
    from embshard.planner.tools.measured import fit_host_and_bag
    from embshard.planner.topology import Topology

    sync, bags, lines = fit_host_and_bag(CASES)
    assert len(lines) == len(CASES) + 1
    for gpu, bag in bags.items():
        topo = Topology.preset(gpu, 2)
        assert topo.host_sync_s == pytest.approx(sync, rel=0.02), gpu
        assert topo.batch_bag_s == pytest.approx(bag, rel=0.02), gpu
