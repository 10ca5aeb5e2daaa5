"""KernelDataParallelLookup (data-parallel tables on the small-table kernels' forward and dense gradient) against
the plain-PyTorch reference and FBGEMM's DataParallelLookup: one rank for every update rule, two ranks (gloo or
NCCL) for the all-reduced gradient and bitwise identical replicas; a padded batch under `ops.every_id_weighted`
(filler ids of weight 0) trains as the unpadded one."""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind, run_distributed
from kernel_cases import (
    OPTIMIZERS,
    TABLES,
    check_against_reference,
    check_padded_like_unpadded,
    full_shards,
    random_step,
    train_against_reference,
)

from embshard.kernels.data_parallel import KernelDataParallelLookup
from embshard.kernels.small_tables import SmallTableOptions
from embshard.lookup.replicas import DataParallelLookup
from embshard.spec.tables import TableConfig

DEVICE = torch.device(device_kind())
pytestmark = pytest.mark.usefixtures("torch_kernels_on_cpu")  # CPU: the torch path, as CPU training runs
DP_TABLES = sorted(TABLES, key=lambda t: t.embedding_dim)  # DataParallelLookup orders its tables by width


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam", "rowwise_adagrad_wd"])
def test_trains_like_the_reference(opt):
    cfg = OPTIMIZERS[opt]
    make = lambda: KernelDataParallelLookup(full_shards(DP_TABLES, DEVICE), cfg, DEVICE, None, seed=7)
    lookup, ref, outs = train_against_reference(make, DP_TABLES, cfg, DEVICE, steps=3, B=6)
    check_against_reference(lookup, ref, outs, cfg, DP_TABLES, with_state=False)


@pytest.mark.parametrize("opt,deterministic", [("sgd", False), ("adagrad", True), ("rowwise_adagrad", False)])
def test_padded_batch_under_every_id_weighted_trains_like_the_unpadded_one(opt, deterministic):
    # the whole-step graph's padded batches (embshard/training/step_graph.py): filler ids of weight 0, unweighted tables too
    cfg, kernel = OPTIMIZERS[opt], SmallTableOptions(deterministic=deterministic)
    make = lambda: KernelDataParallelLookup(full_shards(DP_TABLES, DEVICE), cfg, DEVICE, None, seed=7, kernel=kernel)
    check_padded_like_unpadded(make, DP_TABLES, DEVICE, exact=DEVICE.type == "cpu")  # the torch path: exact


def test_same_as_fbgemm_data_parallel_with_fp16_tables():
    # fp16 tables form their own (width, data type) blocks in the flat weights: the layouts must agree.
    tables = [*TABLES, TableConfig("th", 20, 8, ("h1",), data_type="fp16"), TableConfig("ti", 15, 4, ("i1",))]
    cfg = OPTIMIZERS["rowwise_adagrad"]
    shards = full_shards(tables, DEVICE)
    mine = KernelDataParallelLookup(shards, cfg, DEVICE, None, seed=5)
    theirs = DataParallelLookup(shards, cfg, DEVICE, None, seed=5)
    assert mine.features == theirs.features
    gen = torch.Generator().manual_seed(3)
    order = {f: t for t in tables for f in t.feature_names}
    ordered = [order[f] for f in mine.features]
    for _ in range(3):
        idx, off, psw, _, up = random_step([TableConfig(t.name, t.num_embeddings, t.embedding_dim, (f,), weighted=t.weighted)
                                            for f, t in zip(mine.features, ordered)], 5, gen)  # fmt: skip
        grad = torch.cat(list(up.values()), dim=1).to(DEVICE)
        outs = []
        for m in (mine, theirs):
            out = m(idx.to(DEVICE), off.to(DEVICE), psw.to(DEVICE))
            (out * grad).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(mine.shard_weights(), theirs.shard_weights()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _two_ranks(rank, world_size, device, steps):
    cfg = OPTIMIZERS["rowwise_adagrad"]
    lookup = KernelDataParallelLookup(full_shards(DP_TABLES, device), cfg, device, None, seed=7)
    gen = torch.Generator().manual_seed(100)
    batches = []
    for _ in range(steps):
        per_rank = [random_step(DP_TABLES, 4, gen) for _ in range(world_size)]
        batches.append(per_rank)
        idx, off, psw, _, up = per_rank[rank]
        out = lookup(idx.to(device), off.to(device), psw.to(device))
        (out * torch.cat(list(up.values()), dim=1).to(device)).sum().backward()
    return [w.cpu() for w in lookup.shard_weights()], batches


@pytest.mark.skipif(DEVICE.type == "cuda" and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_all_reduce_and_stay_identical():
    from reference import ReferenceEBC

    results = run_distributed(_two_ranks, 2, 2)
    (w0, batches), (w1, _) = results
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))  # replicas bitwise identical
    ref = ReferenceEBC(DP_TABLES, OPTIMIZERS["rowwise_adagrad"], seed=7)
    for per_rank in batches:  # the global batch: both ranks' bags, rank 0's first
        batch, upstream = {}, {}
        for f in per_rank[0][3]:
            lengths = torch.cat([r[3][f][0] for r in per_rank])
            ids = torch.cat([r[3][f][1] for r in per_rank])
            w = per_rank[0][3][f][2]
            w = torch.cat([r[3][f][2] for r in per_rank]) if w is not None else None
            batch[f] = (lengths, ids, w)
            upstream[f] = torch.cat([r[4][f] for r in per_rank])
        ref.step(batch, upstream)
    for t, w in zip(DP_TABLES, w0):
        torch.testing.assert_close(w.double(), ref.weights[t.name], atol=2e-5, rtol=1e-4)
