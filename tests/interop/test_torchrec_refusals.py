"""What embshard cannot convert from TorchRec is refused where it is converted, with an error naming the module,
table, file or field: embedding modules other than one plain EmbeddingBagCollection (and at most one plain
EmbeddingCollection beside it), bag tables of pooling NONE (a
sequence collection gives sequence tables, which an embedding-bag collection refuses), plans for other tables,
hand-edited plan files, plans and checkpoints that do not say their world size. And the one thing
TorchRec's collection tolerates that embshard refuses by default: batch features no table uses (an option)."""

from __future__ import annotations

import json

import pytest
import torch

from embshard import FusedOptimizerConfig, LookupOptions, ShardedEmbeddingBagCollection, TableConfig, simple_plan
from embshard.interop import (
    from_torchrec_plan,
    load_torchrec_checkpoint,
    load_torchrec_plan,
    rec_model_from_torchrec,
    save_torchrec_plan,
    tables_from_torchrec,
    to_torchrec_plan,
)
from embshard.spec.plan import Shard, ShardingPlan, TablePlan
from embshard.spec.tables import ConfigError, Pooling

META = torch.device("meta")
TABLES = [TableConfig("a", 40, 8, ("fa",)), TableConfig("b", 30, 8, ("fb",))]


def _bag_configs():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="t", num_embeddings=16, embedding_dim=8, feature_names=["f"])]


class _Holder(torch.nn.Module):
    """A model that keeps its embedding modules under `sparse` (and `seq`), as DLRM keeps its sparse_arch."""

    def __init__(self, sparse: torch.nn.Module, seq: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.sparse = sparse
        if seq is not None:
            self.seq = seq


def test_feature_processed_managed_collision_and_sequence_modules_are_refused():
    from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    cfg = _bag_configs()
    plan = simple_plan(tables_from_torchrec(cfg), 1)
    weighted = EmbeddingBagCollection(tables=cfg, is_weighted=True, device=META)
    fp = FeatureProcessedEmbeddingBagCollection(weighted, PositionWeightedModuleCollection({"f": 4}, device=META))
    mch = MCHManagedCollisionModule(
        zch_size=16, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1
    )
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=cfg, device=torch.device("cpu")), ManagedCollisionCollection({"t": mch}, cfg)
    )
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", num_embeddings=16, embedding_dim=8, feature_names=["g"])], device=META
    )
    two_ecs = _Holder(EmbeddingBagCollection(tables=cfg, device=META), ec)  # one EmbeddingCollection is taken
    two_ecs.seq2 = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s2", num_embeddings=16, embedding_dim=8, feature_names=["g2"])], device=META
    )
    for model, match in (
        (_Holder(fp), r"FeatureProcessedEmbeddingBagCollection at 'sparse'.*feature processors"),
        (_Holder(mc), r"ManagedCollisionEmbeddingBagCollection at 'sparse'.*managed collision"),
        (two_ecs, r"_Holder has 2 EmbeddingCollections \(\['seq', 'seq2'\]\)"),
    ):
        with pytest.raises(ConfigError, match=match + r".*exactly one plain TorchRec EmbeddingBagCollection"):
            rec_model_from_torchrec(model, plan, torch.device("cpu"))
    # A sequence collection or its configs become sequence tables (pooling none), never pooled bags, which an
    # embedding-bag collection refuses.
    for source in (ec, ec.embedding_configs()):
        (table,) = tables_from_torchrec(source)
        assert (table.name, table.pooling, table.feature_names, table.weighted) == ("s", Pooling.NONE, ("g",), False)
        assert (table.num_embeddings, table.embedding_dim) == (16, 8)
    with pytest.raises(
        ConfigError,
        match=r"table 's' \(pooling none\) is a sequence table, but ShardedEmbeddingBagCollection takes only pooled",
    ):
        ShardedEmbeddingBagCollection([table], simple_plan([table], 1), FusedOptimizerConfig(kind="sgd", lr=0.1))
    positions = EmbeddingConfig(name="p", num_embeddings=4, embedding_dim=4, feature_names=["h"], need_pos=True)
    with pytest.raises(ConfigError, match=r"TorchRec table 'p' \(EmbeddingConfig\) has need_pos=True"):
        tables_from_torchrec([positions])
    with pytest.raises(ConfigError, match="not a dict"):
        tables_from_torchrec({"t": 1})


