"""Sequence tables alongside TorchRec's EmbeddingCollection on 2 processes (gloo, CPU), one call checking:

- plans out: an embshard plan of sequence tables (table-wise, column-wise, row-wise) converted with
  to_torchrec_ec_plan runs in TorchRec's DistributedModelParallel (EmbeddingCollectionSharder) on that placement
  and, from the same weights, gives ShardedEmbeddingCollection's rows per id on the same plan and, after row-wise
  Adagrad steps, its weights (TorchRec 1.8's EmbeddingCollection with a data-parallel table fails on CPU
  processes, so no table is data-parallel here);
- checkpoints in: the DMP's state dicts (torch.save / torch.load of every rank's), and the same saved with DCP,
  load into ShardedEmbeddingCollection on other plans bit-exactly (weights; row-wise Adagrad state at embshard's
  gradient scale), and one more step from there matches TorchRec's next step (the state's scale is right);
- a table-row-wise table is refused for TorchRec's EC sharder, naming it.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from dist_harness import device_kind

from embshard import FusedOptimizerConfig, simple_plan
from embshard.interop import load_torchrec_checkpoint, load_torchrec_state_dict, load_weights, to_torchrec_ec_plan
from embshard.interop.plan_ec import sequence_tables
from embshard.spec.tables import ConfigError

pytestmark = pytest.mark.skipif(device_kind() != "cpu", reason="TorchRec's DMP on CPU processes (gloo)")
LR, EPS = 0.1, 1e-8
SHAPES = {"s_tw": 20, "s_cw": 15, "s_rw": 23, "s_dp": 10}
TYPES = {"s_cw": "column_wise", "s_rw": "row_wise", "s_dp": "table_wise"}
MOVED = {"s_tw": "row_wise", "s_cw": "table_wise", "s_rw": "column_wise", "s_dp": "table_wise"}


def _kjt(gen: torch.Generator):
    from torchrec import KeyedJaggedTensor

    lengths = [torch.randint(0, 4, (4,), generator=gen, dtype=torch.int32) for _ in SHAPES]
    values = [torch.randint(0, r, (int(le.sum()),), generator=gen) for le, r in zip(lengths, SHAPES.values())]
    keys = [f"f_{n}" for n in SHAPES]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a DMP state dict whole on every rank (from every rank's shards)."""
    local = {}
    for key, v in state.items():
        parts = [(s.metadata.shard_offsets, s.tensor.clone()) for s in v.local_shards()] if hasattr(v, "local_shards") else [([0] * v.dim(), v.detach().clone())]  # fmt: skip
        local[key] = (tuple(v.size()), parts)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    out = {}
    for rank_state in everyone:
        for key, (size, parts) in rank_state.items():
            full = out.setdefault(key, torch.zeros(size))
            for off, t in parts:
                full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
    return out


