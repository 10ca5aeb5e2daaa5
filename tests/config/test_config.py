"""YAML config: example configs load, overrides apply, every class of error names file, key path and value,
docs/config.md is generated from the dataclasses, and plan_for_job honours constraints and plan files."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import paths
import pytest
import yaml

from embshard import simple_plan
from embshard.config import TrainConfig, load_config
from embshard.config.doc import _dataclass_in, generate, rows
from embshard.config.schema import field_docs
from embshard.planner.policy import plan_for_job
from embshard.spec.plan import GRAPH_SHARDING_TYPES, MemoryTier, ShardingType
from embshard.spec.tables import ConfigError, TableConfig

ROOT = paths.ROOT
EXAMPLES = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path: Path, data: dict, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def base() -> dict:
    return {
        "model": {
            "kind": "dlrm",
            "tables": [
                {"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f0"]},
                {"name": "t1", "num_embeddings": 50, "embedding_dim": 8, "feature_names": ["f1", "f2"]},
                {"name": "t2", "num_embeddings": 20, "embedding_dim": 8, "feature_names": ["f3"]},
            ],
        },
        "data": {"source": "synthetic"},
        "schedule": {"batch_size": 4, "steps": 10},
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.tables and cfg.schedule.batch_size > 0


def test_example_set_covers_every_model_kind():
    kinds = {load_config(p).model.kind for p in EXAMPLES}
    assert kinds == {"dlrm", "dlrm_dcnv2", "two_tower", "hstu"}
    assert any("criteo" in p.name for p in EXAMPLES)


def test_defaults_and_types(tmp_path):
    cfg = load_config(write(tmp_path, base()))
    assert cfg.model.tables[1].feature_names == ("f1", "f2")
    assert cfg.model.dlrm is not None and cfg.model.dcn is None  # dlrm defaults filled in, unused sections absent
    assert cfg.sparse_optimizer.kind.value == "rowwise_adagrad"
    assert cfg.data.synthetic is not None and cfg.data.synthetic.zipf_exponent == 1.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.schedule.steps = 3  # type: ignore[misc]


def test_overrides(tmp_path):
    path = write(tmp_path, base())
    cfg = load_config(
        path,
        [
            "schedule.steps=25",
            "model.tables[2].embedding_dim=8",
            "model.tables[0].num_embeddings=1000",
            "sparse_optimizer.lr=1e-3",  # YAML 1.1 reads this as a string: number fields accept it
            "sparse_optimizer.kind=adam",
            "model.dlrm.top_mlp=[16, 8]",
            "planner.constraints.t1.sharding_types=[row_wise, table_wise]",
            "planner.constraints.t1.ranks=[1]",
            "logging.tensorboard_dir=null",
            "checkpoint.dir=/tmp/x=y",  # only the first '=' splits
        ],
    )
    assert cfg.schedule.steps == 25
    assert cfg.model.tables[0].num_embeddings == 1000
    assert cfg.sparse_optimizer.lr == pytest.approx(1e-3)
    assert cfg.sparse_optimizer.kind.value == "adam"
    assert cfg.model.dlrm.top_mlp == (16, 8)
    c = cfg.planner.constraints["t1"]
    assert c.sharding_types == (ShardingType.ROW_WISE, ShardingType.TABLE_WISE) and c.ranks == (1,)
    assert cfg.logging.tensorboard_dir is None
    assert cfg.checkpoint.dir == "/tmp/x=y"


def error_of(tmp_path, data, overrides=()) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert msg.startswith(path), msg  # every message names the file first
    return msg


def test_unknown_key(tmp_path):
    data = base()
    data["model"]["tables"][2]["embeding_dim"] = 8
    msg = error_of(tmp_path, data)
    assert "model.tables[2].embeding_dim" in msg and "unknown key" in msg and "8" in msg
    assert "Did you mean 'embedding_dim'" in msg
    data = base()
    data["schedul"] = {}
    assert "Did you mean 'schedule'" in error_of(tmp_path, data)


def test_wrong_type(tmp_path):
    data = base()
    data["model"]["tables"][2]["num_embeddings"] = "many"
    msg = error_of(tmp_path, data)
    assert "model.tables[2].num_embeddings='many'" in msg and "expected an integer, got str" in msg
    data = base()
    data["schedule"]["batch_size"] = 4.5
    msg = error_of(tmp_path, data)
    assert "schedule.batch_size=4.5" in msg and "expected an integer" in msg
    data = base()
    data["data"]["shuffle"] = "yes"
    assert "data.shuffle='yes'" in error_of(tmp_path, data)
    data = base()
    data["model"]["tables"] = {"t0": {}}
    assert "model.tables=" in error_of(tmp_path, data)


def test_missing_field(tmp_path):
    data = base()
    del data["model"]["tables"][1]["embedding_dim"]
    msg = error_of(tmp_path, data)
    assert "model.tables[1].embedding_dim is missing" in msg and "Width of each row" in msg
    data = base()
    del data["schedule"]
    assert "schedule is missing" in error_of(tmp_path, data)


def test_impossible_values(tmp_path):
    data = base()
    data["model"]["tables"][2]["embedding_dim"] = 0
    msg = error_of(tmp_path, data)
    assert "model.tables[2].embedding_dim=0 is invalid" in msg and "positive integer" in msg
    data = base()
    data["model"]["tables"][1]["embedding_dim"] = 16
    msg = error_of(tmp_path, data)  # DLRM's dot interaction needs one width
    assert "model.tables[1].embedding_dim=16 is invalid" in msg and "dlrm_dcnv2" in msg
    data = base()
    data["sparse_optimizer"] = {"lr": -0.5}
    assert "sparse_optimizer.lr=-0.5 is invalid" in error_of(tmp_path, data)
    data = base()
    data["model"]["kind"] = "wide_deep"
    msg = error_of(tmp_path, data)
    assert "model.kind='wide_deep' is invalid" in msg and "'two_tower'" in msg
    data = base()
    data["schedule"]["epochs"] = 2
    assert "schedule.steps=10 is invalid: give exactly one of steps and epochs" in error_of(tmp_path, data)
    data = base()
    data["model"]["tables"][2]["feature_names"] = ["f1"]
    msg = error_of(tmp_path, data)
    assert "model.tables[2].feature_names=['f1'] is invalid" in msg and "'t1'" in msg
    data = base()
    data["planner"] = {"constraints": {"t9": {"ranks": [0]}}}
    assert "planner.constraints.t9='t9' is invalid: no such table" in error_of(tmp_path, data)
    data = base()
    data["planner"] = {"constraints": {"t1": {"tiers": ["ssd"]}}}
    assert "planner.constraints.t1.tiers[0]='ssd' is invalid" in error_of(tmp_path, data)
    data = base()
    data["data"] = {"source": "criteo", "criteo": {"path": "x.txt", "eval_fraction": 1.0}}
    assert "data.criteo.eval_fraction=1.0 is invalid" in error_of(tmp_path, data)
    data = base()
    data["model"]["kind"] = "two_tower"
    del data["model"]["tables"][1]
    data["model"]["two_tower"] = {"user_features": ["f0"], "item_features": ["f1"], "user_mlp": [8], "item_mlp": [4]}
    msg = error_of(tmp_path, data)
    assert "model.two_tower.item_mlp=[4] is invalid" in msg and "user_mlp ends in 8" in msg
    data["model"]["two_tower"]["item_mlp"] = [8]
    msg = error_of(tmp_path, data)
    assert "model.two_tower.item_features[0]='f1' is invalid: no table lists this feature" in msg


def test_training_and_lookup_sections(tmp_path):
    """training: pipeline and precision (default sparse_dist, fp32); lookup: embshard.spec.options.LookupOptions, the
    collection's options (`RecModel(..., options=cfg.lookup)`); each wrong value names its key."""
    from embshard.spec.options import BoundsCheck, LookupOptions, OutputDtype

    cfg = load_config(write(tmp_path, base()))
    assert (cfg.training.pipeline, cfg.training.precision, cfg.training.prefetch_batches) == ("sparse_dist", "fp32", 2)
    assert cfg.lookup == LookupOptions()
    data = base()
    data["training"] = {"pipeline": "semi_sync", "precision": "bf16"}
    data["lookup"] = {"output_dtype": "bf16", "bounds_check": "drop", "prefetch_pipeline": True}
    cfg = load_config(write(tmp_path, data))
    assert cfg.training.pipeline == "semi_sync" and cfg.training.precision == "bf16"
    assert cfg.lookup.output_dtype is OutputDtype.BF16 and cfg.lookup.bounds_check is BoundsCheck.DROP
    assert cfg.lookup.prefetch_pipeline
    data = base()
    data["training"] = {"pipeline": "async"}
    msg = error_of(tmp_path, data)
    assert "training.pipeline='async' is invalid" in msg and "'semi_sync'" in msg
    data = base()
    data["training"] = {"prefetch_batches": 0}
    assert "training.prefetch_batches=0 is invalid" in error_of(tmp_path, data)
    data = base()
    data["lookup"] = {"output_dtype": "fp8"}
    msg = error_of(tmp_path, data)
    assert "lookup.output_dtype='fp8' is invalid" in msg and "'bf16'" in msg
    data = base()
    data["lookup"] = {"prefetch_pipelin": True}
    assert "lookup.prefetch_pipelin" in error_of(tmp_path, data)
    data = base()
    data["data"] = {"source": "synthetic", "synthetic": {"bag_lengths": "fixed", "pooling": {"f0": 0.3}}}
    assert "data.synthetic.pooling.f0=0.3 is invalid" in error_of(tmp_path, data)