def test_to_torchrec_plan_checks_the_models_tables():
    plan = simple_plan(TABLES, 2)
    to_torchrec_plan(plan, tables=TABLES)  # the model's own tables: fine
    with pytest.raises(ConfigError, match=r"model's tables \['c'\] are not in the plan.*plan's tables \[\] are not"):
        to_torchrec_plan(plan, tables=[*TABLES, TableConfig("c", 5, 8, ("fc",))])
    with pytest.raises(ConfigError, match=r"model's tables \[\] are not in the plan, the plan's tables \['b'\]"):
        to_torchrec_plan(plan, tables=TABLES[:1])
    with pytest.raises(ConfigError, match=r"table 'b' is 30 rows x 8 columns in the plan but 31 x 8 in the TorchRec"):
        to_torchrec_plan(plan, tables=[TABLES[0], TableConfig("b", 31, 8, ("fb",))])
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=d, feature_names=["f" + t.name])
        for t, d in zip(TABLES, (8, 16))
    ]
    theirs = EmbeddingBagCollection(tables=configs, device=META)
    with pytest.raises(ConfigError, match=r"table 'b' is 30 rows x 8 columns in the plan but 30 x 16"):
        to_torchrec_plan(plan, tables=theirs)


def test_plan_files_are_checked_field_by_field(tmp_path):
    path = tmp_path / "plan.torchrec.json"
    save_torchrec_plan(path, simple_plan(TABLES, 2, sharding_types={"a": "row_wise"}), "m", tables=TABLES)
    good = json.loads(path.read_text())
    load_torchrec_plan(path)

    def edited(change) -> str:
        data = json.loads(json.dumps(good))
        change(data)
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as e:
            load_torchrec_plan(path)
        assert str(path) in str(e.value)
        return str(e.value)

    msg = edited(lambda d: d["modules"]["m"]["b"].update(sharding_type="diagonal"))
    assert "modules['m']['b'].sharding_type='diagonal' is invalid" in msg and "'table_wise'" in msg
    assert "modules['m']['a'].ranks is missing" in edited(lambda d: d["modules"]["m"]["a"].pop("ranks"))
    msg = edited(lambda d: d["modules"]["m"]["a"]["shards"][1].update(sizes=[20, "8"]))
    assert "modules['m']['a'].shards[1].sizes=[20, '8'] is invalid" in msg
    assert "world_size='2' is invalid" in edited(lambda d: d.update(world_size="2"))
    assert "shards[0].rank=2 is invalid" in edited(lambda d: d["modules"]["m"]["a"]["shards"][0].update(rank=2))
    assert "compute_kernel='ssd' is invalid" in edited(lambda d: d["modules"]["m"]["b"].update(compute_kernel="ssd"))
    # embshard's own plan files (YAML or JSON)
    ours = tmp_path / "plan.yaml"
    simple_plan(TABLES, 2).save(ours)
    assert ShardingPlan.load(ours) == simple_plan(TABLES, 2)
    ours.write_text(ours.read_text().replace("table_wise", "diagonal", 1))
    with pytest.raises(ConfigError, match=rf"{ours}: .*table 'a' sharding_type='diagonal' is invalid"):
        ShardingPlan.load(ours)
    data = simple_plan(TABLES, 2).to_dict()
    del data["tables"][1]["shards"][0]["num_rows"]
    data["tables"][0]["tier"] = 3
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"plan.json: .*table 'a' tier=3 is invalid: choose one of"):
        ShardingPlan.load(tmp_path / "plan.json")
    data["tables"][0]["tier"] = "hbm"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"table 'b' shards\[0\] lacks \['num_rows'\]"):
        ShardingPlan.load(tmp_path / "plan.json")


