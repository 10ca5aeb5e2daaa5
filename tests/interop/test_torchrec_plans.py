"""embshard <-> TorchRec configuration, one process: plans both ways (round trip, the plan file, the
`embshard plan --format torchrec` command, TorchRec's own planner's plan), notes and errors; tables, constraints and
the fused optimizer from TorchRec's."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.interop import (
    constraints_from_torchrec,
    from_torchrec_plan,
    load_torchrec_plan,
    optimizer_from_torchrec,
    save_torchrec_plan,
    tables_from_torchrec,
    to_torchrec_plan,
    with_pooling_factors,
)
from embshard.planner import Topology, plan_with_report
from embshard.spec.plan import Shard, ShardingPlan, TablePlan
from embshard.spec.tables import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TABLES = [
    TableConfig("a", 1000, 16, ("fa",)),
    TableConfig("b", 70, 8, ("fb", "fb2")),
    TableConfig("c", 5, 32, ("fc",)),  # fewer rows than ranks: row-wise has empty TorchRec shards
    TableConfig("d", 300, 24, ("fd",)),
    TableConfig("e", 64, 8, ("fe",)),
]


def _gpu_plan() -> ShardingPlan:
    """Every sharding type and GPU tier, 2 hosts of 2 ranks; a UVM-caching table with its cache settings."""
    types = {"a": "row_wise", "b": "table_row_wise", "c": "row_wise", "d": "column_wise", "e": "data_parallel"}
    plan = simple_plan(TABLES, 4, 2, types, tier="hbm", column_shards=3)
    tiers = {"a": dict(tier="uvm_caching", cache_load_factor=0.35, cache_algorithm="lfu"), "b": dict(tier="uvm")}
    return dataclasses.replace(
        plan, tables=tuple(dataclasses.replace(t, **tiers.get(t.table, {})) for t in plan.tables)
    )


def _specs(tr_plan, path: str) -> dict:
    return {
        name: (
            p.sharding_type,
            p.compute_kernel,
            list(p.ranks or []),
            [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in p.sharding_spec.shards]
            if p.sharding_spec
            else None,
            (p.cache_params.algorithm.name, p.cache_params.load_factor) if p.cache_params else None,
        )
        for name, p in tr_plan.plan[path].items()
    }


def test_plan_round_trip_and_torchrec_fields():
    plan = _gpu_plan()
    tr_plan, notes = to_torchrec_plan(plan, "model.sparse", "cuda", tables=TABLES)
    specs = _specs(tr_plan, "model.sparse")
    assert specs["a"][1] == "fused_uvm_caching" and specs["a"][4] == ("LFU", 0.35)
    assert specs["b"][:2] == ("table_row_wise", "fused_uvm") and specs["b"][4] is None
    c_shards = specs["c"][3]  # 5 rows over 4 ranks: blocks of 2, 2, 1 and TorchRec's empty shard on rank 3
    assert [s[1][0] for s in c_shards] == [2, 2, 1, 0]
    assert [s[2] for s in c_shards] == ["rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:0", "rank:3/cuda:1"]
    assert specs["d"][0] == "column_wise" and [s[1][1] for s in specs["d"][3]] == [8, 8, 8]
    assert specs["e"] == ("data_parallel", "dense", [0, 1, 2, 3], None, None)
    assert from_torchrec_plan(tr_plan, "model.sparse", local_world_size=2, tables=TABLES) == plan
    assert any("'e'" in n and "data_parallel" in n for n in notes)


def test_planner_plans_round_trip():
    for name, kw in (("overflow", dict(hbm_gib=16)), ("hetero124", {})):
        data = __import__("yaml").safe_load((ROOT / "configs" / "planner" / f"{name}.yaml").read_text())
        from embshard.tools.plan_inputs import planner_input_from_dict

        inp = planner_input_from_dict(data, name)
        topo = Topology.preset("h200", 2, 2).with_sizes(**kw)
        plan, _ = plan_with_report(inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, inp.settings)
        plan = dataclasses.replace(  # kernel 'small' is not TorchRec's: the round trip is for what it can express
            plan, tables=tuple(dataclasses.replace(t, kernel="fbgemm") for t in plan.tables)
        )
        tr_plan, _ = to_torchrec_plan(plan, "", "cuda", inp.optimizer, tables=inp.tables)
        back = from_torchrec_plan(tr_plan, world_size=plan.world_size, tables=inp.tables)
        assert back == plan, name
        back.check(inp.tables)


def test_plan_file_and_device_override(tmp_path):
    plan = _gpu_plan()
    path = tmp_path / "plan.json"
    notes = save_torchrec_plan(path, plan, "m", device_type="cuda")
    data = json.loads(path.read_text())  # plain JSON, nothing executable
    assert data["format"] == "torchrec-sharding-plan" and data["notes"] == notes
    assert _specs(load_torchrec_plan(path), "m") == _specs(to_torchrec_plan(plan, "m", "cuda", tables=TABLES)[0], "m")
    on_cpu = _specs(load_torchrec_plan(path, device_type="cpu"), "m")
    assert {v[1] for v in on_cpu.values()} == {"fused", "dense"}
    assert on_cpu["c"][3][3][2] == "rank:3/cpu"
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ConfigError, match="--format torchrec"):
        load_torchrec_plan(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not a JSON plan file"):
        load_torchrec_plan(tmp_path / "broken.json")


def test_notes_for_what_torchrec_cannot_express():
    one = [TableConfig("s", 100, 8, ("fs",)), TableConfig("h", 100, 8, ("fh",)), TableConfig("w", 100, 8, ("fw",))]
    plan = ShardingPlan(
        2,
        2,
        (
            TablePlan("s", "table_wise", "hbm", (Shard(0, 0, 100, 0, 8),), kernel="small"),
            TablePlan("h", "table_wise", "host", (Shard(1, 0, 100, 0, 8),)),
            TablePlan("w", "column_wise", "uvm", (Shard(0, 0, 100, 0, 4), Shard(1, 0, 100, 4, 4))),
        ),
    )
    plan.check(one)
    _, gpu = to_torchrec_plan(plan, device_type="cuda", optimizer=FusedOptimizerConfig("rowwise_adagrad"), tables=one)
    assert [n.split(":")[0] for n in gpu] == ["table 's'", "table 'h'", "table 'w'"]
    assert "small" in gpu[0] and "fused_uvm" in gpu[1] and "column_wise_exact" in gpu[2]
    _, cpu = to_torchrec_plan(plan, device_type="cpu", optimizer=FusedOptimizerConfig("sgd"), tables=one)
    assert len(cpu) == 2 and "'fused'" in cpu[1]


def test_plan_errors():
    bad = ShardingPlan(2, 2, (TablePlan("r", "row_wise", "hbm", (Shard(1, 0, 5, 0, 8), Shard(0, 5, 5, 0, 8))),))
    bad.check([TableConfig("r", 10, 8, ("fr",))])
    with pytest.raises(ConfigError, match=r"table 'r'.*row_blocks"):
        to_torchrec_plan(bad, tables=[TableConfig("r", 10, 8, ("fr",))])
    with pytest.raises(ConfigError, match="device_type"):
        to_torchrec_plan(simple_plan(TABLES, 2), device_type="tpu", tables=TABLES)
    tr_plan, _ = to_torchrec_plan(simple_plan(TABLES, 2, sharding_types={"e": "data_parallel"}), "x", tables=TABLES)
    with pytest.raises(ConfigError, match="no module 'y'"):
        from_torchrec_plan(tr_plan, "y")
    with pytest.raises(ConfigError, match="table 'e'.*tables="):
        from_torchrec_plan(tr_plan, "x")
    module = dict(tr_plan.plan["x"])
    module["a"] = dataclasses.replace(module["a"], sharding_type="table_column_wise")
    with pytest.raises(ConfigError, match="table 'a'.*table_column_wise"):
        from_torchrec_plan(module, tables=TABLES)
    module["a"] = dataclasses.replace(module["a"], sharding_type="table_wise", compute_kernel="key_value")
    with pytest.raises(ConfigError, match="table 'a'.*key_value"):
        from_torchrec_plan(module, tables=TABLES)


def test_torchrec_planner_plan_into_embshard():
    """TorchRec's own planner (dry run for 2 GPUs): its plan as embshard's, and back to the same TorchRec plan."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.types import ParameterConstraints as TorchRecConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings * 1000,
            embedding_dim=t.embedding_dim * 4,
            feature_names=list(t.feature_names),
        )
        for t in TABLES
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    kinds = {"a": "row_wise", "b": "column_wise", "c": "data_parallel", "d": "table_row_wise", "e": "table_wise"}
    constraints = {n: TorchRecConstraints(sharding_types=[k]) for n, k in kinds.items()}
    topo = TorchRecTopology(world_size=2, local_world_size=2, compute_device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr_plan = EmbeddingShardingPlanner(topology=topo, constraints=constraints).plan(
            ebc, [EmbeddingBagCollectionSharder()]
        )
    tables = tables_from_torchrec(ebc)
    plan = from_torchrec_plan(tr_plan, tables=tables)
    plan.check(tables)
    assert {t.table: t.sharding_type.value for t in plan.tables} == kinds
    again, _ = to_torchrec_plan(plan, tables=ebc)
    assert _specs(again, "") == _specs(tr_plan, "")


def test_cli_format_torchrec(tmp_path, capsys):
    from embshard.tools.plan import main

    out = tmp_path / "plan.torchrec.json"
    args = [
        str(ROOT / "configs/planner/hetero124.yaml"),
        "--world-size",
        "2",
        "--device",
        "h200",
        "--format",
        "torchrec",
    ]
    main([*args, "--torchrec-module-path", "model.sparse_arch.embedding_bag_collection", "--out", str(out)])
    tr_plan = load_torchrec_plan(out)
    assert len(tr_plan.plan["model.sparse_arch.embedding_bag_collection"]) == 124
    main(args)
    printed = json.loads(capsys.readouterr().out)
    assert list(printed["modules"]) == [""] and len(printed["modules"][""]) == 124


def test_tables_constraints_optimizer_from_torchrec():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.planner.types import ParameterConstraints as TorchRecConstraints
    from torchrec.distributed.types import CacheParams
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [
        EmbeddingBagConfig(
            name="u",
            num_embeddings=50,
            embedding_dim=16,
            feature_names=["fu", "fv"],
            pooling=PoolingType.MEAN,
            weight_init_min=-0.1,
            weight_init_max=0.1,
        ),
        EmbeddingBagConfig(name="i", num_embeddings=40, embedding_dim=8, feature_names=["fi"], data_type=DataType.FP16),
    ]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("meta"))
    tables = tables_from_torchrec(ebc)
    assert tables == [
        TableConfig("u", 50, 16, ("fu", "fv"), pooling="mean", weighted=True, init_std=0.1),
        TableConfig("i", 40, 8, ("fi",), weighted=True, data_type="fp16"),
    ]
    with pytest.raises(ConfigError, match="table 'q'.*NONE"):
        tables_from_torchrec(
            [
                EmbeddingBagConfig(
                    name="q", num_embeddings=4, embedding_dim=4, feature_names=["fq"], pooling=PoolingType.NONE
                )
            ]
        )
    with pytest.raises(ConfigError, match="table 'q'.*INT8"):
        tables_from_torchrec(
            [
                EmbeddingBagConfig(
                    name="q", num_embeddings=4, embedding_dim=4, feature_names=["fq"], data_type=DataType.INT8
                )
            ]
        )
    with pytest.warns(UserWarning, match="not symmetric"):
        tables_from_torchrec(
            [
                EmbeddingBagConfig(
                    name="q",
                    num_embeddings=4,
                    embedding_dim=4,
                    feature_names=["fq"],
                    weight_init_min=0.0,
                    weight_init_max=0.2,
                )
            ]
        )

    tr_constraints = {
        "u": TorchRecConstraints(
            sharding_types=["row_wise", "column_wise"],
            compute_kernels=["fused_uvm_caching"],
            cache_params=CacheParams(load_factor=0.3),
            min_partition=8,
            pooling_factors=[2.0, 4.0],
        ),
        "i": TorchRecConstraints(compute_kernels=["fused", "dense"]),
    }
    ours = constraints_from_torchrec(tr_constraints, tables)
    assert [s.value for s in ours["u"].sharding_types] == ["row_wise", "column_wise"]
    assert [t.value for t in ours["u"].tiers] == ["uvm_caching"] and ours["u"].cache_load_factor == 0.3
    assert ours["u"].column_shards == (1, 2)  # widths 16 and 8 are >= min_partition 8
    assert [t.value for t in ours["i"].tiers] == ["hbm"]
    assert [t.ids_per_bag for t in with_pooling_factors(tables, tr_constraints)] == [3.0, 1.0]
    with pytest.raises(ConfigError, match="table 'i'.*key_value"):
        constraints_from_torchrec({"i": TorchRecConstraints(compute_kernels=["key_value"])})

    with pytest.raises(ConfigError, match="no optimizer applied"):
        optimizer_from_torchrec(ebc)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05, "eps": 1e-6})
    assert optimizer_from_torchrec(ebc) == FusedOptimizerConfig("rowwise_adagrad", lr=0.05, eps=1e-6)
    assert optimizer_from_torchrec(ebc, world_size=4).eps == pytest.approx(4e-6)  # TorchRec's gradients / 4
    sgd = optimizer_from_torchrec(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.4}, world_size=4
    )
    assert sgd == FusedOptimizerConfig("sgd", lr=0.1)
    with pytest.raises(ConfigError, match="momentum"):
        optimizer_from_torchrec(fused_params={"optimizer": "SGD", "momentum": 0.9})
    with pytest.raises(ConfigError, match="LAMB"):
        optimizer_from_torchrec(fused_params={"optimizer": EmbOptimType.LAMB})


