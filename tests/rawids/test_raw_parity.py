"""Parity: a raw-id table whose capacity exceeds its distinct ids trains exactly like a static table fed the same
ids through a fixed vocabulary (the rows the raw-id map gave them), table-wise and row-wise, next to a static
table, at 1 and 2 ranks (gloo on CPU; NCCL with EMBSHARD_TEST_DEVICE=cuda): the same outputs every step, the same
weights and optimizer state after training (rows compared through the map)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind
from parity import to_kjt
from raw_cases import gathered_vocab, id_pools, pool_batches, static_twin, through_vocab, zero_rows

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.spec.plan import MemoryTier

TABLES = [
    TableConfig("r_tw", 64, 8, ("fa", "fb"), ids="raw", ids_per_bag=2),  # shared by two features
    TableConfig("r_rw", 90, 12, ("fc",), ids="raw", pooling="mean", ids_per_bag=3),
    TableConfig("r_w", 40, 4, ("fd",), ids="raw", weighted=True, eviction="lfu"),
    TableConfig("s", 30, 8, ("fe",)),  # a static table in the same collection
]
TYPES = {"r_rw": "row_wise", "r_w": "row_wise"}
POOLS = {"r_tw": 30, "r_rw": 24, "r_w": 12}  # distinct ids: below every block's capacity at 2 ranks
OPTIMIZERS = {
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),  # on the CPU: the host lookup (embedding_bag)
}
STEPS = 4
TOL = {"atol": 0, "rtol": 0} if device_kind() == "cpu" else {"atol": 1e-6, "rtol": 1e-6}  # GPU kernels: no promise


def _train(ebc, batches, rank, device, features, tables, vocab=None):
    outs = []
    gen = torch.Generator().manual_seed(99)
    for per_rank in batches:
        batch = per_rank[rank] if vocab is None else through_vocab(per_rank[rank], tables, vocab)
        out = ebc(to_kjt(batch, features[::-1], device)).to_dict()
        loss = sum((out[f] * torch.randn(out[f].shape, generator=gen).to(device)).sum() for f in features)
        loss.backward()
        outs.append({f: out[f].detach().cpu() for f in features})
    return outs


def _states(ebc) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    return {
        (n, s.row_offset): {k: v.detach().cpu().clone() for k, v in st.items()}
        for n, s, st in ebc.local_optimizer_states()
    }


def _worker(rank, world_size, device, batch_sizes):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    plan = simple_plan(TABLES, world_size, sharding_types=TYPES, tier=tier)
    features = [f for t in TABLES for f in t.feature_names]
    batches = pool_batches(TABLES, id_pools(TABLES, POOLS, 5), batch_sizes, STEPS, seed=11)
    checked = []
    for i, (name, opt) in enumerate(OPTIMIZERS.items()):
        raw = ShardedEmbeddingBagCollection(TABLES, plan, opt, device=device, seed=3 + i)
        out_raw = _train(raw, batches, rank, device, features, TABLES)
        vocab = gathered_vocab(raw)
        stats = raw.raw_id_stats(gather=True)
        static_tables = static_twin(TABLES)
        static = ShardedEmbeddingBagCollection(static_tables, plan, opt, device=device, seed=3 + i)
        out_static = _train(static, batches, rank, device, features, TABLES, vocab)
        for step, (a, b) in enumerate(zip(out_raw, out_static)):
            for f in features:
                torch.testing.assert_close(a[f], b[f], **TOL, msg=lambda m, c=(name, step, f): f"{c}: {m}")
        w_raw, w_static = raw.full_weights(), static.full_weights()
        zero = zero_rows(raw)
        for t in TABLES:
            keep = torch.ones(t.num_embeddings, dtype=torch.bool)
            keep[zero.get(t.name, [])] = False
            torch.testing.assert_close(w_raw[t.name][keep], w_static[t.name][keep], **TOL)
            if t.raw_ids:
                assert torch.count_nonzero(w_raw[t.name][~keep]) == 0, f"{t.name}: zero rows are not zero"
                assert stats[t.name]["evicted"] == 0 and stats[t.name]["resident"] == len(vocab[t.name])
        s_raw, s_static = _states(raw), _states(static)
        for key, st in s_raw.items():
            rows = torch.ones(st[next(iter(st))].shape[0] if st else 0, dtype=torch.bool)
            table = next(t for t in TABLES if t.name == key[0])
            if table.raw_ids and rows.numel():
                rows[-1] = False  # the block's zero row
            for k, v in st.items():
                torch.testing.assert_close(v[rows], s_static[key][k][rows], **TOL)
        checked.append((name, {t: len(v) for t, v in vocab.items()}))
    return checked


@pytest.mark.parametrize("world_size", [1, 2] if device_kind() == "cpu" else [1])
def test_raw_ids_train_like_a_fixed_vocabulary(run, world_size):
    batch_sizes = [5 + r for r in range(world_size)]  # uneven local batches
    results = run(_worker, world_size, batch_sizes)
    for name, sizes in results[0]:
        assert all(n > 0 for n in sizes.values()), (name, sizes)  # every raw table admitted ids
