"""The search's shortcuts give the plans of the search without them: a block's best rank read from a lower bound
first (planner/rank_pick.py) against every rank evaluated, and the local search's floor against no floor, on
fresh random models over one and several hosts, to the last bit of the predicted step times."""

from __future__ import annotations

import random

import pytest

from embshard.planner import Topology, plan_with_report, rank_pick
from embshard.planner.state import State
from embshard.spec.tables import TableConfig


def random_tables(n: int, seed: int) -> list[TableConfig]:
    """n tables: a few large ones (over a GPU's share, so some go to host memory), the rest small and hot."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.15:
            rows, dim, ids = rng.randint(20_000_000, 80_000_000), rng.choice([64, 128]), rng.choice([1, 5])
        else:
            rows, dim, ids = rng.randint(100, 200_000), rng.choice([8, 16, 32, 64]), rng.choice([1, 10, 30])
        out.append(TableConfig(f"t{i}", rows, dim, (f"f{i}",), ids_per_bag=ids))
    return out


def plan_numbers(tables: list[TableConfig], topo: Topology) -> tuple:
    plan, report = plan_with_report(tables, topo, 2048)
    return repr(plan), repr(report.step_time_s), repr(report.search_step_time_s)


@pytest.mark.parametrize("world,local", [(8, 8), (16, 8), (160, 8)])
def test_shortcuts_give_the_plans_of_the_full_search(world: int, local: int, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = random_tables(40, seed=random.randrange(1 << 30))
    topo = Topology.preset("h100", world, local)
    fast = plan_numbers(tables, topo)
    calls = []
    real_step = rank_pick.column_step

    def counted(column, phase_add):  # noqa: ANN001, ANN202
        calls.append(1)
        return real_step(column, phase_add)

    monkeypatch.setattr(rank_pick, "column_step", counted)
    assert plan_numbers(tables, topo) == fast and calls  # the shortcut ran
    # every rank evaluated: the bound's rank never meets its bound
    monkeypatch.setattr(rank_pick, "column_step", lambda column, phase_add: float("nan"))
    monkeypatch.setattr(State, "floor", lambda self, item, ch: 0.0)  # and no option skipped by the floor
    assert plan_numbers(tables, topo) == fast