def test_materialized_torchrec_dlrm_as_rec_model():
    """One process: a materialized TorchRec DLRM and the RecModel made of it give the same loss, and after one
    step (row-wise Adagrad on the tables, SGD on the dense part) the same tables and dense weights."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embshard.data.common import Batch
    from embshard.interop import rec_model_from_torchrec

    configs = [
        EmbeddingBagConfig(name="u", num_embeddings=30, embedding_dim=8, feature_names=["fu"]),
        EmbeddingBagConfig(name="i", num_embeddings=50, embedding_dim=8, feature_names=["fi", "fj"]),
    ]
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    theirs = DLRM_DCN(ebc, 3, [8], [8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1, "eps": 1e-8})
    tables = tables_from_torchrec(ebc)
    plan = simple_plan(tables, 1, sharding_types={"i": "column_wise"}, column_shards=2)
    ours = rec_model_from_torchrec(theirs, plan, torch.device("cpu"))
    assert ours.num_dense == 3
    before = {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 3, (18,), generator=gen, dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["fu", "fi", "fj"], values=torch.randint(0, 30, (int(lengths.sum()),), generator=gen), lengths=lengths
    )
    batch = Batch(torch.randn(6, 3, generator=gen), kjt, torch.randint(0, 2, (6,), generator=gen).float())
    their_loss = torch.nn.functional.binary_cross_entropy_with_logits(theirs(batch.dense, kjt).squeeze(1), batch.labels)
    our_loss = ours.step(batch).loss
    torch.testing.assert_close(our_loss, their_loss)
    their_dense = torch.optim.SGD([p for n, p in theirs.named_parameters() if "embedding_bags" not in n], lr=0.1)
    our_dense = torch.optim.SGD(ours.dense_parameters(), lr=0.1)
    their_loss.backward()
    our_loss.backward()
    their_dense.step()
    our_dense.step()
    weights = ours.ebc.full_weights()
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(weights[name], bag.weight.detach(), rtol=1e-5, atol=1e-7, msg=name)
        assert not torch.equal(weights[name], before[name])  # the step moved the touched rows
    mine = dict(ours.dense_module().model.named_parameters())
    for name, p in theirs.named_parameters():
        if "embedding_bags" not in name:
            torch.testing.assert_close(mine[name], p.detach(), msg=name)


def test_raw_id_tables_do_not_cross_to_or_from_torchrec_checkpoints(tmp_path):
    """A raw-id table's rows mean something only with its id -> row map: loading TorchRec's rows into one (the map
    would be empty, every row re-initialised at its first id) and exporting one are both refused, naming it."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.interop import load_torchrec_state_dict, save_torchrec_checkpoint

    tables = [TableConfig("plain", 40, 8, ("f",)), TableConfig("rawt", 40, 8, ("g",), ids="raw")]
    ebc = ShardedEmbeddingBagCollection(tables, simple_plan(tables, 1, tier="host"), device="cpu")
    with pytest.raises(ConfigError, match=r"tables \['rawt'\] have ids: raw"):
        load_torchrec_state_dict(ebc, {})
    with pytest.raises(ConfigError, match=r"tables \['rawt'\] have ids: raw"):
        save_torchrec_checkpoint(tmp_path / "ck", ebc)
