"""Planner building blocks: topology, constraints, planner-input parsing, the storage and cost model."""

from __future__ import annotations

import numpy as np
import pytest

from embshard.optim import FusedOptimizerConfig
from embshard.plan import MemoryTier, ShardingType
from embshard.planner import ParameterConstraints, PlannerSettings, Topology
from embshard.planner.constraints import resolve_constraints
from embshard.planner.cost import CostModel, TableStats, zipf_hit_rate
from embshard.planner.inputs import planner_input_from_dict
from embshard.planner.options import Option, column_splits, make_shards, row_splits, table_options
from embshard.planner.topology import GIB
from embshard.tables import ConfigError, TableConfig

HBM, UVM, CACHE = MemoryTier.HBM, MemoryTier.UVM, MemoryTier.UVM_CACHING
TW = ShardingType.TABLE_WISE


def model(optimizer: str = "adam", world: int = 2, device: str = "h200", batch: int = 1024) -> CostModel:
    return CostModel(Topology.preset(device, world), batch, FusedOptimizerConfig(optimizer))


# ---- storage ----------------------------------------------------------------------------------------------------
def test_adam_state_is_counted_twice_the_weights():
    t = TableStats.one(TableConfig("t", 1000, 64, ("f",)))
    mem = model("adam").storage(t, TW, HBM, 1000.0, 64.0)
    assert mem.hbm_weights == 1000 * 64 * 4
    assert mem.hbm_state == 2 * mem.hbm_weights  # two fp32 moments per element
    assert mem.hbm == mem.hbm_weights + mem.hbm_state + mem.hbm_buffers and mem.ddr == 0


@pytest.mark.parametrize(
    "opt,state_per_row", [("sgd", 0), ("rowwise_adagrad", 4), ("adagrad", 4 * 32), ("adam", 8 * 32)]
)
def test_state_bytes_follow_the_optimizer(opt, state_per_row):
    t = TableStats.one(TableConfig("t", 500, 32, ("f",)))
    assert model(opt).storage(t, TW, HBM, 500.0, 32.0).hbm_state == 500 * state_per_row


def test_uvm_tiers_put_weights_in_host_memory():
    t = TableStats.one(TableConfig("t", 10_000, 64, ("f",), data_type="fp16"))
    rowwise, adam = model("rowwise_adagrad"), model("adam")
    uvm = rowwise.storage(t, TW, UVM, 10_000.0, 64.0)
    assert uvm.ddr_weights == 10_000 * 64 * 2 and uvm.hbm_weights == 0
    assert uvm.hbm_state == 10_000 * 4  # FBGEMM keeps row-wise state on the GPU
    assert adam.storage(t, TW, UVM, 10_000.0, 64.0).ddr_state == 10_000 * 64 * 8
    cached = rowwise.storage(t, TW, CACHE, 10_000.0, 64.0, clf=0.25)
    assert cached.hbm_cache >= 2500 * 64 * 2  # cache rows (+ slot state and the row map)
    assert cached.ddr_weights == uvm.ddr_weights


def test_data_parallel_replica_is_fp32_with_dense_gradient():
    t = TableStats.one(TableConfig("t", 100, 16, ("f",), data_type="fp16"))
    mem = model("sgd").storage(t, ShardingType.DATA_PARALLEL, HBM, 100.0, 16.0)
    assert mem.hbm_weights == 100 * 16 * 4
    assert mem.hbm_buffers >= 100 * 17 * 4


# ---- cost -------------------------------------------------------------------------------------------------------
def test_zipf_hit_rate():
    assert zipf_hit_rate(200.0, 1000.0, 0.0) == pytest.approx(0.2)
    skewed = zipf_hit_rate(200.0, 1000.0, 1.0)
    assert 0.7 < skewed < 1.0
    assert zipf_hit_rate(100.0, 1000.0, 1.0) < skewed < zipf_hit_rate(400.0, 1000.0, 1.0)
    assert zipf_hit_rate(1000.0, 1000.0, 1.2) == pytest.approx(1.0)


