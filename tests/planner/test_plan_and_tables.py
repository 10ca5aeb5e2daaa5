"""TableConfig validation, the plan's checks, printing and YAML/JSON round trip, and the simple placement."""

from __future__ import annotations

import pytest

from embshard import ConfigError, MemoryTier, ShardingPlan, ShardingType, TableConfig, simple_plan
from embshard.spec.plan import Shard, TablePlan

TABLES = [
    TableConfig("a", 1000, 16, ("fa",)),
    TableConfig("b", 10, 8, ("fb1", "fb2")),
    TableConfig("c", 500, 32, ("fc",), pooling="mean"),
    TableConfig("d", 77, 12, ("fd",), weighted=True),
]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_embeddings=0), r"table 't': num_embeddings=0 is invalid: it must be a positive integer"),
        (dict(embedding_dim=-4), r"embedding_dim=-4 is invalid"),
        (dict(feature_names="f"), r"feature_names='f' is invalid: give a list"),
        (dict(feature_names=()), r"at least one feature"),
        (dict(feature_names=("f", "f")), r"must not repeat"),
        (dict(pooling="max"), r"pooling='max' is invalid: choose one of \['sum', 'mean', 'none'\]"),
        (dict(data_type="int8"), r"data_type='int8' is invalid"),
        (dict(ids_per_bag=-1), r"ids_per_bag=-1 is invalid"),
    ],
)
def test_table_config_errors_name_table_field_and_value(kwargs, message):
    args = dict(name="t", num_embeddings=10, embedding_dim=4, feature_names=("f",)) | kwargs
    with pytest.raises(ConfigError, match=message):
        TableConfig(**args)


