"""SmallTableLookup against the plain-PyTorch reference (tests/reference.py) and FBGEMM's TBE, on the test device
(CPU: the torch path; EMBSHARD_TEST_DEVICE=cuda: the Triton kernels). Zipf ids make rows repeat within and across
bags, bags may be empty, weighted and unweighted features mix, features share a table, widths 4/8/12 form three
width groups; heavily skewed ids (Zipf 2.5, bags of up to 60) train every backward variant (atomic with and
without the per-bag dedup, one feature at a time, sorted). The Triton kernels on the CPU (interpreter) are
tests/kernels/test_kernels_interpret.py."""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind
from kernel_cases import (
    OPTIMIZERS,
    TABLES,
    check_against_reference,
    check_padded_like_unpadded,
    full_shards,
    random_step,
    train_against_reference,
)

from embshard.kernels.layout import Tiles, build_layout
from embshard.kernels.small_tables import SmallTableLookup, SmallTableOptions, dense_gradients, pool
from embshard.lookup import LocalShard, TBELookup
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import MemoryTier, Shard
from embshard.spec.tables import ConfigError, TableConfig

DEVICE = torch.device(device_kind())
pytestmark = pytest.mark.usefixtures("torch_kernels_on_cpu")  # CPU: the torch path, as CPU training runs


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("deterministic", [False, True])
def test_trains_like_the_reference(opt, deterministic):
    cfg = OPTIMIZERS[opt]
    kernel = SmallTableOptions(deterministic=deterministic)
    make = lambda: SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, DEVICE, steps=3, B=6)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


SKEW_VARIANTS = {
    "atomic": SmallTableOptions(),
    "atomic-no-dedup": SmallTableOptions(tiles=Tiles(dedup=False)),
    "atomic-one-feature-at-a-time": SmallTableOptions(tiles=Tiles(interleave=1)),
    "atomic-8-id-chunks": SmallTableOptions(tiles=Tiles(bags=2, block_n=8)),
    "sorted": SmallTableOptions(deterministic=True),
}


# On the CPU the torch path serves every atomic variant alike (tiles shape only the Triton kernels, which
# tests/kernels/test_kernels_interpret.py runs under the interpreter): atomic and sorted there, every variant on GPUs.
SKEW_RUN = list(SKEW_VARIANTS) if DEVICE.type == "cuda" else ["atomic", "sorted"]


@pytest.mark.parametrize("variant", SKEW_RUN)
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
def test_heavily_skewed_ids_train_like_the_reference(opt, variant):
    # Zipf(2.5): each table's top row takes most of its ids, many times in every bag and bag chunk
    cfg = OPTIMIZERS[opt]
    make = lambda: SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, seed=7, kernel=SKEW_VARIANTS[variant])
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, DEVICE, steps=3, B=16, alpha=2.5, max_len=60)
    # bags of up to 60 ids, fp32 sums on the device against the float64 reference: the tolerance follows the size of
    # the terms (Adam divides by sqrt(v), so its updates carry the gradients' rounding relative to their size)
    check_against_reference(lookup, ref, outs, cfg, TABLES, scaled=True)


def test_sorted_backward_is_bitwise_reproducible():
    cfg = OPTIMIZERS["rowwise_adagrad"]
    runs = []
    for _ in range(2):
        kernel = SmallTableOptions(deterministic=True)
        lookup = SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, seed=2, kernel=kernel)
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            idx, off, psw, _, up = random_step(TABLES, 32 if DEVICE.type == "cuda" else 8, gen, alpha=2.0, max_len=50)
            out = lookup(idx.to(DEVICE), off.to(DEVICE), psw.to(DEVICE))
            (out * torch.cat(list(up.values()), dim=1).to(DEVICE)).sum().backward()
        runs.append(
            [w.clone() for w in lookup.shard_weights()] + [s["m"].clone() for s in lookup.shard_optimizer_states()]
        )
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_direct_sgd_trains_like_the_reference():
    cfg = OPTIMIZERS["sgd"]
    make = lambda: SmallTableLookup(
        full_shards(TABLES, DEVICE), cfg, DEVICE, seed=7, kernel=SmallTableOptions(direct_sgd=True)
    )
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, DEVICE, steps=3, B=6)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


