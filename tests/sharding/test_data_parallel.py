"""Data-parallel update rule against the touched-rows reference, where it is easiest to get wrong: rows that a
batch touches with an exactly zero gradient (upstream gradient 0, per-sample weight 0).

The data-parallel lookup updates every row for sgd, adagrad and rowwise_adagrad without weight decay (a zero
gradient leaves a row as it is under those rules) and masks the update to the touched rows for adam and weight
decay (adam's moments decay on a touched row even when its gradient is 0, so its weight still moves). Both must
agree with the reference, which updates exactly the touched rows. Also: KJT weights given for unweighted features
are ignored (pooled with weight 1). One process, world size 1 (the multi-rank parity is test_sharding_types.py).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind
from reference import ReferenceEBC

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.collection.sharded import ShardedEmbeddingBagCollection
from embshard.spec.plan import MemoryTier, ShardingType

TABLES = [
    TableConfig("d_a", 40, 8, ("z_a", "z_b"), weighted=True),  # z_b: upstream gradient 0
    TableConfig("d_b", 30, 12, ("z_c",)),  # unweighted beside weighted tables: KJT weights must be ignored
    TableConfig("d_c", 25, 8, ("z_d",), pooling="mean"),
]
ID_RANGE = {"z_a": (0, 30), "z_b": (20, 40), "z_c": (0, 30), "z_d": (0, 25)}  # z_b: rows 30-39 zero-gradient only
OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
    "sgd_wd": FusedOptimizerConfig("sgd", lr=0.1, weight_decay=0.05),
    "rowwise_adagrad_wd": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6, weight_decay=0.05),
}
STEPS, B = 4, 6


def _batches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        batch, upstream = {}, {}
        for t in TABLES:
            for f in t.feature_names:
                lengths = torch.randint(0, 5, (B,), generator=gen)
                lo, hi = ID_RANGE[f]
                ids = torch.randint(lo, hi, (int(lengths.sum()),), generator=gen)
                w = torch.rand(ids.numel(), generator=gen) + 0.5
                w[torch.rand(ids.numel(), generator=gen) < 0.25] = 0.0  # zero weights: touched, zero gradient
                batch[f] = (lengths, ids, w)
                grad = torch.randn(B, t.embedding_dim, generator=gen)
                upstream[f] = torch.zeros_like(grad) if f == "z_b" else grad
        out.append((batch, upstream))
    return out


def _kjt(batch, keys, device):
    """The KJT of one of `_batches`' batches, features in the order `keys`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([batch[k][1] for k in keys]).to(device),
        lengths=torch.cat([batch[k][0] for k in keys]).int().to(device),
        weights=torch.cat([batch[k][2] for k in keys]).to(device),
    )


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_zero_gradient_touched_rows_follow_the_reference(opt):
    device = torch.device(device_kind())
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    types = dict.fromkeys([t.name for t in TABLES], ShardingType.DATA_PARALLEL)
    plan = simple_plan(TABLES, 1, sharding_types=types, tier=tier)
    cfg = OPTIMIZERS[opt]
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, cfg, device=device, seed=5)
    ref = ReferenceEBC(TABLES, cfg, seed=5)
    keys = ["z_d", "z_b", "z_c", "z_a"]
    for step, (batch, upstream) in enumerate(_batches(seed=17)):
        got = ebc(_kjt(batch, keys, device)).to_dict()
        sum((got[f] * upstream[f].to(device)).sum() for f in keys).backward()
        want = ref.step(batch, upstream)
        for f in keys:
            torch.testing.assert_close(got[f].cpu().double(), want[f], atol=2e-5, rtol=1e-4, msg=f"step {step} {f}")
    weights = ebc.full_weights()
    for t in TABLES:
        torch.testing.assert_close(weights[t.name].double(), ref.weights[t.name], atol=2e-5, rtol=1e-4, msg=t.name)
    # The case is not vacuous, and the dense update's premise holds: in the reference, dropping the zero-gradient
    # ids (touched rows) changes nothing for the rules updated densely, and changes the result for the others.
    lean = ReferenceEBC(TABLES, cfg, seed=5)
    for batch, upstream in _batches(seed=17):
        lean.step(_without_zero_gradient_ids(batch), upstream)
    same = all(torch.allclose(lean.weights[t.name], ref.weights[t.name], atol=1e-12, rtol=0) for t in TABLES)
    assert same == (cfg.kind.value != "adam" and not cfg.weight_decay)


def _without_zero_gradient_ids(batch):
    """The batch without the ids whose gradient is exactly 0: all of z_b's, and the zero-weight ids of z_a."""
    out = dict(batch)
    lengths, ids, w = batch["z_a"]
    keep = w != 0
    bag = torch.repeat_interleave(torch.arange(B), lengths)
    out["z_a"] = (torch.bincount(bag[keep], minlength=B), ids[keep], w[keep])
    out["z_b"] = (torch.zeros(B, dtype=torch.int64), ids[:0], w[:0])
    return out


def test_exchanges_start_before_the_data_parallel_lookups():
    """In the forward, each scheme's pooled exchange starts right after its own lookup and the data-parallel lookups
    come last (they run beside the exchanges in flight); the outputs keep the features' order and values."""
    device = torch.device(device_kind())
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    types = {"d_a": ShardingType.DATA_PARALLEL, "d_b": ShardingType.TABLE_WISE, "d_c": ShardingType.DATA_PARALLEL}
    plan = simple_plan(TABLES, 1, sharding_types=types, tier=tier)
    cfg = OPTIMIZERS["rowwise_adagrad"]
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, cfg, device=device, seed=5)
    ref = ReferenceEBC(TABLES, cfg, seed=5)
    calls: list[str] = []
    for scheme in ebc.schemes:
        name = type(scheme).__name__
        for method in ("lookup", "start_output_dist"):
            inner = getattr(scheme, method)
            setattr(scheme, method, lambda *a, _f=inner, _n=f"{name}.{method}": (calls.append(_n), _f(*a))[1])
    assert sorted(s.local_output for s in ebc.schemes) == [False, True]
    batch, upstream = _batches(seed=23)[0]
    keys = ["z_d", "z_b", "z_c", "z_a"]
    got = ebc(_kjt(batch, keys, device)).to_dict()
    dp, tw = (type(s).__name__ for s in sorted(ebc.schemes, key=lambda s: not s.local_output))
    assert calls == [f"{tw}.lookup", f"{tw}.start_output_dist", f"{dp}.lookup", f"{dp}.start_output_dist"]
    sum((got[f] * upstream[f].to(device)).sum() for f in keys).backward()
    want = ref.step(batch, upstream)
    for f in keys:
        torch.testing.assert_close(got[f].cpu().double(), want[f], atol=2e-5, rtol=1e-4, msg=f)
