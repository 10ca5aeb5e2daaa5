"""The Triton kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, so tests/kernels/test_kernels_interpret.py runs this file in its own pytest process; alone:
`TRITON_INTERPRET=1 pytest tests/kernels_interpret_cases.py`). Same cases as the device tests: small tables
against the plain-PyTorch reference (atomic backward with and without the per-bag dedup, interleaved features,
sorted backward, every update rule), heavily skewed ids (one row takes most ids: repeats within a bag chunk, runs
across chunks and across dozens of sorted tiles), int64 sort keys, the sorted mode bitwise reproducible, the dense
gradient against the torch path, a padded batch under `ops.every_id_weighted` (filler ids of weight 0) like the
unpadded one (table-wise and data-parallel), the regroup against torch.cat. Tiles are small (4-8 ids a chunk, 2-4 sorted
positions a tile): hot rows cross chunks and tiles, and the interpreter's sorts stay cheap."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import (
    OPTIMIZERS,
    TABLES,
    check_against_reference,
    check_padded_like_unpadded,
    full_shards,
    random_regroup_case,
    random_step,
    reference_row_gradients,
    regroup_grad_reference,
    regroup_reference,
    train_against_reference,
)

from embshard.kernels.layout import Tiles
from embshard.kernels.small_tables import (
    SmallTableLookup,
    SmallTableOptions,
    dense_gradients,
    pool,
    shards_layout,
)
from embshard.spec.options import LookupOptions
from embshard.spec.tables import TableConfig

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
CPU = torch.device("cpu")
TRITON = SmallTableOptions(impl="triton")
SMALL_TILES = Tiles(bags=2, block_n=4, sorted_block_n=4, interleave=2)  # 5 features: phases of 2, 2 and 1
# one width group of five features (two share a table), two of them weighted: ids ~ Zipf(2.5), bags of up to 24
SKEW_TABLES = [
    TableConfig("sa", 60, 8, ("s1", "s2"), weighted=True),
    TableConfig("sb", 40, 8, ("s3",)),
    TableConfig("sc", 30, 8, ("s4",)),
    TableConfig("sd", 50, 8, ("s5",), weighted=True),
]


@pytest.mark.parametrize(
    "opt,deterministic",
    [("sgd", False), ("rowwise_adagrad", False), ("adagrad", True), ("adam", False)]
    + [("rowwise_adagrad_wd", False), ("sgd_wd", True)],
)  # rowwise_adagrad on the sorted backward: test_triton_default_tiles_train_like_the_reference[True]
def test_triton_trains_like_the_reference(opt, deterministic):
    cfg = OPTIMIZERS[opt]
    kernel = SmallTableOptions(impl="triton", deterministic=deterministic, tiles=SMALL_TILES)
    make = lambda: SmallTableLookup(full_shards(TABLES, CPU), cfg, CPU, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


@pytest.mark.parametrize("deterministic", [False, True])
def test_triton_default_tiles_train_like_the_reference(deterministic):
    # the heuristics' own tile shapes: 4 bags x 32-id chunks (the dedup sorts 32 ids), 64 sorted positions
    cfg = OPTIMIZERS["rowwise_adagrad"]
    kernel = SmallTableOptions(impl="triton", deterministic=deterministic)
    make = lambda: SmallTableLookup(full_shards(TABLES, CPU), cfg, CPU, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, CPU, steps=1, B=5, max_len=40)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


def test_triton_direct_sgd():
    cfg = OPTIMIZERS["sgd"]
    kernel = SmallTableOptions(impl="triton", direct_sgd=True, tiles=SMALL_TILES)
    make = lambda: SmallTableLookup(full_shards(TABLES, CPU), cfg, CPU, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


def test_sorted_backward_is_bitwise_reproducible_and_tiles_do_not_matter():
    cfg = OPTIMIZERS["rowwise_adagrad"]
    runs = []
    for tiles in ({"sorted_block_n": 4}, {"bags": 2, "block_n": 4, "sorted_block_n": 2}, {"sorted_block_n": 4}):
        kernel = SmallTableOptions(impl="triton", deterministic=True, tiles=Tiles(**tiles))
        lookup = SmallTableLookup(full_shards(TABLES[:2], CPU), cfg, CPU, seed=2, kernel=kernel)
        gen = torch.Generator().manual_seed(4)
        for _ in range(1):
            idx, off, psw, _, up = random_step(TABLES[:2], 4, gen)
            (lookup(idx, off, psw) * torch.cat(list(up.values()), dim=1)).sum().backward()
        runs.append([w.clone() for w in lookup.shard_weights()])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))  # bitwise, run to run
    for a, b in zip(runs[0], runs[1]):  # other tiles: same values up to the summation order
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _skewed_gradients(
    tiles: Tiles, deterministic: bool, B: int = 6, max_len: int = 24, alpha: float = 2.5, tables=SKEW_TABLES
):
    """dense_gradients of the Triton kernels on a heavily skewed batch of `tables` (one width group): per table
    (table, gradient, touched marks); the float64 reference gradients; ids per row of each table."""
    layout, place = shards_layout(full_shards(tables, CPU))
    idx, off, psw, _, up = random_step(tables, B, torch.Generator().manual_seed(21), alpha, max_len)
    grad_out = torch.cat(list(up.values()), dim=1)
    (group,) = layout.groups
    g, touched = torch.zeros(group.rows, group.dim), torch.zeros(group.rows, dtype=torch.int8)
    kernel = SmallTableOptions(deterministic, "triton", tiles=tiles)
    dense_gradients(layout, [g], grad_out, idx, off, psw, kernel, [touched])
    want = reference_row_gradients(tables, idx, off, psw, grad_out)
    feats = [(t, f) for t in tables for f in t.feature_names]
    counts = {t.name: torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables}
    for k, (t, _) in enumerate(feats):
        counts[t.name] += torch.bincount(idx[int(off[k * B]) : int(off[(k + 1) * B])], minlength=t.num_embeddings)
    got = [(t, g[r0 : r0 + t.num_embeddings], touched[r0 : r0 + t.num_embeddings]) for t, (_, r0) in
           zip(tables, place)]  # fmt: skip
    return got, want, counts


@pytest.mark.parametrize(
    "tiles",
    [
        Tiles(bags=2, block_n=8, interleave=2),  # chunks of 8 (3 per bag), phases of 2, 2, 1 features
        Tiles(bags=1, block_n=4, interleave=3),
        Tiles(bags=4, block_n=8),  # default interleave: all five features side by side
        Tiles(bags=2, block_n=8, dedup=False, interleave=2),  # one add per id
    ],
    ids=["dedup-8-phases2", "dedup-4-phases3", "dedup-8-all", "no-dedup"],
)
def test_atomic_backward_under_heavy_skew(tiles):
    got, want, counts = _skewed_gradients(tiles, False)
    assert max(int(c.max()) for c in counts.values()) > 40, "a row must repeat within bags and across chunks"
    for t, g, touched in got:
        torch.testing.assert_close(g.double(), want[t.name], atol=1e-5, rtol=1e-5, msg=t.name)
        assert torch.equal(touched != 0, counts[t.name] > 0), t.name


def test_int64_sort_keys_give_the_same_gradients(monkeypatch):
    # tables past int32 keys (rows x chunk >= 2^31) sort int64 keys: forced here by a lower limit
    from embshard.kernels import _grad_triton

    tiles = Tiles(bags=2, block_n=8, interleave=2)
    before, _, _ = _skewed_gradients(tiles, True)
    monkeypatch.setattr(_grad_triton, "KEY32_LIMIT", 16)
    for det in (False, True):
        after, want, counts = _skewed_gradients(tiles, det)
        for (t, g0, _), (_, g1, touched) in zip(before, after):
            torch.testing.assert_close(g1.double(), want[t.name], atol=1e-5, rtol=1e-5, msg=t.name)
            assert torch.equal(touched != 0, counts[t.name] > 0), t.name
            if det:  # the same sort order: the same bits
                assert torch.equal(g0, g1), t.name


def test_sorted_backward_with_rows_across_many_tiles():
    # Zipf(3): a table's top row takes ~80% of its ~160 ids; 2 sorted positions a tile: its run crosses ~65
    # tiles, so the fix-up walks several blocks of 32 tiles. Against the reference, and bitwise equal run to run.
    runs = [_skewed_gradients(Tiles(sorted_block_n=2), True, 4, 40, 3.0, SKEW_TABLES[:2]) for _ in range(2)]
    (got, want, counts), (again, _, _) = runs
    assert int(counts["sa"].max()) > 2 * 33  # the hottest row's run: more than one block of 32 tiles to walk
    for (t, g, _), (_, g2, _) in zip(got, again):
        torch.testing.assert_close(g.double(), want[t.name], atol=1e-5, rtol=1e-5, msg=t.name)
        assert torch.equal(g, g2), t.name


@pytest.mark.parametrize("deterministic", [False, True])
def test_dense_gradients_and_bf16_output_match_the_torch_path(deterministic):
    lookup = SmallTableLookup(full_shards(TABLES, CPU), OPTIMIZERS["sgd"], CPU, seed=3, kernel=TRITON)
    gen = torch.Generator().manual_seed(9)
    idx, off, psw, _, up = random_step(TABLES, 6, gen)
    grad_out = torch.cat(list(up.values()), dim=1)
    weights = [p.detach() for p in lookup.weights]
    grads = {}
    for impl in ("triton", "torch"):
        g = [torch.zeros_like(w) for w in weights]
        touched = [torch.zeros(w.shape[0], dtype=torch.int8) for w in weights]
        kernel = SmallTableOptions(deterministic, impl)
        dense_gradients(lookup.layout, g, grad_out, idx, off, psw, kernel, touched)
        grads[impl] = (g, touched)
        out = pool(lookup.layout, weights, idx, off, psw, torch.bfloat16, kernel)
        assert out.dtype == torch.bfloat16
        grads[impl + "_out"] = out
    for a, b in zip(grads["triton"][0], grads["torch"][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert a.abs().sum() > 0
    for a, b in zip(grads["triton"][1], grads["torch"][1]):
        assert torch.equal(a, b) and a.sum() > 0
    torch.testing.assert_close(grads["triton_out"].float(), grads["torch_out"].float(), atol=1e-2, rtol=1e-2)


def test_output_dtype_option():
    opts = LookupOptions(output_dtype="bf16")
    lookup = SmallTableLookup(full_shards(TABLES, CPU), OPTIMIZERS["sgd"], CPU, seed=3, options=opts, kernel=TRITON)
    idx, off, psw, _, _ = random_step(TABLES, 3, torch.Generator().manual_seed(1))
    assert lookup(idx, off, psw).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seed,n_keys,widths,n_blocks", [(0, 6, (4, 8, 3), 3), (1, 20, (16,), 3), (2, 8, (32, 16, 4), 3), (3, 14, (8,), 10)]
)
def test_triton_regroup(dtype, seed, n_keys, widths, n_blocks):
    # 10 blocks: more tensors than kernel arguments, their addresses go in a table copied to the device
    from embshard.collection.regroup_kernel import KernelRegroup

    keys, dims, groups = random_regroup_case(seed, n_keys, widths, n_blocks)
    gen = torch.Generator().manual_seed(seed)
    B = 5
    blocks = [torch.randn(B, sum(d), generator=gen).to(dtype).requires_grad_(True) for d in dims]
    if seed == 2:  # a block that is a view at an odd element offset: no vector hint (the kernel must see it)
        wide = torch.randn(B, sum(dims[0]) + 1, generator=gen).to(dtype)
        blocks[0] = wide[:, 1:].detach().requires_grad_(True)
    out = KernelRegroup(keys, dims, groups, impl="triton", block_b=4, block_w_bytes=256)(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    for n in groups:
        assert torch.equal(out[n], want[n]), n
    upstream = {n: torch.randn(want[n].shape, generator=gen).to(dtype) for n in groups}
    sum((out[n].float() * upstream[n].float()).sum() for n in groups).backward()
    # fp32: exact. bf16: the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest, exact there,
    # tests/kernels/test_kernels_regroup.py), so a summed duplicate may be one bf16 step off.
    tol = 0 if dtype is torch.float32 else 2**-7
    for b, e in zip(blocks, regroup_grad_reference(upstream, keys, dims, groups, B, dtype)):
        torch.testing.assert_close(b.grad.float(), e.float(), rtol=tol, atol=0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_data_parallel_lookup_on_the_kernels(deterministic):
    from embshard.kernels.data_parallel import KernelDataParallelLookup

    cfg = OPTIMIZERS["adam"]
    tables = sorted(TABLES, key=lambda t: t.embedding_dim)
    kernel = SmallTableOptions(impl="triton", deterministic=deterministic, tiles=SMALL_TILES)
    make = lambda: KernelDataParallelLookup(full_shards(tables, CPU), cfg, CPU, None, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, tables, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, tables, with_state=False)


@pytest.mark.parametrize(
    "scheme,opt,kernel",
    [("table_wise", "rowwise_adagrad", dict(tiles=SMALL_TILES)),
     ("table_wise", "adagrad", dict(tiles=Tiles(bags=2, block_n=4, dedup=False))),
     ("table_wise", "sgd", dict(deterministic=True, tiles=SMALL_TILES)),
     ("table_wise", "sgd", dict(direct_sgd=True, tiles=SMALL_TILES)),
     ("data_parallel", "rowwise_adagrad", dict(tiles=SMALL_TILES))],
    ids=["rowwise_adagrad", "adagrad-no-dedup", "sgd-sorted", "direct_sgd", "data_parallel-rowwise_adagrad"],
)  # fmt: skip
def test_padded_batch_under_every_id_weighted_trains_like_the_unpadded_one(scheme, opt, kernel):
    # every feature pooled with the batch's weights (all-ones per-feature flags), forward and backward
    from embshard.kernels.data_parallel import KernelDataParallelLookup

    cfg, k = OPTIMIZERS[opt], SmallTableOptions(impl="triton", **kernel)
    if scheme == "table_wise":
        tables = TABLES
        make = lambda: SmallTableLookup(full_shards(tables, CPU), cfg, CPU, seed=7, kernel=k)
    else:
        tables = sorted(TABLES, key=lambda t: t.embedding_dim)
        make = lambda: KernelDataParallelLookup(full_shards(tables, CPU), cfg, CPU, None, seed=7, kernel=k)
    # the interpreter runs the programs one after another: atomics add in a fixed order, and exact zeros change no
    # sum; the sorted backward's tiles shift with the fillers (the same sums in other trees)
    check_padded_like_unpadded(make, tables, CPU, exact=not k.deterministic, steps=1, B=3)


def test_triton_regroup_with_an_empty_block():
    # a scheme with no shard on this rank sends a [B, 0] block: it must not cost the vector path or break anything
    from embshard.collection.regroup_kernel import KernelRegroup

    keys, dims = [["a", "b"], [], ["c"]], [[4, 8], [], [4]]
    groups = {"g": ["c", "a"], "h": ["b", "a"]}
    blocks = [torch.randn(3, 12, requires_grad=True), torch.randn(3, 0, requires_grad=True)]
    blocks.append(torch.randn(3, 4, requires_grad=True))
    out = KernelRegroup(keys, dims, groups, impl="triton")(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    assert all(torch.equal(out[n], want[n]) for n in groups)
    sum(o.sum() for o in out.values()).backward()
    assert blocks[1].grad.shape == (3, 0) and torch.equal(blocks[0].grad[:, :4], torch.full((3, 4), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_raw_id_row_reset_kernels_match_init_rows(dtype):
    """The raw-id reset kernels: the listed rows get init_rows' values bit for bit (a column block of a wider table,
    an odd width), their state rows zeros; rows listed as -1 and rows not listed keep their values."""
    from embshard.kernels._reset_triton import reset_weights_, zero_rows_
    from embshard.lookup.shards import init_rows_at, table_key
    from embshard.spec.tables import TableConfig

    cfg = TableConfig("t", 500, 24, ("f",))
    rows, row_offset, col_offset, num_cols = 40, 100, 5, 11
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(rows, num_cols, generator=gen).to(dtype)
    m1, m2 = torch.rand(rows, generator=gen), torch.rand(rows, num_cols, generator=gen)
    before = (w.clone(), m1.clone(), m2.clone())
    listed = torch.tensor([7, -1, 0, 39, -1, 12, 7], dtype=torch.int64)
    reset_weights_(w, listed, row_offset, cfg.embedding_dim, col_offset, table_key(11, 2), cfg.init_bound)
    zero_rows_(m1, listed)
    zero_rows_(m2, listed)
    hit = torch.zeros(rows, dtype=torch.bool)
    hit[listed[listed >= 0]] = True
    want = init_rows_at(cfg, 2, torch.arange(rows) + row_offset, col_offset, num_cols, seed=11).to(dtype)
    assert torch.equal(w[hit], want[hit]) and torch.equal(w[~hit], before[0][~hit])
    assert torch.equal(m1[hit], torch.zeros(int(hit.sum()))) and torch.equal(m1[~hit], before[1][~hit])
    assert not m2[hit].any() and torch.equal(m2[~hit], before[2][~hit])


class _SeparateTensors:
    """A lookup whose shards' weights and state are tensors of their own (reset shard by shard)."""

    def __init__(self, shards):
        from embshard.lookup.shards import init_rows

        self.w = [init_rows(s.table, s.table_index, s.shard.row_offset, s.shard.num_rows, s.shard.col_offset,
                            s.shard.num_cols, 5) for s in shards]  # fmt: skip
        self.st = [{"m": torch.rand(s.shard.num_rows), "v": torch.rand(s.shard.num_rows, 3)[:, 1]} for s in shards]

    def shard_weights(self):
        return self.w

    def shard_optimizer_states(self):
        return self.st


