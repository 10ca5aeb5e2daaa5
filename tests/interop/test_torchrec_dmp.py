"""embshard alongside TorchRec on 2 processes (gloo, CPU), one spawn checking:

- plans out: an embshard plan (table-wise, row-wise, column-wise, table-row-wise, data-parallel) converted to
  TorchRec's runs in TorchRec's DistributedModelParallel and, with the same weights, gives the pooled outputs and,
  after row-wise Adagrad steps, the weights of embshard on that plan (column_wise_exact=False: TorchRec's state;
  data-parallel tables: outputs before any update, TorchRec trains its replicas outside FBGEMM);
- checkpoints in from memory: the DMP's state dicts, through torch.save and torch.load, load into embshard on
  another plan (weights; row-wise Adagrad state, a column-wise table's per-block state as its width-weighted mean);
- models and checkpoints in: a TorchRec DLRM trained in DMP and saved with DCP comes into embshard (RecModel, another
  plan) and trains on in embshard's TrainPipeline with TorchRec's losses;
- checkpoints out: embshard's model saved for TorchRec loads into a fresh DMP with the state TorchRec reached;
- the three migration steps of docs/torchrec.md (examples/torchrec/) run as written, in the same processes;
- a checkpoint that does not fit the model raises on every rank; the DMP checkpoint's world size is read from it.
"""

from __future__ import annotations

import io
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import device_kind, run_distributed

from embshard import FusedOptimizerConfig, LookupOptions, simple_plan
from embshard.interop import (
    from_torchrec_plan,
    load_torchrec_checkpoint,
    load_torchrec_state_dict,
    load_weights,
    rec_model_from_torchrec,
    save_torchrec_checkpoint,
    tables_from_torchrec,
    to_torchrec_plan,
)

pytestmark = pytest.mark.skipif(device_kind() != "cpu", reason="TorchRec's DMP on CPU processes (gloo)")
LR, EPS = 0.1, 1e-8
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "torchrec"


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _ebc_configs():
    from torchrec import EmbeddingBagConfig, PoolingType

    shapes = {"t_tw": 20, "t_cw": 15, "t_rw": 23, "t_dp": 10, "t_twrw": 17}
    return [
        EmbeddingBagConfig(
            name=n,
            num_embeddings=r,
            embedding_dim=8,
            feature_names=[f"f_{n[2:]}"],
            # Mean pooling on the table-wise table: in TorchRec 1.8 on the CPU, a mean-pooled row-wise table
            # corrupts the pooled outputs of the table-wise and data-parallel tables of its collection.
            pooling=PoolingType.MEAN if n == "t_tw" else PoolingType.SUM,
        )
        for n, r in shapes.items()
    ]