def test_catalog_mode_errors(tmp_path):
    """Two-tower catalog mode (item_mlp: []) and the catalog losses: each wrong combination names the rule."""
    data = base()
    data["model"]["kind"] = "two_tower"
    tt = {"user_features": ["f0"], "item_features": ["f3"], "user_mlp": [8], "item_mlp": [8], "loss": "full_softmax"}
    data["model"]["two_tower"] = tt
    assert "model.two_tower.item_mlp=[8] is invalid: loss full_softmax scores the catalog's rows" in error_of(
        tmp_path, data
    )
    tt["item_mlp"] = []
    tt["item_features"] = ["f1"]
    assert "model.tables[1].feature_names=['f1', 'f2'] is invalid: table 't1' is the catalog" in error_of(
        tmp_path, data
    )
    tt["item_features"] = ["f3"]
    tt["user_mlp"] = [4]
    assert "model.tables[2].embedding_dim=8 is invalid" in error_of(tmp_path, data)
    tt["user_mlp"] = [8]
    tt["in_batch"] = {"global_negatives": True}
    assert "model.two_tower.in_batch='{...}' is invalid: loss 'full_softmax' does not use it" in error_of(
        tmp_path, data
    )
    del tt["in_batch"]
    tt["loss"] = "sampled_softmax"
    tt["sampled_softmax"] = {"num_negatives": 0}
    assert "model.two_tower.sampled_softmax.num_negatives=0 is invalid" in error_of(tmp_path, data)
    tt["sampled_softmax"] = {"num_negatives": 16}
    data["data"] = {"source": "synthetic", "synthetic": {"affinity": {"user_feature": "f0", "item_feature": "f9"}}}
    assert "data.synthetic.affinity.item_feature='f9' is invalid: no table lists this feature" in error_of(
        tmp_path, data
    )
    data["data"]["synthetic"]["affinity"]["item_feature"] = "f3"
    cfg = load_config(write(tmp_path, data))
    assert cfg.model.two_tower.catalog_mode and cfg.model.two_tower.sampled_softmax.sampler == "unigram"