@pytest.mark.parametrize(
    "optimizer,map_kernel", [("rowwise_adagrad", "torch"), ("adagrad", "triton"), ("separate", "torch"),
                             ("separate", "triton")],
)  # fmt: skip
def test_raw_id_map_resets_through_the_batched_kernels_as_through_torch(optimizer, map_kernel, monkeypatch):
    """IdMap.reset on the batched kernels (one launch per storage: a TBE's weights, each optimizer state; shard by
    shard for separate tensors) writes what the torch path writes, bit for bit, over steps that evict (tables of
    different widths and row offsets, weights and state moved between steps as training would). With the map step
    on its kernels, the reset kernels walk the step's list of positions given a row (`Resets.listed`)."""
    from embshard.lookup import TBELookup
    from embshard.lookup.shards import LocalShard
    from embshard.rawids import IdMap
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import Shard

    tables = [TableConfig("a", 60, 8, ("fa",), ids="raw"), TableConfig("b", 90, 16, ("fb",), ids="raw", eviction="lfu")]
    shards = [LocalShard(tables[0], 0, Shard(0, 0, 60, 0, 8), ("fa",), "host"),
              LocalShard(tables[1], 1, Shard(0, 50, 40, 4, 12), ("fb",), "host")]  # fmt: skip
    cpu = torch.device("cpu")
    if optimizer == "separate":
        lookups = [_SeparateTensors(shards) for _ in range(2)]
        lookups[1].st = [{k: v.clone() for k, v in st.items()} for st in lookups[0].st]
    else:
        lookups = [TBELookup(shards, FusedOptimizerConfig(optimizer, lr=0.1), cpu, seed=5) for _ in range(2)]
    maps = [IdMap(shards, cpu, seed=5) for _ in range(2)]
    maps[0].reset_kernel, maps[1].reset_kernel = "triton", "torch"
    maps[0].map_kernel = map_kernel
    monkeypatch.setattr("embshard.rawids.reset.RESET_BLOCK_ELEMENTS", 40)  # the torch path in blocks of 3-5 rows
    gen = torch.Generator().manual_seed(4)
    pool_ids = torch.randint(-(2**62), 2**62, (300,), generator=gen)
    for step in range(7):
        counts = [int(torch.randint(0, 40, (1,), generator=gen)) for _ in shards]
        ids = pool_ids[torch.randint(0, 300, (sum(counts),), generator=gen)]
        rows = [m(ids, counts, lk) for m, lk in zip(maps, lookups)]
        assert torch.equal(rows[0], rows[1]), step
        for lk in lookups:  # training moves the rows and the state
            for w in lk.shard_weights():
                w.add_(0.5)
            for st in lk.shard_optimizer_states():
                for v in st.values():
                    v.add_(0.25)
        got, want = lookups[0], lookups[1]
        for a, b in zip(got.shard_weights(), want.shard_weights()):
            assert torch.equal(a, b), step
        for a, b in zip(got.shard_optimizer_states(), want.shard_optimizer_states()):
            assert all(torch.equal(a[k], b[k]) for k in a), step
    assert sum(s["evicted"] for s in maps[0].stats()) > 10


