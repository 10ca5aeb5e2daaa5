"""ShardedEmbeddingCollection in one process: its rows and their gradients equal TorchRec's unsharded
EmbeddingCollection's (same weights, same KJT); `padded`; histories over max_length (truncate, error); and the
errors for bad tables, options and batches, each naming what is wrong before any work starts."""

from __future__ import annotations

import os

import pytest
import torch
from seq_cases import TABLES, TIER, plan_for, random_batches, to_kjt

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.collection.sequence import ShardedEmbeddingCollection
from embshard.collection.sharded import ShardedEmbeddingBagCollection
from embshard.spec.tables import ConfigError, check_pooling_kinds

KEYS = ["h_a", "h_a2", "h_b", "h_c", "h_d"]


@pytest.mark.parametrize("dedup", [False, True])
def test_rows_and_gradients_equal_torchrec_embedding_collection(device, dedup):
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    # TorchRec's EmbeddingCollection takes one width for every table
    tables = [TableConfig(t.name, t.num_embeddings, 8, t.feature_names, pooling="none", ids_per_bag=3) for t in TABLES]
    lr = 0.5
    ec = ShardedEmbeddingCollection(
        tables, plan_for(1, 0, tables), FusedOptimizerConfig("sgd", lr=lr), device=device, dedup=dedup
    )
    configs = [
        EmbeddingConfig(
            num_embeddings=t.num_embeddings, embedding_dim=8, name=t.name, feature_names=list(t.feature_names)
        )
        for t in tables
    ]
    ref = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    before = ec.full_weights()
    ref.load_state_dict({f"embeddings.{n}.weight": w.clone() for n, w in before.items()})
    seed = int.from_bytes(os.urandom(3), "little")
    (((batch, grads),),) = random_batches(tables, [6], 1, seed)
    out = ec(to_kjt(batch, KEYS, device))
    want = ref(to_kjt(batch, KEYS, torch.device("cpu")))
    loss = sum((want[f].values() * grads[f]).sum() for f in KEYS)
    loss.backward()
    sum((out[f].values() * grads[f].to(device)).sum() for f in KEYS).backward()
    for f in KEYS:
        assert torch.equal(out[f].lengths().cpu().long(), want[f].lengths().long()), f"seed {seed}: {f} lengths"
        torch.testing.assert_close(out[f].values().detach().cpu(), want[f].values().detach(), msg=f"seed {seed}: {f}")
    after = ec.full_weights()
    for t in tables:  # sgd: the step is exactly lr x the gradient, so the gradients must match
        got_grad = (before[t.name] - after[t.name]) / lr
        want_grad = ref.embeddings[t.name].weight.grad
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5, msg=f"seed {seed}: {t.name} grad")


def test_padded_and_max_length(device):
    tables = [
        TableConfig("cut", 20, 4, ("c",), pooling="none", max_length=2),
        TableConfig("strict", 20, 4, ("s",), pooling="none", max_length=2, length_overflow="error"),
    ]
    ec = ShardedEmbeddingCollection(tables, simple_plan(tables, 1, tier=TIER), device=device)
    w = ec.full_weights()
    batch = {
        "c": (torch.tensor([3, 0, 1]), torch.tensor([1, 2, 3, 4])),
        "s": (torch.tensor([2, 0, 1]), torch.arange(3)),
    }
    out = ec(to_kjt(batch, ["c", "s"], device))
    assert out["c"].lengths().tolist() == [2, 0, 1]
    torch.testing.assert_close(out["c"].values().detach().cpu(), w["cut"][[2, 3, 4]])  # the newest 2 of [1, 2, 3]
    x = out.padded("c", 3).detach().cpu()
    assert x.shape == (3, 3, 4)
    torch.testing.assert_close(x[0, :2], w["cut"][[2, 3]])
    assert not x[0, 2:].any() and not x[1].any() and not x[2, 1:].any()
    batch["s"] = (torch.tensor([0, 3, 0]), torch.arange(3))
    with pytest.raises(ValueError, match=r"feature 's': sample 1 has 3 ids, more than table 'strict'.s max_length=2"):
        ec(to_kjt(batch, ["c", "s"], device))


def test_bad_tables_options_and_batches(device):
    seq = TableConfig("seq", 10, 4, ("hist",), pooling="none")
    pooled = TableConfig("bag", 10, 4, ("hist",))
    with pytest.raises(ConfigError, match="weighted=True is invalid: a sequence table"):
        TableConfig("w", 10, 4, ("f",), pooling="none", weighted=True)
    with pytest.raises(ConfigError, match="max_length=3 is invalid: it applies to sequence tables only"):
        TableConfig("m", 10, 4, ("f",), max_length=3)
    with pytest.raises(ConfigError, match="length_overflow='drop' is invalid"):
        TableConfig("m", 10, 4, ("f",), pooling="none", max_length=3, length_overflow="drop")
    with pytest.raises(ConfigError, match="table 'bag' .pooling sum. is pooled, but ShardedEmbeddingCollection"):
        ShardedEmbeddingCollection([pooled], simple_plan([pooled], 1, tier=TIER), device=device)
    with pytest.raises(ConfigError, match="table 'seq' .pooling none. is a sequence table, but ShardedEmbeddingBag"):
        ShardedEmbeddingBagCollection([seq], simple_plan([seq], 1, tier=TIER), device=device)
    with pytest.raises(
        ConfigError, match="feature 'hist' is looked up as a sequence by table 'seq' and pooled by table 'bag'"
    ):
        check_pooling_kinds([seq], True, "the sequence collection", others=[pooled])
    with pytest.raises(ConfigError, match=r"dedup=\['nope'\] names tables \['nope'\]"):
        ShardedEmbeddingCollection([seq], simple_plan([seq], 1, tier=TIER), device=device, dedup=["nope"])
    ec = ShardedEmbeddingCollection([seq], simple_plan([seq], 1, tier=TIER), device=device, dedup=["seq"])
    with pytest.raises(ValueError, match="feature 'hist': id 10 is outside table 'seq'"):
        ec(to_kjt({"hist": (torch.tensor([2]), torch.tensor([3, 10]))}, ["hist"], device))
    with pytest.raises(ConfigError, match=r"missing \['hist'\], not looked up by any table \['other'\]"):
        ec(to_kjt({"other": (torch.tensor([1]), torch.tensor([3]))}, ["other"], device))


def test_a_bad_batch_on_one_rank_stops_every_rank(run):
    from seq_cases import bad_batch_worker

    (e0, n0), (e1, n1) = run(bad_batch_worker, 2)
    assert e1[0] == ("ValueError", e1[0][1]) and "feature 's': sample 0 has 3 ids, more than table 'strict'" in e1[0][1]
    assert e0[0][0] == "BadSequenceBatch" and "ranks [1]" in e0[0][1]
    assert e0[1][0] == "ValueError" and "feature 's': id 20 is outside table 'strict'" in e0[1][1]
    assert e1[1][0] == "BadSequenceBatch" and "ranks [0]" in e1[1][1]
    assert n0 == n1 == 3  # the next good batch trains on both ranks