def test_override_errors_name_the_override(tmp_path):
    msg = error_of(tmp_path, base(), ["model.tables[2].embedding_dim=-3"])
    assert "command-line override 'model.tables[2].embedding_dim=-3'" in msg
    assert "model.tables[2].embedding_dim=-3 is invalid" in msg
    msg = error_of(tmp_path, base(), ["schedule.stepz=3"])
    assert "unknown key 'schedule.stepz'" in msg and "override" in msg
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(write(tmp_path, base()), ["schedule.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(write(tmp_path, base()), ["model.tables[7].name=x"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_doc_is_generated_and_complete():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc == generate(), "docs/config.md is stale: run `make docs` (python -m embshard.config.doc docs/config.md)"
    paths = [r for r in rows(TrainConfig)]
    assert len(paths) > 60
    for path, _, _, description in paths:
        assert f"`{path}`" in doc
        assert description, f"config field {path} has no docstring"


def test_every_field_has_a_docstring():
    seen, todo = set(), [TrainConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no one-line docstring"
        for tp in typing.get_type_hints(cls).values():
            inner, _ = _dataclass_in(tp)
            if inner is not None:
                todo.append(inner)
    assert TableConfig in seen


TABLES = [
    TableConfig("a", 1000, 8, ("fa",)),
    TableConfig("b", 500, 8, ("fb",)),
    TableConfig("c", 200, 8, ("fc",)),
]


def test_plan_for_job_constraints_and_plan_file(tmp_path):
    cfg = load_config(
        write(tmp_path, base()),
        [
            "planner.strategy=simple",
            "planner.constraints.t0.ranks=[1]",
            "planner.constraints.t1.sharding_types=[data_parallel]",
            "planner.constraints.t2.tiers=[uvm]",
        ],
    )
    tables = list(cfg.model.tables)
    opt = cfg.sparse_optimizer

    def simple(ws: int, device: str = "cpu", planner=cfg.planner):
        return plan_for_job(tables, planner, ws, ws, device, 4, opt)

    plan = simple(2)
    assert plan["t0"].ranks == [1]
    assert plan["t1"].sharding_type is ShardingType.DATA_PARALLEL and plan["t1"].ranks == [0, 1]
    assert plan["t2"].tier is MemoryTier.UVM and plan["t0"].tier is MemoryTier.HOST
    assert simple(2, "cuda")["t0"].tier is MemoryTier.HBM
    with pytest.raises(ConfigError, match=r"planner.constraints\['t0'\]: ranks \[1\] do not exist with world_size=1"):
        simple(1)
    saved = simple_plan(tables, 2, tier=MemoryTier.HOST)
    for suffix in ("yaml", "json"):
        saved.save(tmp_path / f"plan.{suffix}")
        planner = load_config(write(tmp_path, base()), [f"planner.plan_file={tmp_path}/plan.{suffix}"]).planner
        assert simple(2, planner=planner) == saved
        with pytest.raises(ConfigError, match="is a plan for world_size=2"):
            simple(4, planner=planner)


def test_plan_for_job_auto_uses_the_planner(tmp_path):
    """strategy auto (the default) on this CPU machine: the planner's plan honours the constraints (also glob
    patterns), the log gets predictions per rank and the step time; hbm/ddr sizes and a topology file apply."""
    from embshard.planner import Topology

    tables = [TableConfig(f"t{i}", 100 * (i + 1), 8, (f"f{i}",), ids_per_bag=1 + i % 3) for i in range(6)]
    data = base()
    data["model"]["tables"] = [
        {"name": t.name, "num_embeddings": t.num_embeddings, "embedding_dim": 8, "feature_names": list(t.feature_names)}
        for t in tables
    ]
    data["planner"] = {"constraints": {"t[45]": {"sharding_types": ["row_wise"]}}}  # a glob pattern
    cons = ["planner.constraints.t0.sharding_types=[data_parallel]", "planner.constraints.t1.ranks=[2]"]
    cfg = load_config(
        write(tmp_path, data),
        [*cons, "planner.constraints.t3.sharding_types=[column_wise]", "planner.constraints.t3.column_shards=[2]"],
    )
    assert cfg.planner.strategy == "auto" and cfg.planner.settings.hbm_reserve_gib is None
    lines: list[str] = []
    plan = plan_for_job(tables, cfg.planner, 4, 4, "cpu", 64, cfg.sparse_optimizer, lines.append)
    plan.check(tables)
    assert (plan.world_size, plan.local_world_size) == (4, 4)
    assert plan["t0"].sharding_type is ShardingType.DATA_PARALLEL and plan["t0"].ranks == [0, 1, 2, 3]
    assert plan["t1"].ranks == [2]
    assert plan["t3"].sharding_type is ShardingType.COLUMN_WISE
    assert plan["t4"].sharding_type is plan["t5"].sharding_type is ShardingType.ROW_WISE
    assert {t.tier for t in plan.tables} == {MemoryTier.HOST}
    text = "\n".join(lines)
    assert "ShardingPlan: world_size=4" in text and "predicted step time" in text and "detected" in text
    assert text.count("\n3 ") == 1  # one line per rank in the per-rank table
    # no plan fits: a clear config error with the numbers and the training config's keys to change
    big = [*tables, TableConfig("big", 80_000_000, 8, ("fbig",))]  # 2.38 GiB of weights (never allocated here)
    data["model"]["tables"].append(
        {"name": "big", "num_embeddings": 80_000_000, "embedding_dim": 8, "feature_names": ["fbig"]}
    )
    tiny = load_config(write(tmp_path, data), ["planner.ddr_gib=1"]).planner
    with pytest.raises(ConfigError) as e:
        plan_for_job(big, tiny, 2, 2, "cpu", 64, cfg.sparse_optimizer)
    msg = str(e.value)
    assert msg.startswith("planner: no sharding plan fits 2 x cpu (1 host(s) x 2), 1.0 GiB host memory per rank")
    assert "['big'] fit no rank" in msg and "host memory per rank 0.85 GiB = 1.00 GiB - 0.15 GiB reserve" in msg
    assert re.search(r"row_wise host +largest shard: GPU 0.00 GiB, host 1.34 GiB \(2 shard", msg), msg
    assert "planner.ddr_gib" in msg and "Traceback" not in msg
    data["model"]["tables"].pop()
    # a topology file: its speeds, the job's rank counts; one of GPUs does not fit a CPU job
    Topology.preset("cpu", 8, 8, ddr_gib=3).save(tmp_path / "cpu.yaml")
    Topology.preset("h100", 8).save(tmp_path / "h100.yaml")
    lines.clear()
    planner = load_config(write(tmp_path, data), [f"planner.topology_file={tmp_path}/cpu.yaml"]).planner
    plan_for_job(tables, planner, 2, 2, "cpu", 64, cfg.sparse_optimizer, lines.append)
    assert "2 x cpu (1 host(s) x 2), 3.0 GiB host memory per rank; source: preset cpu" in "\n".join(lines)
    planner = load_config(write(tmp_path, data), [f"planner.topology_file={tmp_path}/h100.yaml"]).planner
    with pytest.raises(ConfigError, match="describes cuda ranks, but this job computes on cpu"):
        plan_for_job(tables, planner, 2, 2, "cpu", 64, cfg.sparse_optimizer)
    # constraints the planner cannot meet, and keys of the other strategy, are config errors
    bad = load_config(write(tmp_path, data), ["planner.constraints.t2.tiers=[hbm]"]).planner
    with pytest.raises(ConfigError, match="^planner: .*t2"):
        plan_for_job(tables, bad, 2, 2, "cpu", 64, cfg.sparse_optimizer)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=r"planner.tier='host' is invalid: tier is a setting of strategy simple"):
        load_config(path, ["planner.tier=host"])
    with pytest.raises(ConfigError, match=r"planner.settings=\{'hbm_reserve_gib': 2.0\} is invalid: .* not simple"):
        load_config(path, ["planner.strategy=simple", "planner.settings.hbm_reserve_gib=2"])
    data["planner"] = {"constraints": {"x*": {"ranks": [0]}}}
    with pytest.raises(ConfigError, match=r"planner.constraints.x\*='x\*' is invalid: the pattern matches no table"):
        load_config(write(tmp_path, data))
    with pytest.raises(ConfigError, match=r"planner.settings.memory_fill=0.1 is invalid"):
        load_config(path, ["planner.settings.memory_fill=0.1"])


def test_the_plan_prices_the_batch_counts_the_job_uses(tmp_path):
    """TrainConfig.batch_counts is where the training pipeline takes each step's batch counts from (host unless
    training.pipeline is none, lookup.bounds_check drop or a retrieval catalog: embshard/training/pipeline.py), and
    plan_for_job prices the step with it unless planner.settings.batch_counts is set: device counts carry the
    topology's host sync, host counts do not."""
    from embshard.planner import Topology

    path = write(tmp_path, base())
    assert load_config(path).batch_counts == "host"
    assert load_config(path, ["training.pipeline=semi_sync"]).batch_counts == "host"
    assert load_config(path, ["training.pipeline=none"]).batch_counts == "device"
    assert load_config(path, ["lookup.bounds_check=drop"]).batch_counts == "device"
    assert load_config(ROOT / "configs" / "two_tower_synthetic_1m.yaml").batch_counts == "device"  # catalog mode
    assert load_config(ROOT / "configs" / "two_tower_movielens.yaml").batch_counts == "host"
    h100 = Topology.preset("h100", 2)
    h100.save(tmp_path / "h100.yaml")
    tables = [TableConfig(f"t{i}", 100_000, 64, (f"f{i}",), ids_per_bag=4) for i in range(4)]

    def step_ms(overrides: list[str], counts: str | None) -> float:
        cfg = load_config(path, [f"planner.topology_file={tmp_path}/h100.yaml", *overrides])
        lines: list[str] = []
        plan = plan_for_job(tables, cfg.planner, 2, 2, "cuda", 1024, cfg.sparse_optimizer, lines.append, None, counts)
        assert any(t.sharding_type is not ShardingType.DATA_PARALLEL for t in plan.tables)  # an input exchange
        return float(re.search(r"predicted step time ([0-9.]+) ms", "\n".join(lines)).group(1))

    host, device = step_ms([], "host"), step_ms([], "device")
    assert device - host == pytest.approx(h100.host_sync_s * 1e3, abs=2e-3)
    assert step_ms([], None) == host  # outside a job: host, the default
    assert step_ms(["planner.settings.batch_counts=device"], "host") == device  # the config's setting wins
    with pytest.raises(ConfigError, match="batch_counts='gpu' is invalid: expected one of 'host', 'device'"):
        load_config(path, ["planner.settings.batch_counts=gpu"])


def test_whole_step_graph_plan_first_then_every_option():
    """A job that captures its whole step asks the planner first for a plan the graph can hold (table-wise,
    column-wise and data-parallel, no UVM caching); where none fits it plans with every option and says why."""
    from embshard.planner import Topology
    from embshard.planner.policy import search_plan
    from embshard.tools.plan_inputs import training_planner_input

    config = str(ROOT / "configs" / "dlrm_dcnv2_mlperf.yaml")
    topo = Topology.preset("h100", 2, 2).with_sizes(hbm_gib=40)

    def plan(graph: str, topo=topo, more: tuple[str, ...] = ()):
        inp, _ = training_planner_input(config, [f"training.cuda_graph={graph}", "training.precision=bf16", *more])
        said: list[str] = []
        out, _ = search_plan(inp.tables, topo, 8192, inp.optimizer, inp.constraints, inp.settings, said.append)
        return {(t.sharding_type, t.tier) for t in out.tables}, said

    free, said = plan("false")
    assert all("data-parallel tables cost the host most" in line for line in said)  # the eager host floor's choice
    assert (ShardingType.ROW_WISE, MemoryTier.HBM) in free and (ShardingType.TABLE_WISE, MemoryTier.UVM_CACHING) in free
    held, said = plan("true")
    assert not said
    assert {st for st, _ in held} <= set(GRAPH_SHARDING_TYPES)  # table-wise, column-wise, data-parallel
    assert MemoryTier.UVM_CACHING not in {tier for _, tier in held}
    # 4 ranks of 18 GiB GPU and 30 GiB host memory hold one whole 40M-row table (19 GiB) each, not the fifth:
    # the graph holds it split column-wise; without column-wise it is split row-wise, and the log says why
    small = Topology.preset("h100", 4, 4).with_sizes(hbm_gib=18, ddr_gib=30)
    held, said = plan("true", small)
    assert ShardingType.COLUMN_WISE in {st for st, _ in held} and not said
    no_cw = ("planner.settings.sharding_types=[table_wise,row_wise,data_parallel]",)
    fallback, said = plan("true", small, no_cw)
    assert ShardingType.ROW_WISE in {st for st, _ in fallback}
    assert said and "no plan that the whole-step CUDA graph can hold fits" in said[0]  # then the eager plan's notes
    # settings that allow none of the graph's options: said so, and planned with them as they are
    inp, _ = training_planner_input(config, ["training.cuda_graph=true", "planner.settings.sharding_types=[row_wise]"])
    said = []
    out, _ = search_plan(inp.tables, topo, 8192, inp.optimizer, inp.constraints, inp.settings, said.append)
    assert {t.sharding_type for t in out.tables} == {ShardingType.ROW_WISE}
    assert len(said) == 1 and "sharding types ['row_wise']" in said[0] and "none of which the graph holds" in said[0]