def test_raw_id_map_runs_on_its_kernels_as_on_torch(monkeypatch):
    """IdMap on its Triton kernels (index lookup: hash, both buckets read; insert: free counts, the q-th free slot;
    the LRU order's partition, in blocks of 16 positions so that blocks straddle segments) gives the torch ops'
    rows and candidate buckets, and two maps driven by them stay equal, over training steps that admit and evict
    (two LRU shards and an LFU one of different sizes, int32 slot rows), evaluation (unknown ids) and a rebuild;
    crowded buckets fill as in torch."""
    from embshard.lookup.shards import LocalShard
    from embshard.rawids import IdMap
    from embshard.spec.plan import Shard

    monkeypatch.setattr("embshard.kernels._idmap_triton.REORDER_BLOCK", 16)
    tables = [TableConfig("a", 70, 4, ("fa",), ids="raw"), TableConfig("b", 33, 4, ("fb",), ids="raw", eviction="lfu"),
              TableConfig("c", 41, 4, ("fc",), ids="raw")]  # fmt: skip
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, 4), t.feature_names, "host")
              for i, t in enumerate(tables)]  # fmt: skip
    maps = [IdMap(shards, CPU, seed=5) for _ in range(2)]
    maps[0].map_kernel, maps[1].map_kernel = "triton", "torch"
    gen = torch.Generator().manual_seed(8)
    pool_ids = torch.randint(-(2**62), 2**62, (250,), generator=gen)
    for step in range(6):
        counts = [int(torch.randint(0, 60, (1,), generator=gen)) for _ in shards]
        ids = pool_ids[torch.randint(0, 250, (sum(counts),), generator=gen)]
        shard = torch.repeat_interleave(torch.arange(len(shards)), torch.tensor(counts))
        found = [m._find(ids, shard) for m in maps]
        assert torch.equal(found[0][0], found[1][0]) and torch.equal(found[0][1], found[1][1]), step
        with torch.no_grad():
            looked = [m.remap(ids, counts, False)[0] for m in maps]
        assert torch.equal(looked[0], looked[1]), step
        rows = [m.remap(ids, counts, True)[0] for m in maps]
        assert torch.equal(rows[0], rows[1]), step
        for b in ("row_key", "row_last", "row_freq", "row_slot", "slot_key", "slot_row"):  # the trash slot aside
            assert torch.equal(getattr(maps[0], b)[:-1], getattr(maps[1], b)[:-1]), (step, b)
        assert torch.equal(maps[0].order, maps[1].order), step
        assert [s == t for s, t in zip(maps[0].stats(), maps[1].stats())] == [True] * len(shards), step
    assert (found[0][0] >= 0).any() and (found[0][0] < 0).any()  # hits and misses
    assert sum(s["evicted"] for s in maps[0].stats()) > 10
    assert maps[0].rebuild() == maps[1].rebuild() == 0
    assert torch.equal(maps[0].slot_row, maps[1].slot_row) and torch.equal(maps[0].order, maps[1].order)
    # crowded buckets: 40 keys (some inactive) all wanting buckets 2 and 5 fill the emptier, then the other, and
    # the last find no slot
    keys = torch.randint(-(2**62), 2**62, (40,), generator=gen)
    cand = torch.tensor([[2, 5] if k % 3 else [5, 2] for k in range(40)])
    active = torch.rand(40, generator=gen) < 0.9
    slots = [m._insert(keys, cand, active, torch.arange(40) + 7) for m in maps]
    assert torch.equal(slots[0], slots[1]) and (slots[0] < 0).any() and (slots[0] // 16 == 2).any()
    assert torch.equal(maps[0].slot_key, maps[1].slot_key) and torch.equal(maps[0].slot_row, maps[1].slot_row)


def test_the_interpreter_sets_the_language_up_once_a_launch(monkeypatch):
    """tests/triton_interpret.py is in place (without it every device-function call of every program walks
    triton.language again: a quarter of an interpreted kernel's CPU): a launch of dozens of programs sets the
    language up once per set of language modules its functions see (triton.language, triton.language.core, both),
    and the gradients still match."""
    import triton_interpret
    from triton.runtime import interpreter

    assert triton_interpret.install()
    walks, launches = [], []
    walk, launch = interpreter._patch_lang.__wrapped__, interpreter.GridExecutor.__call__
    monkeypatch.setattr(interpreter._patch_lang, "__wrapped__", lambda fn: walks.append(fn) or walk(fn))
    monkeypatch.setattr(
        interpreter.GridExecutor, "__call__", lambda g, *a, **k: launches.append(g) or launch(g, *a, **k)
    )
    got, want, _ = _skewed_gradients(Tiles(bags=1, block_n=4, interleave=3), False)  # 6 bags x 5 features: 30 programs
    assert launches and len(walks) <= 3 * len(launches), (len(walks), len(launches))
    for t, g, _ in got:
        torch.testing.assert_close(g.double(), want[t.name], atol=1e-5, rtol=1e-5, msg=t.name)