def _states(owner) -> list[dict]:
    got = {}
    for name, s, st in owner.local_optimizer_states():
        got.setdefault(name, []).append((s.row_offset, s.col_offset, st["m"].clone()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, got)
    return gathered


def _step(module, kjt, gen) -> dict[str, torch.Tensor]:
    out = module(kjt)
    values = {f: out[f].values() for f in kjt.keys()}
    ups = {f: torch.randn(v.shape, generator=gen) for f, v in values.items()}
    sum((v * ups[f]).sum() for f, v in values.items()).backward()
    return {f: v.detach().clone() for f, v in values.items()}


def ec_worker(rank: int, world: int, device, folder: str) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embshard.collection.sequence import ShardedEmbeddingCollection

    cpu = torch.device("cpu")
    configs = [EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=8, feature_names=[f"f_{n}"]) for n, r in SHAPES.items()]  # fmt: skip
    torch.manual_seed(0)
    reference = EmbeddingCollection(tables=configs, device=cpu)
    tables = sequence_tables(reference)
    plan = simple_plan(tables, world, sharding_types=TYPES)
    tr_plan, notes = to_torchrec_ec_plan(plan, "", "cpu", tables=reference)
    ec = EmbeddingCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": LR, "eps": EPS})
    dmp = DistributedModelParallel(ec, device=cpu, plan=tr_plan, sharders=[EmbeddingCollectionSharder()])
    full = {n: e.weight.detach() for n, e in reference.embeddings.items()}
    with torch.no_grad():  # each of TorchRec's local shards gets its block of the reference weights
        for key, v in dmp.state_dict().items():
            w = full[key.split(".")[-2]]
            for s in v.local_shards() if hasattr(v, "local_shards") else []:
                (r, c), (n, m) = s.metadata.shard_offsets, s.metadata.shard_sizes
                s.tensor.copy_(w[r : r + n, c : c + m])
            if not hasattr(v, "local_shards"):
                v.copy_(w)
    placed = {
        name: (
            ps.sharding_type,
            sorted({m.placement.rank() for m in ps.sharding_spec.shards}) if ps.sharding_spec else None,
        )  # fmt: skip
        for name, ps in dmp.plan.plan[""].items()
    }
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=LR, eps=EPS)
    ours = ShardedEmbeddingCollection(tables, plan, opt, device=cpu)
    load_weights(ours, full)
    gen = torch.Generator().manual_seed(10 + rank)
    outs = []
    for _ in range(3):
        kjt = _kjt(gen)
        g = gen.get_state()
        theirs_out = _step(dmp, kjt, gen)
        gen.set_state(g)
        outs.append((theirs_out, _step(ours, kjt, gen)))
    theirs_state, theirs_optim = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    saved = io.BytesIO()  # torch.save of every rank's state dicts, torch.load back (ShardedTensors of this rank)
    torch.save({"model": theirs_state, "optim": theirs_optim}, saved)
    saved.seek(0)
    reloaded = torch.load(saved, weights_only=False)
    other = ShardedEmbeddingCollection(tables, simple_plan(tables, world, sharding_types=MOVED), opt, seed=5)
    in_notes = load_torchrec_state_dict(other, reloaded["model"], reloaded["optim"])
    dcp.save({"model": theirs_state, "optim": theirs_optim}, checkpoint_id=folder)
    moved_dcp = {"s_tw": "column_wise", "s_cw": "row_wise", "s_rw": "table_wise", "s_dp": "row_wise"}
    from_dcp = ShardedEmbeddingCollection(tables, simple_plan(tables, world, sharding_types=moved_dcp), opt, seed=7)
    dcp_notes = load_torchrec_checkpoint(folder, from_dcp)
    loaded = {"theirs": _full(theirs_state), "other": other.full_weights(), "dcp": from_dcp.full_weights()}
    loaded["theirs_m"] = _full({k: v for d in theirs_optim["state"].values() for k, v in d.items()})
    loaded["other_m"], loaded["dcp_m"] = _states(other), _states(from_dcp)
    kjt = _kjt(gen)  # one more step on TorchRec and on the loaded collection
    g = gen.get_state()
    _step(dmp, kjt, gen)
    gen.set_state(g)
    _step(other, kjt, gen)
    try:
        to_torchrec_ec_plan(simple_plan(tables, world, sharding_types={"s_rw": "table_row_wise"}), tables=tables)
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    return {
        "outs": outs,
        "notes": notes,
        "placed": placed,
        "plan": {tp.table: (tp.sharding_type.value, sorted({s.rank for s in tp.shards})) for tp in plan.tables},
        "ours": ours.full_weights(),
        "loaded": loaded,
        "in_notes": (in_notes, dcp_notes),
        "next": (_full(dmp.state_dict()), other.full_weights()),
        "refusal": refusal,
    }


def test_torchrec_ec_plans_and_checkpoints(run, tmp_path):
    world = 2
    folder = str(tmp_path / "ec_dcp")
    os.makedirs(folder, exist_ok=True)
    results = run(ec_worker, world, folder)
    r0 = results[0]
    for name, (kind, ranks) in r0["plan"].items():  # TorchRec runs embshard's placement
        assert r0["placed"][name][0] == kind, (name, r0["placed"][name], kind)
        if kind != "data_parallel":
            assert r0["placed"][name][1] == ranks, (name, r0["placed"][name], ranks)
    for rank, r in enumerate(results):
        for step, (theirs, ours) in enumerate(r["outs"]):
            assert theirs.keys() == ours.keys()
            for f in theirs:
                torch.testing.assert_close(ours[f], theirs[f], rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step} {f}")
    loaded = r0["loaded"]
    theirs = {k.split(".")[-2]: v for k, v in loaded["theirs"].items()}
    for name, w in theirs.items():
        torch.testing.assert_close(r0["ours"][name], w, rtol=1e-5, atol=1e-6, msg=f"weights of {name}")
        for how in ("other", "dcp"):  # bit-exact
            assert torch.equal(loaded[how][name], w), f"{name} loaded from the {how} form"
    w2 = float(world) ** 2  # TorchRec's state is at its divided gradients' scale (GRADIENT_DIVISION)
    moment = {k.split(".")[0]: v for k, v in loaded["theirs_m"].items()}  # "T.momentum1"
    for how, moved in (("other_m", MOVED), ("dcp_m", None)):
        got = {}
        for rank_state in loaded[how]:
            for name, parts in rank_state.items():
                for r0_, c0, m in parts:
                    got.setdefault(name, []).append((r0_, c0, m))
        for name in ("s_tw", "s_rw", "s_dp"):
            for r0_, _, m in got[name]:
                assert torch.equal(m, moment[name][r0_ : r0_ + m.numel()] * w2), (how, name)
        if moved is not None:  # s_cw: TorchRec's per-block state, one state per row here: their mean
            rows = SHAPES["s_cw"]
            blocks = moment["s_cw"].view(-1, rows)
            torch.testing.assert_close(got["s_cw"][0][2], blocks.mean(0) * w2, rtol=1e-6, atol=0)
    assert r0["in_notes"] == ([], []), r0["in_notes"]  # every state was in the checkpoint
    after_theirs, after_ours = r0["next"]
    for key, w in after_theirs.items():
        name = key.split(".")[-2]
        if name in ("s_tw", "s_dp"):  # column-wise on one side only: a state per column block on it, updates differ
            torch.testing.assert_close(after_ours[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} one step after loading")
    assert "s_rw (table_row_wise)" in r0["refusal"] and "row_wise" in r0["refusal"]