def test_feature_in_two_tables_is_rejected():
    with pytest.raises(ConfigError, match=r"feature 'x' is listed by tables 'a' and 'b'"):
        simple_plan([TableConfig("a", 4, 4, ("x",)), TableConfig("b", 4, 4, ("x",))], 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_simple_plan_balances_bytes_and_round_trips(tmp_path, world_size):
    plan = simple_plan(TABLES, world_size)
    plan.check(TABLES)
    # Largest table first onto the least-loaded rank: the two largest tables never share a rank when ws > 1.
    if world_size > 1:
        assert plan["a"].ranks != plan["c"].ranks
    for suffix in ("yaml", "json"):
        path = tmp_path / f"plan.{suffix}"
        plan.save(path)
        assert ShardingPlan.load(path) == plan
    text = str(plan)
    assert f"world_size={world_size}" in text and "table_wise" in text and "fb1" not in text


@pytest.mark.parametrize("st", list(ShardingType))
def test_simple_plan_produces_every_type(st):
    plan = simple_plan(TABLES, 4, local_world_size=2, sharding_types={"a": st, "c": st})
    plan.check(TABLES)
    assert plan["a"].sharding_type is st


def test_simple_plan_takes_the_first_of_each_constraint():
    cons = {"a": {"ranks": [1]}, "c": {"sharding_types": ["row_wise", "table_wise"], "tiers": ["uvm", "hbm"]}}
    plan = simple_plan(TABLES, 2, constraints=cons)
    assert plan["a"].sharding_type is ShardingType.TABLE_WISE and plan["a"].ranks == [1]
    assert plan["c"].sharding_type is ShardingType.ROW_WISE and plan["c"].tier is MemoryTier.UVM
    assert plan["b"].tier is MemoryTier.HOST
    # the pinned table's bytes count on its rank: the next largest table-wise table goes to the other one
    assert simple_plan(TABLES, 2, constraints={"a": {"ranks": [1]}})["c"].ranks == [0]
    with pytest.raises(ConfigError, match=r"constraints of table 'c': ranks \[1\] pin a row_wise table"):
        simple_plan(TABLES, 2, constraints={"c": {"sharding_types": ["row_wise"], "ranks": [1]}})


def test_plan_checks_name_the_table_and_rule():
    good = simple_plan(TABLES, 2)
    bad_rank = TablePlan("a", "table_wise", "host", (Shard(5, 0, 1000, 0, 16),))
    with pytest.raises(ConfigError, match=r"table 'a' \(table_wise\): shard rank 5 is outside 0..1"):
        ShardingPlan(2, 2, (bad_rank, *good.tables[1:])).check(TABLES)
    gap = TablePlan("a", "row_wise", "host", (Shard(0, 0, 400, 0, 16), Shard(1, 500, 500, 0, 16)))
    with pytest.raises(ConfigError, match=r"rows blocks .* leave a gap or overlap at 400"):
        ShardingPlan(2, 2, (gap, *good.tables[1:])).check(TABLES)
    with pytest.raises(ConfigError, match=r"missing from plan \['a'\]"):
        ShardingPlan(2, 2, good.tables[1:]).check(TABLES)
    with pytest.raises(ConfigError, match="world_size a multiple of local_world_size"):
        ShardingPlan(3, 2, good.tables)
    with pytest.raises(ConfigError, match="not a valid embshard plan"):
        ShardingPlan.from_dict({"world_size": 2})


def test_gpu_tier_on_cpu_is_a_clear_error():
    import torch

    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    plan = simple_plan(TABLES, 1, tier=MemoryTier.HBM)
    with pytest.raises(ConfigError, match=r"memory tier 'hbm' needs a GPU.*plan with tier 'host'"):
        ShardedEmbeddingBagCollection(TABLES, plan, device=torch.device("cpu"))


def test_out_of_range_id_names_feature_table_and_value():
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables = [TableConfig("a", 10, 4, ("fa",)), TableConfig("b", 5, 4, ("fb",))]
    ebc = ShardedEmbeddingBagCollection(tables, simple_plan(tables, 1), device="cpu")
    for bad in (5, -1):
        kjt = KeyedJaggedTensor(
            keys=["fa", "fb"],
            values=torch.tensor([1, 9, 2, bad]),
            lengths=torch.tensor([2, 0, 1, 1], dtype=torch.int32),
        )
        with pytest.raises(ValueError, match=rf"feature 'fb': id {bad} is outside table 'b' \(rows 0..4\)"):
            ebc(kjt)
    with pytest.raises(ConfigError, match=r"missing \['fb'\]"):
        ebc(KeyedJaggedTensor(keys=["fa"], values=torch.tensor([1]), lengths=torch.tensor([1], dtype=torch.int32)))


def test_lookup_kernel_in_the_plan(tmp_path):
    """TablePlan.kernel round-trips, defaults to fbgemm for older plan files, and is refused where it cannot run."""
    from dataclasses import replace

    import pytest

    from embshard import simple_plan
    from embshard.spec.plan import LookupKernel, ShardingPlan

    tables = [
        TableConfig("a", 50, 8, ("fa",)),
        TableConfig("b", 60, 8, ("fb",)),
        TableConfig("h", 60, 8, ("fh",), data_type="fp16"),
    ]
    plan = simple_plan(tables, 2, sharding_types={"a": "data_parallel", "b": "data_parallel"}, tier="hbm")
    small = replace(plan, tables=tuple(replace(t, kernel="small") if t.table != "h" else t for t in plan.tables))
    small.check(tables)
    small.save(tmp_path / "p.yaml")
    loaded = ShardingPlan.load(tmp_path / "p.yaml")
    assert loaded == small and loaded["a"].kernel is LookupKernel.SMALL and loaded["h"].kernel is LookupKernel.FBGEMM
    data = small.to_dict()
    for t in data["tables"]:
        del t["kernel"]  # a plan file written before the field existed
    assert all(t.kernel is LookupKernel.FBGEMM for t in ShardingPlan.from_dict(data).tables)
    with pytest.raises(ConfigError, match=r"table 'h'.*kernel 'small' takes fp32 tables in tier hbm or host, not fp16"):
        replace(plan, tables=tuple(replace(t, kernel="small") for t in plan.tables)).check(tables)
    mixed = replace(plan, tables=tuple(replace(t, kernel="small") if t.table == "a" else t for t in plan.tables))
    with pytest.raises(ConfigError, match=r"data-parallel tables share one lookup.*'a': 'small', 'b': 'fbgemm'"):
        mixed.check(tables)
    with pytest.raises(ConfigError, match="kernel='cuda' is invalid"):
        replace(plan.tables[0], kernel="cuda")


def test_tables_are_checked_once_per_planning_trip(monkeypatch, capsys):
    """validate_tables returns Tables, which the planner, the plan's checks and the config take as they are: one
    `embshard plan` of a planner input or a training config, and one plan_for_job, check the tables once."""
    import copy
    import pickle

    import paths

    from embshard.config import PlannerConfig
    from embshard.planner.policy import plan_for_job
    from embshard.spec import tables as spec_tables
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.tools.plan import main

    checked: list[int] = []
    check = spec_tables.check_tables
    monkeypatch.setattr(spec_tables, "check_tables", lambda tables: checked.append(len(tables)) or check(tables))
    for config, n in (("configs/planner/uniform26.yaml", 26), ("configs/dlrm_criteo.yaml", 26)):
        main([str(paths.ROOT / config), "--world-size", "4", "--local-world-size", "2", "--device", "h100"])
        assert "predicted step time" in capsys.readouterr().out
        assert checked == [n], config
        checked.clear()
    plan = plan_for_job(TABLES, PlannerConfig(), 2, 2, "cpu", 64, FusedOptimizerConfig())
    assert {t.table for t in plan.tables} == {t.name for t in TABLES}
    assert checked == [len(TABLES)]
    # Tables: only validate_tables makes them; copies and pickles are checked again, Tables(items) is a plain tuple
    tables = spec_tables.validate_tables(TABLES)
    assert isinstance(tables, spec_tables.Tables) and list(tables) == TABLES
    assert spec_tables.validate_tables(tables) is tables
    assert isinstance(copy.deepcopy(tables), spec_tables.Tables) and pickle.loads(pickle.dumps(tables)) == tables
    assert type(spec_tables.Tables(TABLES)) is tuple
    with pytest.raises(ConfigError, match="table name 'a' appears twice"):
        spec_tables.validate_tables([*TABLES, TABLES[0]])
