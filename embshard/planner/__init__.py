"""The planner: places embedding tables on ranks (sharding type x memory tier x ranks) to minimise the predicted
step time within each rank's memory, and explains its choices. Output: an embshard.spec.plan.ShardingPlan.

    from embshard.planner import Topology, explain, plan_with_report
    topo = Topology.preset("h200", world_size=2)        # or Topology.detect() / Topology.load("topology.yaml")
    plan, report = plan_with_report(tables, topo, batch_size=8192, optimizer=opt)
    print(report)                                       # plan, per-table and per-rank tables, step time
    print(explain(report, "t_big"))                     # why this table went where it did

docs/planner.md describes the model, its constants and how to read a plan.
"""

from embshard.planner.constraints import ParameterConstraints
from embshard.planner.errors import PlanningError
from embshard.planner.explain import explain
from embshard.planner.predict import predict
from embshard.planner.report import PlanReport
from embshard.planner.search import plan_sharding, plan_with_report
from embshard.planner.settings import PlannerSettings
from embshard.planner.simple import simple_plan
from embshard.planner.topology import Topology

__all__ = [
    "ParameterConstraints",
    "PlanReport",
    "PlannerSettings",
    "PlanningError",
    "Topology",
    "explain",
    "plan_sharding",
    "plan_with_report",
    "predict",
    "simple_plan",
]
