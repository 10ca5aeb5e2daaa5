"""The planner's plans for fixed workloads on a pinned machine stay what they were: the search's speed-ups must
not change a plan (a cost-model change that does must update tests/planner/data/plans.json and say why the new
plans are better). The plans are searched and priced with device batch counts (PlannerSettings.batch_counts
device: the step's host sync charged), as the expectations were made; host counts take the pinned host_sync_s off
every step (test_planner_search.py). Also: bench/planner_scale.py's generated models fit their GPUs at every size
it is run at.

Regenerate the expectations (only for an intended change):  python tests/planner/test_planner_plans.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from embshard.planner import PlannerSettings, Topology, plan_with_report
from embshard.tools.plan_inputs import load_planner_input

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DATA = HERE / "data" / "plans.json"
# (case, planner input or generated model, world size, ranks per host, GPU GiB per rank or None)
CASES = [
    ("hetero124", "hetero124", 2, 2, None),
    ("uniform26", "uniform26", 2, 2, None),
    ("overflow@16GiB", "overflow", 2, 2, 16.0),
    ("constrained", "constrained", 8, 8, None),
    ("hetero124-16", "hetero124", 16, 8, None),
    ("mixed120-16", "mixed:120", 16, 8, None),
    ("mixed300-64", "mixed:300", 64, 8, None),
]


def planner_scale():
    """bench/planner_scale.py as a module (its generator of mixed models)."""
    spec = importlib.util.spec_from_file_location("planner_scale", ROOT / "bench" / "planner_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(source: str, world: int, local: int, hbm_gib: float | None, pinned: dict):
    """(plan, report) of one case on the pinned machine."""
    topo = Topology.from_dict(pinned).with_sizes(world, local, hbm_gib=hbm_gib)
    if source.startswith("mixed:"):
        bench = planner_scale()
        n = int(source.split(":")[1])
        device = PlannerSettings(batch_counts="device")
        return plan_with_report(bench.mixed_tables(n, world_size=world), topo, bench.batch_size(n), settings=device)
    inp = load_planner_input(ROOT / "configs" / "planner" / f"{source}.yaml")
    settings = replace(inp.settings, batch_counts="device")
    return plan_with_report(inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings)


def summary(plan) -> list[str]:
    """One line per table: sharding, tier, kernel, ranks (and the cache size for UVM-caching)."""
    out = []
    for tp in plan.tables:
        ranks = ",".join(str(r) for r in tp.ranks)
        clf = f"({tp.cache_load_factor:g})" if tp.tier.value == "uvm_caching" else ""
        out.append(f"{tp.table} {tp.sharding_type.value} {tp.tier.value}{clf} {tp.kernel.value} {ranks}")
    return out


def expected() -> dict:
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_plans_unchanged(case):
    data = expected()
    _, source, world, local, hbm = next(c for c in CASES if c[0] == case)
    plan, report = run_case(source, world, local, hbm, data["topology"])
    want = data["cases"][case]
    got = summary(plan)
    diff = [f"{w} -> {g}" for w, g in zip(want["plan"], got) if w != g]
    assert not diff and len(got) == len(want["plan"]), f"{case}: plan changed:\n" + "\n".join(diff[:20])
    assert report.step_time_s * 1e3 == pytest.approx(want["step_ms"], rel=1e-9)


@pytest.mark.parametrize(("tables", "world"), [(1000, 64), (5000, 512), (10000, 512)])
def test_generated_models_fit(tables, world):
    """The memory the generated model needs at least (every table in its least-GPU-memory option, with the step's
    buffers) is within what the GPUs offer, the check the planner makes before placing (the full plan takes a few
    seconds: bench/planner_scale.py)."""
    from embshard.planner.choices import build_choices
    from embshard.planner.constraints import resolve_constraints
    from embshard.planner.cost import CostModel
    from embshard.planner.predict import budgets
    from embshard.planner.problem import Problem
    from embshard.planner.search import _cheapest, _fit_totals
    from embshard.spec.optim import FusedOptimizerConfig

    bench = planner_scale()
    model_tables = bench.mixed_tables(tables, world_size=world)
    topo = Topology.preset("h100", world, 8)
    model = CostModel(topo, bench.batch_size(tables), FusedOptimizerConfig())
    items, table = build_choices(model, model_tables, resolve_constraints(model_tables, None, world))
    p = Problem(model, model_tables, budgets(model, model_tables), items, table)
    p.notes = {t.name: [] for t in model_tables}
    _cheapest(p)
    _fit_totals(p)  # raises PlanningError when the totals cannot fit


def regenerate() -> None:
    """Write tests/planner/data/plans.json from the planner as it is now (topology pinned from the file if it
    exists, else the h100 preset of now)."""
    pinned = expected()["topology"] if DATA.exists() else Topology.preset("h100", 1).to_dict()
    pinned = {**pinned, "device_name": "pinned-h100", "source": "pinned for tests"}
    cases = {}
    for name, source, world, local, hbm in CASES:
        plan, report = run_case(source, world, local, hbm, pinned)
        cases[name] = {"step_ms": report.step_time_s * 1e3, "plan": summary(plan)}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({"topology": pinned, "cases": cases}, indent=1) + "\n")
    print(f"wrote {DATA}", file=sys.stderr)


if __name__ == "__main__":
    regenerate()