@pytest.mark.parametrize(
    "opt,kernel",
    [("sgd", SmallTableOptions()), ("adagrad", SmallTableOptions(deterministic=True)),
     ("rowwise_adagrad", SmallTableOptions()), ("rowwise_adagrad", SmallTableOptions(deterministic=True)),
     ("sgd", SmallTableOptions(direct_sgd=True))],
    ids=["sgd", "adagrad-sorted", "rowwise_adagrad", "rowwise_adagrad-sorted", "direct_sgd"],
)  # fmt: skip
def test_padded_batch_under_every_id_weighted_trains_like_the_unpadded_one(opt, kernel):
    # the whole-step graph's padded batches (embshard/training/step_graph.py): filler ids of weight 0, unweighted tables too
    cfg = OPTIMIZERS[opt]
    make = lambda: SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, seed=7, kernel=kernel)
    check_padded_like_unpadded(make, TABLES, DEVICE, exact=DEVICE.type == "cpu")  # the torch path: exact


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_matches_fbgemm_tbe(opt, weighted):
    cfg = OPTIMIZERS[opt]
    tables = [t for t in TABLES if t.weighted == weighted]  # one TBE holds tables of one weighted-ness
    mine = SmallTableLookup(full_shards(tables, DEVICE), cfg, DEVICE, seed=3)
    tbe = TBELookup(full_shards(tables, DEVICE), cfg, DEVICE, seed=3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        idx, off, psw, _, upstream = random_step(tables, 9, gen)
        up = torch.cat(list(upstream.values()), dim=1).to(DEVICE)
        outs = []
        for m in (mine, tbe):
            out = m(idx.to(DEVICE), off.to(DEVICE), psw.to(DEVICE))
            (out * up).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(mine.shard_weights(), tbe.shard_weights()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_row_and_column_blocks_of_a_table():
    # A row block (ids arrive rebased to the block) and two column blocks of one table, rowwise_adagrad keeping
    # one state value per row of each column block: against the reference with the same column blocks.
    from kernel_cases import reference_state
    from reference import ReferenceEBC

    t = TableConfig("t", 30, 8, ("f",))
    cfg = OPTIMIZERS["rowwise_adagrad"]
    tier = MemoryTier.HOST if DEVICE.type == "cpu" else MemoryTier.HBM
    blocks = [Shard(0, 10, 20, 0, 4), Shard(0, 10, 20, 4, 4)]
    lookup = SmallTableLookup([LocalShard(t, 0, s, (f"f#c{s.col_offset}",), tier) for s in blocks], cfg, DEVICE, seed=4)
    ref = ReferenceEBC([t], cfg, seed=4, column_blocks={"t": [4, 4]})
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        lengths = torch.randint(0, 5, (4,), generator=gen)
        ids = torch.randint(10, 30, (int(lengths.sum()),), generator=gen)  # only the block's rows
        up = torch.randn(4, 8, generator=gen)
        want = ref.step({"f": (lengths, ids, None)}, {"f": up})["f"]
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        idx2 = torch.cat([ids - 10, ids - 10])  # both column blocks read the same ids
        off2 = torch.cat([off, off[1:] + off[-1]])
        got = lookup(idx2.to(DEVICE), off2.to(DEVICE))
        (got * up.to(DEVICE)).sum().backward()
        torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-4)
    w = torch.cat([x.cpu().double() for x in lookup.shard_weights()], dim=1)
    torch.testing.assert_close(w, ref.weights["t"][10:30], atol=2e-5, rtol=1e-4)
    states = lookup.shard_optimizer_states()
    for k, st in enumerate(states):
        torch.testing.assert_close(st["m"].cpu().double(), ref.state["t"]["row_sum"][10:30, k], atol=2e-5, rtol=1e-4)
    assert reference_state(ref, cfg, "t")["m"].shape == (30,)


@pytest.mark.parametrize("alpha,max_len", [(1.2, 7), (2.5, 60)])
def test_dense_gradients_match_fbgemm_dense_tbe(alpha, max_len):
    # The data-parallel scheme's layout: FBGEMM's dense TBE with tables ordered by width in one flat tensor.
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    tables = sorted(TABLES, key=lambda t: t.embedding_dim)
    feats = [f for t in tables for f in t.feature_names]
    dims = [t.embedding_dim for t in tables for _ in t.feature_names]
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim) for t in tables],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        use_cpu=DEVICE.type == "cpu",
    ).to(DEVICE)
    table_features, f0 = [], 0
    for t in tables:
        table_features.append(list(range(f0, f0 + len(t.feature_names))))
        f0 += len(t.feature_names)
    layout, place = build_layout(
        [t.num_embeddings for t in tables], [t.embedding_dim for t in tables], table_features,
        [t.weighted for t in tables], dims,
    )  # fmt: skip
    flat = tbe.weights.detach()
    views, e0 = [], 0
    for g in layout.groups:
        views.append(flat[e0 : e0 + g.rows * g.dim].view(g.rows, g.dim))
        e0 += g.rows * g.dim
    assert e0 == flat.numel()
    gen = torch.Generator().manual_seed(8)
    idx, off, psw, _, upstream = random_step(tables, 7, gen, alpha, max_len)
    weighted_per_id = torch.cat(
        [torch.full((int(off[(k + 1) * 7] - off[k * 7]),), float(t.weighted)) for k, t in enumerate(
            [t for t in tables for _ in t.feature_names])]
    )  # fmt: skip
    fb_psw = torch.where(weighted_per_id > 0, psw, 1.0)
    idx, off, psw, fb_psw = (x.to(DEVICE) for x in (idx, off, psw, fb_psw))
    grad_out = torch.cat([upstream[f] for f in feats], dim=1).to(DEVICE)
    pooled = tbe(idx, off, fb_psw)
    torch.testing.assert_close(pool(layout, views, idx, off, psw), pooled.detach(), atol=1e-6, rtol=1e-5)
    (want,) = torch.autograd.grad(pooled, tbe.weights, grad_out)
    for deterministic in (False, True):
        grad = torch.zeros_like(flat)
        gviews, e0 = [], 0
        for g in layout.groups:
            gviews.append(grad[e0 : e0 + g.rows * g.dim].view(g.rows, g.dim))
            e0 += g.rows * g.dim
        dense_gradients(layout, gviews, grad_out, idx, off, psw, SmallTableOptions(deterministic))
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)
    assert place[0] == (0, 0)