def _kjt(tables, batch: int, gen: torch.Generator):
    from torchrec import KeyedJaggedTensor

    lengths, values = [], []
    for t in tables:
        for _ in t.feature_names:
            le = torch.randint(0, 4, (batch,), generator=gen, dtype=torch.int32)
            lengths.append(le)
            values.append(torch.randint(0, t.num_embeddings, (int(le.sum()),), generator=gen))
    keys = [f for t in tables for f in t.feature_names]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _dmp_full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a DMP state dict assembled whole on every rank (ShardedTensors from every rank's shards)."""
    local = {}
    for key, v in state.items():
        if hasattr(v, "local_shards"):
            local[key] = (tuple(v.size()), [(s.metadata.shard_offsets, s.tensor.clone()) for s in v.local_shards()])
        else:
            local[key] = (tuple(v.shape), [([0] * v.dim(), v.detach().clone())])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    out = {}
    for rank_state in everyone:  # a rank's fused optimizer lists only the tables it holds shards of
        for key, (size, parts) in rank_state.items():
            full = out.setdefault(key, torch.zeros(size))
            for off, t in parts:
                full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
    return out


def _with_optimizer(module):
    """`module` with TorchRec's row-wise Adagrad applied in backward to its EmbeddingBagCollection."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embshard.interop.model_in import find_ebc

    apply_optimizer_in_backward(RowWiseAdagrad, find_ebc(module)[1].parameters(), {"lr": LR, "eps": EPS})
    return module


def _dmp(module, tr_plan):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return DistributedModelParallel(_with_optimizer(module), device=torch.device("cpu"), plan=tr_plan)


def _plans_out(rank: int, world: int) -> dict:
    """The embshard plan in TorchRec's DMP: outputs and weights against embshard; the DMP state into another plan."""
    from torchrec import EmbeddingBagCollection

    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    configs = _ebc_configs()
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    tables = tables_from_torchrec(reference)
    types = {"t_cw": "column_wise", "t_rw": "row_wise", "t_dp": "data_parallel", "t_twrw": "table_row_wise"}
    plan = simple_plan(tables, world, sharding_types=types)
    tr_plan, notes = to_torchrec_plan(plan, "", "cpu", tables=reference)
    dmp = _dmp(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), tr_plan)
    full = {n: b.weight.detach() for n, b in reference.embedding_bags.items()}
    with torch.no_grad():  # TorchRec's own state dict: each local shard gets its block of the reference weights
        for key, v in dmp.state_dict().items():
            w = full[key.split(".")[-2]]
            for s in v.local_shards() if hasattr(v, "local_shards") else []:
                (r, c), (n, m) = s.metadata.shard_offsets, s.metadata.shard_sizes
                s.tensor.copy_(w[r : r + n, c : c + m])
            if not hasattr(v, "local_shards"):
                v.copy_(w)
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=LR, eps=EPS)
    ours = ShardedEmbeddingBagCollection(
        tables, plan, opt, device=torch.device("cpu"), options=LookupOptions(column_wise_exact=False)
    )
    load_weights(ours, full)
    gen = torch.Generator().manual_seed(10 + rank)
    outs = []
    for _ in range(3):
        kjt = _kjt(tables, 4, gen)  # TorchRec needs one batch size on every rank
        theirs_kt, ours_kt = dmp(kjt), ours(kjt)
        outs.append((theirs_kt.to_dict(), {k: v.detach() for k, v in ours_kt.to_dict().items()}))
        upstream = torch.randn(ours_kt.values().shape, generator=gen)
        (theirs_kt.values() * upstream).sum().backward()
        (ours_kt.values() * upstream).sum().backward()
    theirs_state = dmp.state_dict()
    theirs_optim = dmp.fused_optimizer.state_dict()
    # Into another plan (types moved, the column-wise table table-wise: per-row state from the per-block ones).
    moved = {"t_tw": "row_wise", "t_rw": "column_wise", "t_dp": "table_wise", "t_twrw": "table_wise"}
    other = ShardedEmbeddingBagCollection(
        tables, simple_plan(tables, world, sharding_types=moved), opt, seed=5, device=torch.device("cpu")
    )
    saved = io.BytesIO()  # as torch.save of every rank's state dicts to a file of its own, and torch.load
    torch.save({"model": theirs_state, "optim": theirs_optim}, saved)
    saved.seek(0)
    reloaded = torch.load(saved, weights_only=False)  # ShardedTensors again (this rank's shards)
    in_notes = load_torchrec_state_dict(other, reloaded["model"], reloaded["optim"])
    states = {}
    for owner in (ours, other):
        got = {}
        for name, s, st in owner.local_optimizer_states():
            got.setdefault(name, []).append((s.row_offset, s.col_offset, st["m"].clone()))
        gathered = [None] * world
        dist.all_gather_object(gathered, got)
        states[owner is ours] = gathered
    return {
        "outs": outs,
        "notes": notes,
        "round_trip": from_torchrec_plan(tr_plan, "", tables=tables) == plan,
        "theirs": _dmp_full(theirs_state),
        "theirs_m": _dmp_full({k: v for d in theirs_optim["state"].values() for k, v in d.items()}),
        "ours": ours.full_weights(),
        "other": other.full_weights(),
        "ours_m": states[True],
        "other_m": states[False],
        "in_notes": in_notes,
    }


def _dlrm(device: str):
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM, DLRMTrain

    configs = [c for c in _ebc_configs() if c.name in ("t_tw", "t_cw", "t_rw")]
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))
    return DLRMTrain(DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1]))


