"""2D settings: the plan's fields (checked, serialized, printed) and the training config's `sharding:` section; bad
values name the field, the value and the fix. No processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from embshard import TableConfig, simple_plan
from embshard.config import load_config
from embshard.spec.plan import ReplicaSync, ShardingPlan
from embshard.spec.tables import ConfigError
from embshard.training.train import twod_local_world

TABLES = [
    TableConfig("a", 30, 8, ("fa",)),
    TableConfig("b", 20, 8, ("fb",)),
    TableConfig("c", 12, 8, ("fc",)),
]
TYPES = {"a": "row_wise", "b": "table_row_wise", "c": "data_parallel"}


def twod(**kw) -> ShardingPlan:
    group = simple_plan(TABLES, 2, 2, TYPES)
    return replace(group, **{"world_size": 8, "local_world_size": 2, "sharding_group_size": 2, **kw})


def test_plan_round_trip_and_printing(tmp_path):
    plan = twod(replica_sync="periodic", replica_sync_every=5)
    plan.check(TABLES)
    assert (plan.group_size, plan.num_replicas, plan.replica_sync) == (2, 4, ReplicaSync.PERIODIC)
    assert plan.group_plan().world_size == 2 and plan.group_plan().sharding_group_size is None
    for suffix in ("yaml", "json"):
        plan.save(tmp_path / f"p.{suffix}")
        assert ShardingPlan.load(tmp_path / f"p.{suffix}") == plan
    head = str(plan).splitlines()[0]
    assert "sharding_group_size=2 (4 replicas" in head and "replica_sync=periodic every 5 steps" in head
    flat = simple_plan(TABLES, 2, 2, TYPES)
    assert "sharding_group_size" not in flat.to_dict() and "sharding_group_size" not in str(flat)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"sharding_group_size": 3}, ["sharding_group_size=3", "divide world_size=8", "[1, 2, 4, 8]"]),
        ({"sharding_group_size": 0}, ["sharding_group_size=0"]),
        ({"replica_sync": "sometimes"}, ["replica_sync='sometimes'", "exact", "periodic"]),
        ({"replica_sync_every": 0}, ["replica_sync_every=0", ">= 1"]),
    ],
)
def test_bad_plan_fields_name_field_and_fix(kw, words):
    with pytest.raises(ConfigError) as e:
        twod(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_group_ranks_are_checked():
    plan = twod()
    table = replace(plan["a"], shards=tuple(replace(s, rank=s.rank + 2) for s in plan["a"].shards))
    bad = replace(plan, tables=(table, plan["b"], plan["c"]))
    with pytest.raises(ConfigError, match="outside 0..1"):
        bad.check(TABLES)
    data = plan.to_dict()
    data["tables"][0]["shards"][0]["rank"] = 5
    with pytest.raises(ConfigError, match=r"p.yaml.*shards\[0\].rank=5.*within a sharding group are 0..1"):
        ShardingPlan.from_dict(data, "p.yaml")
    with pytest.raises(ConfigError, match="multiple or a divisor of 4"):
        replace(simple_plan(TABLES, 3, 3, TYPES), world_size=12, local_world_size=4, sharding_group_size=3)


def test_train_config_sharding_section():
    cfg = load_config("configs/dlrm_synthetic.yaml", ["sharding.group_size=2", "sharding.replica_sync=periodic"])
    assert (cfg.sharding.group_size, cfg.sharding.replica_sync, cfg.sharding.replica_sync_every) == (2, "periodic", 1)
    assert load_config("configs/dlrm_synthetic.yaml", []).sharding.group_size is None
    with pytest.raises(ConfigError, match="grup_size"):
        load_config("configs/dlrm_synthetic.yaml", ["sharding.grup_size=2"])
    with pytest.raises(ConfigError, match="sharding.replica_sync"):
        load_config("configs/dlrm_synthetic.yaml", ["sharding.replica_sync=often"])
    with pytest.raises(ConfigError, match="sharding.replica_sync_every"):
        load_config("configs/dlrm_synthetic.yaml", ["sharding.replica_sync_every=0"])
    assert twod_local_world(8, 16, 8) == 8 and twod_local_world(2, 16, 8) == 2 and twod_local_world(16, 16, 8) == 8
    with pytest.raises(ConfigError, match="sharding.group_size=3 does not fit this job of 16 ranks"):
        twod_local_world(3, 16, 8)