def test_torchrec_plan_world_size_is_read_or_required():
    """A TorchRec plan says its world size only through tables spanning every rank (row-wise, data-parallel)."""
    on_rank0 = ShardingPlan(
        2, 2, tuple(TablePlan(t.name, "table_wise", "hbm", (Shard(0, 0, t.num_embeddings, 0, 8),)) for t in TABLES)
    )
    tr_plan, _ = to_torchrec_plan(on_rank0, tables=TABLES)
    with pytest.raises(ConfigError, match=r"does not say its world size \(its tables name ranks \[0\]\).*world_size="):
        from_torchrec_plan(tr_plan)
    assert from_torchrec_plan(tr_plan, world_size=2) == on_rank0
    spanning = simple_plan(TABLES, 4, sharding_types={"a": "row_wise"})
    tr_plan, _ = to_torchrec_plan(spanning, tables=TABLES)
    assert from_torchrec_plan(tr_plan).world_size == 4
    with pytest.raises(ConfigError, match=r"world_size=2 does not fit the plan.*name ranks \[2, 3\]"):
        from_torchrec_plan(tr_plan, world_size=2)


def _save_dcp(path, tensors: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=str(path))


def test_checkpoint_world_size_is_read_or_required(tmp_path):
    """A checkpoint of whole tables (one process wrote it) says nothing of the saving job's world size: it is
    required where there is optimizer state to convert (a 2-rank DMP checkpoint, whose row-wise table says 2:
    tests/interop/test_torchrec_dmp.py)."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables = [TableConfig("a", 6, 4, ("fa",))]
    weight, m = torch.randn(6, 4), torch.rand(6)
    _save_dcp(
        tmp_path / "whole",
        {
            "model": {"embedding_bags.a.weight": weight},
            "optim": {"state": {"embedding_bags.a.weight": {"a.momentum1": m}}},
        },
    )
    opt = FusedOptimizerConfig("rowwise_adagrad")
    ebc = ShardedEmbeddingBagCollection(tables, simple_plan(tables, 1), opt, device="cpu")
    with pytest.raises(ConfigError, match=r"does not say the world size.*torchrec_world_size=W"):
        load_torchrec_checkpoint(tmp_path / "whole", ebc)
    assert not load_torchrec_checkpoint(tmp_path / "whole", ebc, torchrec_world_size=2)
    ((_, _, state),) = ebc.local_optimizer_states()
    torch.testing.assert_close(state["m"], m * 4)  # TorchRec's state of a 2-rank job: / 2^2
    load_torchrec_checkpoint(tmp_path / "whole", ebc, gradient_division=False)
    torch.testing.assert_close(list(ebc.local_optimizer_states())[0][2]["m"], m)
    sgd = ShardedEmbeddingBagCollection(tables, simple_plan(tables, 1), FusedOptimizerConfig("sgd"), device="cpu")
    load_torchrec_checkpoint(tmp_path / "whole", sgd)  # no state to scale: no world size needed
    torch.testing.assert_close(sgd.full_weights()["a"], weight)


def test_unused_batch_features_error_or_ignored():
    from torchrec import KeyedJaggedTensor

    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    lengths = torch.tensor([1, 1, 0, 2, 1, 1], dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["x", "fb", "fa"], values=torch.arange(6), lengths=lengths)
    used = KeyedJaggedTensor.from_lengths_sync(keys=["fb", "fa"], values=torch.arange(2, 6), lengths=lengths[2:])
    plan = simple_plan(TABLES, 1)
    strict = ShardedEmbeddingBagCollection(TABLES, plan, device="cpu")
    with pytest.raises(ConfigError, match=r"not looked up by any table \['x'\].*unused_features='ignore'"):
        strict(kjt)
    lenient = ShardedEmbeddingBagCollection(TABLES, plan, device="cpu", options=LookupOptions(unused_features="ignore"))
    out = lenient(kjt)
    assert out.keys() == ["fa", "fb"]
    torch.testing.assert_close(out.values(), strict(used).values())
    with pytest.raises(ConfigError, match=r"missing \['fa'\]"):  # a table's feature must still be there
        lenient(KeyedJaggedTensor.from_lengths_sync(keys=["x", "fb"], values=torch.arange(3), lengths=lengths[:4]))
    with pytest.raises(ConfigError, match=r"unused_features='drop' is invalid: choose one of \['error', 'ignore'\]"):
        LookupOptions(unused_features="drop")