def _models_and_checkpoints(rank: int, world: int, folder: str) -> dict:
    """TorchRec trains a DLRM 2 steps, saves (DCP), trains 3 more; embshard loads the checkpoint on another plan
    and trains the same 3; embshard's state saved for TorchRec loads into a fresh DMP."""
    import torch.distributed.checkpoint as dcp
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from embshard.data.common import Batch
    from embshard.training.pipeline import TrainPipeline

    tables = tables_from_torchrec(_dlrm("meta").model.sparse_arch.embedding_bag_collection)
    plan = simple_plan(tables, world, sharding_types={"t_cw": "column_wise", "t_rw": "row_wise"})
    path = "model.sparse_arch.embedding_bag_collection"
    tr_plan, _ = to_torchrec_plan(plan, path, "cpu", tables=tables)
    dmp = _dmp(_dlrm("meta"), tr_plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=LR)
    )
    gen = torch.Generator().manual_seed(20 + rank)
    batches = [
        Batch(torch.randn(5, 4, generator=gen), _kjt(tables, 5, gen), torch.randint(0, 2, (5,), generator=gen).float())
        for _ in range(5)
    ]

    def torchrec_step(b: Batch) -> float:
        from torchrec.datasets.utils import Batch as TorchRecBatch

        loss, _ = dmp(TorchRecBatch(dense_features=b.dense, sparse_features=b.sparse, labels=b.labels))
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        return float(loss)

    for b in batches[:2]:
        torchrec_step(b)
    ckpt = os.path.join(folder, "torchrec")
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=ckpt)
    theirs = [torchrec_step(b) for b in batches[2:]]

    # embshard: the same DLRM (meta tables), another placement of the tables; the column-wise table keeps
    # TorchRec's blocks and per-block state, so that its updates are TorchRec's.
    moved = simple_plan(tables, world, sharding_types={"t_cw": "column_wise", "t_tw": "row_wise"})
    model = rec_model_from_torchrec(  # the sparse optimizer: the one applied in backward, row-wise Adagrad
        _with_optimizer(_dlrm("meta").model), moved, torch.device("cpu"), options=LookupOptions(column_wise_exact=False)
    )
    in_notes = load_torchrec_checkpoint(ckpt, model, module_path="model")
    pipeline = TrainPipeline(model, torch.optim.SGD(model.dense_parameters(), lr=LR), mode="sparse_dist")
    source = iter(batches[2:])
    ours = []
    while (done := pipeline.progress(source)) is not None:
        ours.append(float(done.output.loss))
    pipeline.close()

    out_path = os.path.join(folder, "embshard")
    out_notes = save_torchrec_checkpoint(out_path, model, module_path="model", torchrec_plan=tr_plan)
    fresh = _dmp(_dlrm("meta"), tr_plan)
    state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=out_path)
    fresh.load_state_dict(state["model"])

    def flat(m):
        optim = m.fused_optimizer.state_dict()["state"]
        return _dmp_full({**m.state_dict(), **{k: v for d in optim.values() for k, v in d.items()}})

    return {"theirs": theirs, "ours": ours, "dmp": flat(dmp), "fresh": flat(fresh), "notes": in_notes + out_notes}


def _examples(device: torch.device, folder: str) -> dict:
    """examples/torchrec/step1_plan.py, step2_train.py and step3_export.py, in order, in this process."""
    sys.path.insert(0, str(EXAMPLES))
    import step1_plan
    import step2_train
    import step3_export

    out = os.path.join(folder, "examples")
    return {
        "step1": step1_plan.main(out, device),
        "step2": step2_train.main(out, device),
        "step3": step3_export.main(out, device),
    }