def test_empty_batch_and_no_grad():
    cfg = OPTIMIZERS["rowwise_adagrad"]
    lookup = SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, seed=1)
    F = len(lookup.features)
    out = lookup(
        torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.zeros(F * 3 + 1, dtype=torch.int64, device=DEVICE)
    )
    assert out.shape == (3, sum(lookup.dims)) and not out.abs().sum()
    before = [w.clone() for w in lookup.shard_weights()]
    out.sum().backward()  # no ids: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(before, lookup.shard_weights()))
    with torch.no_grad():
        assert not lookup(
            torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
        ).requires_grad


def test_errors_name_the_tables_and_the_fix():
    cfg = FusedOptimizerConfig("rowwise_adagrad")
    fp16 = [TableConfig("h", 10, 8, ("hf",), data_type="fp16")]
    with pytest.raises(ConfigError, match=r"tables \['h'\].*fp32"):
        SmallTableLookup(full_shards(fp16, DEVICE), cfg, DEVICE)
    uvm = [LocalShard(TABLES[1], 0, Shard(0, 0, 30, 0, 12), ("b1",), MemoryTier.UVM)]
    with pytest.raises(ConfigError, match=r"tables \['tb'\].*tier hbm"):
        SmallTableLookup(uvm, cfg, DEVICE)
    with pytest.raises(ConfigError, match="direct_sgd.*rowwise_adagrad"):
        SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE, kernel=SmallTableOptions(direct_sgd=True))
    with pytest.raises(ConfigError, match="impl='cuda'"):
        SmallTableOptions(impl="cuda")
    lookup = SmallTableLookup(full_shards(TABLES, DEVICE), cfg, DEVICE)
    with pytest.raises(ValueError, match="F=5"):
        lookup(torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))
