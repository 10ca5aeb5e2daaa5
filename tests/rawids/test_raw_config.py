"""Raw-id tables in configuration, data and planning (one process): the YAML table keys and their errors, the
table source's `mapping: raw` (integers, decimal text, other text hashed to 64 bits, missing values), the id check
letting any raw id through, and the sharding types the planner and the module accept for them."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import yaml

from embshard import TableConfig, simple_plan
from embshard.collection.bounds import check_ids, count_bad_ids
from embshard.config import load_config
from embshard.data import build_source
from embshard.data.decode import RAW_MISSING
from embshard.data.hashing import hash_strings
from embshard.planner import Topology, plan_with_report
from embshard.rawids import map_bytes_per_row
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import BoundsCheck
from embshard.spec.tables import ConfigError


def _config(tmp, tables, data) -> str:
    cfg = {
        "model": {"kind": "dlrm", "tables": tables, "dlrm": {"bottom_mlp": [8], "top_mlp": [8]}},
        "data": data,
        "schedule": {"batch_size": 4, "steps": 2},
        "logging": {"tensorboard_dir": None, "progress_bar": False},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def test_table_keys_and_their_errors(tmp_path):
    raw = {"name": "u", "num_embeddings": 50, "embedding_dim": 8, "feature_names": ["user"], "ids": "raw",
           "eviction": "lfu", "admit_min_count": 2}  # fmt: skip
    data = {"source": "synthetic"}
    cfg = load_config(_config(tmp_path, [raw], data))
    t = cfg.model.tables[0]
    assert t.raw_ids and t.eviction.value == "lfu" and t.admit_min_count == 2
    bad = [
        ({**raw, "ids": "hashed"}, "ids='hashed' is invalid: expected one of 'index', 'raw'"),
        ({**raw, "eviction": "fifo"}, "eviction='fifo' is invalid"),
        ({**raw, "admit_min_count": 0}, "admit_min_count=0 is invalid"),
        ({**raw, "ids": "index"}, "it applies to raw-id tables only"),
        ({**raw, "num_embeddings": 1}, "a raw-id table needs >= 2 rows"),
        ({**raw, "capacity": 5}, "unknown key 'model.tables[0].capacity'"),
    ]
    for table, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            load_config(_config(tmp_path, [table], data))
        assert "model.tables[0]" in str(e.value)


def test_table_source_passes_raw_ids_through(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text(
        "label,user,item\n"
        "1,123,apple\n"
        "0,-7,\n"
        "1,,banana\n"
        "0,99999999999999999999,apple\n"  # 20 digits: not an int64, hashed as text
    )
    tables = [
        {"name": "u", "num_embeddings": 10, "embedding_dim": 8, "feature_names": ["user"], "ids": "raw"},
        {"name": "i", "num_embeddings": 10, "embedding_dim": 8, "feature_names": ["item"], "ids": "raw"},
    ]
    data = {"source": "table", "shuffle": False, "table": {"files": [str(csv)], "label": "label", "mapping": "raw",
            "categorical": [{"column": "user"}, {"column": "item"}], "eval_fraction": 0.25}}  # fmt: skip
    cfg = load_config(_config(tmp_path, tables, data))
    src = build_source(cfg.data, list(cfg.model.tables), 3, 0, 0, 1)
    batch = next(iter(src.train_batches()))
    kjt = batch.sparse.to_dict()
    h = hash_strings(["apple", "banana"]).view(np.int64)
    assert kjt["user"].values().tolist() == [123, -7, RAW_MISSING]
    assert kjt["item"].values().tolist() == [int(h[0]), RAW_MISSING, int(h[1])]
    held_out = next(iter(src.eval_batches())).sparse.to_dict()
    assert held_out["user"].values().tolist() == [int(hash_strings(["99999999999999999999"]).view(np.int64)[0])]
    # mapping raw feeds raw-id tables only
    tables[1] = {k: v for k, v in tables[1].items() if k != "ids"}
    cfg = load_config(_config(tmp_path, tables, data))
    with pytest.raises(ConfigError, match=r"mapping raw .* tables \['i'\] take row numbers"):
        build_source(cfg.data, list(cfg.model.tables), 3, 0, 0, 1)


def test_id_check_lets_raw_ids_through():
    tables = [TableConfig("r", 4, 4, ("fr",), ids="raw"), TableConfig("s", 4, 4, ("fs",))]
    table_of = {f: t for t in tables for f in t.feature_names}
    lengths = torch.tensor([[2, 1], [1, 1]])
    values = torch.tensor([-(2**62), 10**15, -1, 3, 2])  # raw ids anything; static ids in range
    assert int(count_bad_ids(lengths, values, ["fr", "fs"], table_of)) == 0
    assert check_ids(lengths, values, None, ["fr", "fs"], table_of, BoundsCheck.ERROR, {})[1] is values
    values[3] = 4  # a static id out of range is still caught
    assert int(count_bad_ids(lengths, values, ["fr", "fs"], table_of)) == 1
    with pytest.raises(ValueError, match="feature 'fs': id 4 is outside table 's'"):
        check_ids(lengths, values, None, ["fr", "fs"], table_of, BoundsCheck.ERROR, {})


def test_sharding_types_of_raw_tables():
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables = [TableConfig(f"t{i}", 100_000, 64, (f"f{i}",), ids_per_bag=4, ids="raw") for i in range(4)]
    opt = FusedOptimizerConfig("rowwise_adagrad")
    topo = Topology.preset("h100", 2)
    plan, report = plan_with_report(tables, topo, 1024, opt)
    assert {tp.sharding_type.value for tp in plan.tables} <= {"table_wise", "row_wise"}
    static, static_report = plan_with_report([dataclasses.replace(t, ids="index") for t in tables], topo, 1024, opt)
    extra = sum(float(r.storage.hbm_state) for r in report.ranks) - sum(
        float(r.storage.hbm_state) for r in static_report.ranks
    )
    assert extra == pytest.approx(4 * 100_000 * map_bytes_per_row(100_000), rel=1e-6)  # the maps, priced
    assert report.gpu_step_time_s > static_report.gpu_step_time_s  # the remap: GPU work (both steps host-bound here)
    with pytest.raises(ConfigError, match="ids: raw, which supports sharding types .* not data_parallel"):
        plan_with_report(tables, topo, 1024, opt, constraints={"t0": {"sharding_types": ["data_parallel"]}})
    for order in (1, -1):  # a raw table beside a plain one of the same width: each keeps its own options
        mixed = [TableConfig("plain", 100_000, 64, ("fp",), ids_per_bag=4), tables[0]][::order]
        from embshard.planner.choices import build_choices
        from embshard.planner.constraints import resolve_constraints
        from embshard.planner.cost import CostModel

        items, _ = build_choices(CostModel(topo, 1024, opt), mixed, resolve_constraints(mixed, {}, 2))
        kinds = {mixed[it.tables[0]].name: {o.sharding.value for o in it.options} for it in items}
        assert kinds["t0"] <= {"table_wise", "row_wise"} and "column_wise" in kinds["plain"], (order, kinds)
    cw = simple_plan(tables, 1, sharding_types={"t1": "column_wise"})
    with pytest.raises(ConfigError, match="table 't1' has ids: raw, which supports .* not column_wise"):
        ShardedEmbeddingBagCollection(tables, cw, opt, device="cpu")
    uvm = simple_plan(tables, 1, tier="uvm_caching")
    with pytest.raises(ConfigError, match="planned in tier uvm_caching"):
        ShardedEmbeddingBagCollection(tables, uvm, opt, device="cpu")


def test_map_bytes_per_row():
    assert 60 < map_bytes_per_row(1_000_000) < 85
    assert map_bytes_per_row(1_000_000, "lfu") < map_bytes_per_row(1_000_000, "lru")
    assert map_bytes_per_row(1_000_000, "lru", 3) > map_bytes_per_row(1_000_000, "lru", 1) + 15