def _shape_mismatch(rank: int, world: int, folder: str) -> str | None:
    """A checkpoint whose table 'b' (on rank 1 only) has other rows than the model's: the error on every rank."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.spec.plan import Shard, ShardingPlan, TablePlan
    from embshard.spec.tables import ConfigError, TableConfig

    def collection(b_rows: int) -> ShardedEmbeddingBagCollection:
        tables = [TableConfig("a", 20, 8, ("fa",)), TableConfig("b", b_rows, 8, ("fb",))]
        plan = ShardingPlan(
            world,
            world,
            tuple(
                TablePlan(t.name, "table_wise", "host", (Shard(r, 0, t.num_embeddings, 0, 8),))
                for r, t in enumerate(tables)
            ),
        )
        return ShardedEmbeddingBagCollection(tables, plan, FusedOptimizerConfig("rowwise_adagrad"), device="cpu")

    path = os.path.join(folder, "mismatch")
    save_torchrec_checkpoint(path, collection(30), torchrec_world_size=world)
    try:
        load_torchrec_checkpoint(path, collection(31), torchrec_world_size=world)
    except ConfigError as e:
        return str(e)
    return None


def _worker(rank: int, world: int, device: torch.device, folder: str) -> dict:
    _quiet()
    return {
        "plans": _plans_out(rank, world),
        "models": _models_and_checkpoints(rank, world, folder),
        "examples": _examples(device, folder),
        "mismatch": _shape_mismatch(rank, world, folder),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="module")
def results(folder):
    return run_distributed(_worker, 2, str(folder))


def test_embshard_plan_runs_in_torchrec_dmp(results):
    for rank, r in enumerate(results):
        p = r["plans"]
        assert p["round_trip"]
        for step, (theirs, ours) in enumerate(p["outs"]):
            assert theirs.keys() == ours.keys()
            for k in theirs:
                if k == "f_dp" and step > 0:
                    continue  # TorchRec updates data-parallel replicas its own way (DDP, optimizer outside FBGEMM)
                torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step} {k}")
        assert len(p["theirs"]) == 5
        for key, w in p["theirs"].items():
            name = key.split(".")[-2]
            if name != "t_dp":
                torch.testing.assert_close(p["ours"][name], w, rtol=1e-5, atol=1e-6, msg=f"weights of {name}")
            torch.testing.assert_close(p["other"][name], w, rtol=0, atol=0, msg=f"{name} loaded into another plan")
    assert any("data_parallel" in n for n in results[0]["plans"]["notes"])


def test_torchrec_optimizer_state_into_another_plan(results):
    p = results[0]["plans"]
    theirs = {k.split(".")[0]: v for k, v in p["theirs_m"].items()}  # 't_cw.momentum1' -> TorchRec's state
    per_block = {}
    for rank_states in p["ours_m"]:  # embshard on the same plan, TorchRec's per-block column-wise state
        for name, items in rank_states.items():
            per_block.setdefault(name, []).extend(items)
    cw = sorted(per_block["t_cw"], key=lambda x: x[1])
    w2 = 4.0  # TorchRec divides the embeddings' gradients by the world size (2): its sums of squares are / 4
    torch.testing.assert_close(theirs["t_cw"] * w2, torch.cat([m for _, _, m in cw]), rtol=1e-5, atol=1e-6)
    loaded = {}
    for rank_states in p["other_m"]:
        for name, items in rank_states.items():
            for r0, _, m in items:
                loaded.setdefault(name, {})[r0] = m
    widths = [4, 4]  # t_cw's two column blocks (dim 8)
    expected_cw = sum(w / 8 * m for w, (_, _, m) in zip(widths, cw))
    torch.testing.assert_close(loaded["t_cw"][0], expected_cw, rtol=1e-5, atol=1e-6)
    for name in ("t_tw", "t_rw", "t_twrw"):
        got = torch.cat([loaded[name][r0] for r0 in sorted(loaded[name])])
        torch.testing.assert_close(got, theirs[name] * w2, rtol=0, atol=0, msg=name)
    notes = [n for r in results for n in r["plans"]["in_notes"]]
    assert any("t_dp" in n and "zero" in n for n in notes)  # TorchRec keeps no fused state for it


def test_torchrec_dlrm_checkpoint_trains_on_in_embshard(results):
    for r in results:
        m = r["models"]
        assert len(m["ours"]) == 3
        torch.testing.assert_close(torch.tensor(m["ours"]), torch.tensor(m["theirs"]), rtol=1e-5, atol=1e-6)


def test_embshard_checkpoint_loads_into_torchrec_dmp(results):
    m = results[0]["models"]
    assert m["fresh"].keys() == m["dmp"].keys()
    for key, w in m["dmp"].items():
        torch.testing.assert_close(m["fresh"][key], w, rtol=1e-5, atol=1e-6, msg=key)


def test_migration_examples(results, folder):
    plan = results[0]["examples"]["step1"]["plan"]
    types = {t.table: t.sharding_type.value for t in plan.tables}
    assert types == {"user": "column_wise", "item": "row_wise", "category": "table_wise"}  # TorchRec's constraints
    assert (folder / "examples" / "plan.torchrec.json").is_file()
    for r in results:
        steps = r["examples"]
        assert len(steps["step1"]["losses"]) == 4 and len(steps["step2"]["losses"]) == 4
        assert all(math.isfinite(x) for x in steps["step1"]["losses"] + steps["step2"]["losses"])
        assert steps["step3"]["theirs"] == pytest.approx(steps["step3"]["ours"], rel=1e-5)


def test_checkpoint_shape_mismatch_raises_on_every_rank(results):
    """Table 'b' sits on rank 1 only: rank 0, which reads none of it, raises too (the ranks agree first)."""
    for rank, r in enumerate(results):
        assert r["mismatch"] is not None, f"rank {rank} returned normally"
        assert "table 'b'" in r["mismatch"] and "31 rows x 8 columns (found: 30 rows x 8 columns)" in r["mismatch"]


def test_checkpoint_world_size_read_from_the_checkpoint(results, folder):
    """The 2-rank DMP checkpoint (its row-wise table t_rw: one block per rank) in a 1-rank job: TorchRec's state is
    scaled by 2^2 without torchrec_world_size, as with torchrec_world_size=2; a wrong one is refused."""
    from embshard.spec.tables import ConfigError

    def load(**kw) -> dict:
        model = rec_model_from_torchrec(_with_optimizer(_dlrm("meta").model), plan, torch.device("cpu"))
        load_torchrec_checkpoint(folder / "torchrec", model, module_path="model", **kw)
        return {name: st["m"].clone() for name, _, st in model.ebc.local_optimizer_states()}

    tables = tables_from_torchrec(_dlrm("meta").model.sparse_arch.embedding_bag_collection)
    plan = simple_plan(tables, 1)
    read, given, unscaled = load(), load(torchrec_world_size=2), load(gradient_division=False)
    for name in read:
        torch.testing.assert_close(read[name], given[name], rtol=0, atol=0)
        torch.testing.assert_close(read[name], unscaled[name] * 4, rtol=0, atol=0)
        assert unscaled[name].abs().sum() > 0, name  # the steps before the save moved the state
    with pytest.raises(ConfigError, match=r"torchrec_world_size=1 does not fit the checkpoint, saved by 2 ranks"):
        load(torchrec_world_size=1)