def test_tiers_order_by_cost_and_skew_helps_the_cache():
    m = model("rowwise_adagrad")
    t = TableStats.one(TableConfig("t", 10_000_000, 128, ("f",), ids_per_bag=5))
    cost = {
        tier: (lambda w: w.fwd_s + w.bwd_s)(m.work(t, TW, tier, 1e7, 128.0, clf=0.2, alpha=0.0))
        for tier in (HBM, CACHE, UVM)
    }
    assert cost[HBM] < cost[CACHE] < cost[UVM]
    skewed = m.work(t, TW, CACHE, 1e7, 128.0, clf=0.2, alpha=1.2)
    assert skewed.fwd_s + skewed.bwd_s < cost[CACHE]


def test_row_wise_moves_more_pooled_bytes_than_table_wise():
    m = model("rowwise_adagrad", world=4)
    t = TableStats.one(TableConfig("t", 1_000_000, 128, ("f",)))
    tw = m.owner_vec(m.work(t, TW, HBM, 1e6, 128.0)) + 3 * m.peer_vec(m.work(t, TW, HBM, 1e6, 128.0), True)
    rw_work = m.work(t, ShardingType.ROW_WISE, HBM, 250_000.0, 128.0)
    rw = 4 * (m.owner_vec(rw_work) + 3 * m.peer_vec(rw_work, True))
    assert rw.sum() > tw.sum()


# ---- topology ---------------------------------------------------------------------------------------------------
def test_topology_presets_and_yaml_round_trip(tmp_path):
    h200 = Topology.preset("h200", 16, 8)
    assert h200.num_hosts == 2 and h200.hbm_bytes > 130 * GIB and h200.hbm_bw > Topology.preset("h100", 8).hbm_bw
    path = tmp_path / "topo.yaml"
    h200.save(path)
    back = Topology.load(path)
    assert back.world_size == 16 and back.hbm_bytes == pytest.approx(h200.hbm_bytes, rel=1e-4)
    assert back.intra_host_bw == pytest.approx(h200.intra_host_bw)
    smaller = back.with_sizes(world_size=2, hbm_gib=16)
    assert smaller.world_size == 2 and smaller.local_world_size == 2 and smaller.hbm_bytes == 16 * GIB


def test_topology_errors():
    with pytest.raises(ConfigError, match="unknown device preset 'v100'"):
        Topology.preset("v100", 2)
    with pytest.raises(ConfigError, match="local_world_size=3 is invalid with world_size=8"):
        Topology(8, 3, hbm_bytes=GIB)
    with pytest.raises(ConfigError, match="unknown key 'hbm_gb'"):
        Topology.from_dict({"world_size": 2, "local_world_size": 2, "hbm_gb": 80})


# ---- constraints and options -----------------------------------------------------------------------------------
TABLES = [TableConfig(f"t{i}", 1000, 32, (f"f{i}",)) for i in range(4)]


def test_constraints_from_dict_and_patterns():
    c = ParameterConstraints.from_dict({"sharding_types": ["row_wise"], "tiers": "hbm", "ranks": [1, 0]})
    assert c.sharding_types == (ShardingType.ROW_WISE,) and c.tiers == (HBM,) and c.ranks == (0, 1)
    with pytest.raises(ConfigError, match="unknown key 'tier'"):
        ParameterConstraints.from_dict({"tier": "hbm"}, "x.yaml: constraints['t0']")
    out = resolve_constraints(TABLES, {"t*": {"tiers": ["uvm"]}, "t1": {"tiers": ["hbm"]}}, 2)
    assert out["t0"].tiers == (UVM,) and out["t1"].tiers == (HBM,)
    with pytest.raises(ConfigError, match="matches constraint patterns"):
        resolve_constraints(TABLES, {"t*": {}, "*0": {}}, 2)
    with pytest.raises(ConfigError, match="name table 'nope', which does not exist"):
        resolve_constraints(TABLES, {"nope": {}}, 2)
    with pytest.raises(ConfigError, match=r"ranks \[5\] do not exist with world_size=2"):
        resolve_constraints(TABLES, {"t0": {"ranks": [5]}}, 2)


def test_options_follow_constraints_and_topology():
    topo, s = Topology.preset("h100", 8), PlannerSettings()
    t = TableConfig("t", 1000, 64, ("f",))
    opts = table_options(t, ParameterConstraints(), topo, s)
    kinds = {o.sharding for o in opts}
    assert {TW, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL} <= kinds
    assert ShardingType.TABLE_ROW_WISE not in kinds  # one host
    assert all(o.tier is HBM for o in opts if o.sharding is ShardingType.DATA_PARALLEL)
    only = table_options(t, ParameterConstraints(sharding_types=("column_wise",), column_shards=(4,)), topo, s)
    assert {(o.sharding, o.parts) for o in only} == {(ShardingType.COLUMN_WISE, 4)}
    cpu = table_options(t, ParameterConstraints(), Topology.preset("cpu", 2), s)
    assert {o.tier for o in cpu} == {MemoryTier.HOST}
    multi = table_options(t, ParameterConstraints(), Topology.preset("h100", 16, 8), s)
    assert ShardingType.TABLE_ROW_WISE in {o.sharding for o in multi}
    with pytest.raises(ConfigError, match="table 't': no sharding option is left"):
        table_options(t, ParameterConstraints(sharding_types=("data_parallel",), tiers=("uvm",)), topo, s)


def test_splits():
    assert column_splits(24, 4) == [8, 8, 4, 4] and all(w % 4 == 0 for w in column_splits(100, 8))
    assert sum(row_splits(10, 4)) == 10 and len(row_splits(9, 4)) <= 4
    t = TableConfig("t", 10, 8, ("f",))
    shards = make_shards(t, Option(ShardingType.ROW_WISE, HBM, 4), list(range(len(row_splits(10, 4)))))
    assert sum(s.num_rows for s in shards) == 10 and shards[0].row_offset == 0


# ---- planner input --------------------------------------------------------------------------------------------
def test_planner_input_parsing():
    data = {
        "batch_size": 64,
        "optimizer": {"kind": "adam", "lr": 0.001},
        "tables": [{"name": "s", "count": 3, "num_embeddings": 10, "embedding_dim": 8, "ids_per_bag": 2}],
        "constraints": {"s_*": {"tiers": ["hbm"]}},
    }
    inp = planner_input_from_dict(data, "in.yaml")
    assert [t.name for t in inp.tables] == ["s_0", "s_1", "s_2"] and inp.tables[2].feature_names == ("s_2",)
    assert inp.optimizer.kind.value == "adam" and inp.batch_size == 64
    with pytest.raises(ConfigError, match=r"in.yaml: tables\[0\]: unknown key 'rows'"):
        planner_input_from_dict({**data, "tables": [{"name": "x", "rows": 5}]}, "in.yaml")
    with pytest.raises(ConfigError, match="in.yaml: unknown key 'topolgy'"):
        planner_input_from_dict({**data, "topolgy": {}}, "in.yaml")
    with pytest.raises(ConfigError, match="in.yaml: optimizer: unknown key 'beta'"):
        planner_input_from_dict({**data, "optimizer": {"beta": 0.9}}, "in.yaml")
    with pytest.raises(ConfigError, match=r"in.yaml: tables\[0\]: table 'x': embedding_dim=0"):
        planner_input_from_dict({**data, "tables": [{"name": "x", "num_embeddings": 5, "embedding_dim": 0}]}, "in.yaml")


def test_hit_rate_is_vectorized():
    rates = zipf_hit_rate(np.array([10.0, 50.0]), np.array([100.0, 100.0]), np.array([0.0, 0.0]))
    assert rates.tolist() == pytest.approx([0.1, 0.5])
