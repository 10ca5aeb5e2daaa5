"""Memory tiers without a GPU: the plan's cache fields, grouping shards into TBEs, the TBE settings derived for
each tier (including the FBGEMM arguments for GPU tiers), tier errors, and the lookup options on CPU: fp16 weights,
fp16/bf16 outputs, and out-of-range ids (error, or drop-with-warning parity with a reference fed the clean batch).
With EMBSHARD_TEST_DEVICE=cuda the option cases run on GPUs (hbm tier)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_harness import device_kind, run_distributed
from parity import random_batches, to_kjt
from reference import ReferenceEBC

from embshard import ConfigError, FusedOptimizerConfig, LookupOptions, ShardingPlan, TableConfig, simple_plan
from embshard.lookup import LocalShard, group_shards
from embshard.lookup.settings import TBESettings, tbe_settings
from embshard.spec.plan import CacheAlgorithm, MemoryTier, Shard, TablePlan

# ---- plan: cache fields ----------------------------------------------------------------------------------------
SMALL = [TableConfig("a", 1000, 16, ("fa",)), TableConfig("b", 64, 8, ("fb",))]


def test_plan_cache_fields_round_trip(tmp_path):
    plan = simple_plan(SMALL, 2, tier="uvm_caching")
    tables = tuple(
        TablePlan(t.table, t.sharding_type, t.tier, t.shards, cache_load_factor=0.05 * (i + 1), cache_algorithm="lfu")
        for i, t in enumerate(plan.tables)
    )
    plan = ShardingPlan(plan.world_size, plan.local_world_size, tables)
    assert plan["a"].cache_algorithm is CacheAlgorithm.LFU
    for suffix in ("yaml", "json"):
        path = tmp_path / f"plan.{suffix}"
        plan.save(path)
        assert "lfu" in path.read_text()
        assert ShardingPlan.load(path) == plan
    # A plan written before the field existed loads with the default, lru.
    data = plan.to_dict()
    for t in data["tables"]:
        del t["cache_algorithm"]
    assert ShardingPlan.from_dict(data)["b"].cache_algorithm is CacheAlgorithm.LRU


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cache_algorithm="mru"), r"table 'a'.*cache_algorithm='mru' is invalid: choose one of \['lru', 'lfu'\]"),
        (dict(cache_load_factor=0.0), r"table 'a'.*cache_load_factor=0.0 is invalid: it must be a number in \(0, 1\]"),
        (dict(cache_load_factor=1.5), r"cache_load_factor=1.5 is invalid"),
        (dict(cache_load_factor="0.2"), r"cache_load_factor='0.2' is invalid"),
    ],
)
def test_plan_cache_field_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TablePlan("a", "table_wise", "uvm_caching", (Shard(0, 0, 10, 0, 4),), **kwargs)


# ---- grouping and settings -------------------------------------------------------------------------------------
def _shard(name, rows, dim, tier, *, dtype="fp32", weighted=False, clf=0.2, algo="lru", features=None, index=0):
    cfg = TableConfig(name, rows, dim, features or (f"f_{name}",), data_type=dtype, weighted=weighted)
    return LocalShard(cfg, index, Shard(0, 0, rows, 0, dim), cfg.feature_names, MemoryTier(tier), clf, algo)


MIXED = [
    _shard("h1", 100, 8, "hbm"),
    _shard("c1", 1000, 16, "uvm_caching", clf=0.1, features=("x", "y")),
    _shard("u1", 50, 4, "uvm"),
    _shard("h2", 30, 8, "hbm", dtype="fp16"),
    _shard("c2", 333, 32, "uvm_caching", clf=0.5),
    _shard("c3", 200, 8, "uvm_caching", algo="lfu"),
    _shard("h3", 70, 4, "hbm", weighted=True),
    _shard("h4", 40, 12, "hbm"),
]


def test_shards_group_by_tier_type_weighting_and_cache_policy():
    groups = [[s.table.name for s in g] for g in group_shards(MIXED)]
    # One rank holds tables in several tiers at once; caches of one policy share a TBE whatever their size.
    assert groups == [["h1", "h4"], ["c1", "c2"], ["u1"], ["h2"], ["c3"], ["h3"]]


def test_settings_per_tier_on_gpu():
    by_name = {tuple(s.table.name for s in g): tbe_settings(g, LookupOptions(), "cuda") for g in group_shards(MIXED)}
    hbm, cached, uvm, fp16, lfu, weighted = by_name.values()
    assert (hbm.location, uvm.location, cached.location) == ("DEVICE", "MANAGED", "MANAGED_CACHING")
    assert {s.compute_device for s in by_name.values()} == {"CUDA"}
    assert {s.bounds_check_mode for s in by_name.values()} == {"NONE"}  # embshard checks every id before the exchange
    assert fp16.weights_precision == "fp16" and hbm.weights_precision == "fp32"
    assert hbm.cache_rows == 0 and hbm.cache_algorithm is None and not hbm.caching
    # The group's cache holds the rows each table asks for: ceil(1000 * 0.1) + ceil(333 * 0.5) = 100 + 167.
    assert cached.cache_rows == 267 and cached.cache_algorithm == "LRU"
    assert cached.cache_sets(32) == 9 and cached.cache_bytes(32) == 9 * 32 * 32 * 4  # slots as wide as 32 columns
    assert lfu.cache_algorithm == "LFU" and lfu.cache_rows == 40
    assert cached.feature_table_map == (0, 0, 1) and cached.tables == ("c1", "c2")
    assert weighted.rows == (70,) and weighted.dims == (4,)
    assert not cached.prefetch_pipeline and not cached.cache_stats and cached.stochastic_rounding


def test_fbgemm_arguments_of_gpu_tiers():
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm as FbCache
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DEFAULT_ASSOC, ComputeDevice

    opts = LookupOptions(output_dtype="bf16", stochastic_rounding=False, prefetch_pipeline=True, cache_stats=True)
    groups = group_shards(MIXED)
    kw = tbe_settings(groups[1], opts, "cuda").fbgemm_kwargs()
    assert kw["embedding_specs"] == [
        (1000, 16, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA),
        (333, 32, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA),
    ]
    assert kw["feature_table_map"] == [0, 0, 1] and kw["table_names"] == ["c1", "c2"]
    assert kw["cache_algorithm"] is FbCache.LRU and kw["cache_sets"] == -(-267 // DEFAULT_ASSOC)
    assert kw["prefetch_pipeline"] and kw["gather_uvm_cache_stats"] and kw["record_cache_metrics"][1]
    assert kw["output_dtype"] is SparseType.BF16 and kw["weights_precision"] is SparseType.FP32
    assert kw["stochastic_rounding"] is False
    kw = tbe_settings(groups[3], opts, "cuda").fbgemm_kwargs()
    assert kw["weights_precision"] is SparseType.FP16 and "cache_sets" not in kw
    assert kw["embedding_specs"][0][2] is EmbeddingLocation.DEVICE
    kw = tbe_settings(groups[2], opts, "cuda").fbgemm_kwargs()
    assert kw["embedding_specs"][0][2] is EmbeddingLocation.MANAGED


def test_settings_on_cpu_and_tier_errors():
    host = [_shard("a", 10, 8, "host", dtype="fp16"), _shard("b", 10, 4, "host", dtype="fp16")]
    s = tbe_settings(host, LookupOptions(output_dtype="bf16"), "cpu")
    assert (s.location, s.compute_device, s.bounds_check_mode) == ("HOST", "CPU", "NONE")
    assert (s.output_dtype, s.cast_output_to) == ("fp32", "bf16")  # FBGEMM's CPU kernel has no bf16 output
    for tier in ("hbm", "uvm", "uvm_caching"):
        with pytest.raises(ConfigError, match=rf"tables \['t'\]: memory tier '{tier}' needs a GPU.*tier 'host'"):
            tbe_settings([_shard("t", 10, 4, tier)], LookupOptions(), "cpu")
    with pytest.raises(ConfigError, match=r"tables \['t'\]: memory tier 'host' is for CPU training.*hbm, uvm or"):
        tbe_settings([_shard("t", 10, 4, "host")], LookupOptions(), "cuda")
    with pytest.raises(ConfigError, match=r"table 't': a shard is 6 columns wide.*multiple of 4"):
        tbe_settings([_shard("t", 10, 6, "hbm")], LookupOptions(), "cuda")
    with pytest.raises(ConfigError, match=r"tables \['t'\] use cache_algorithm 'lfu', but prefetch_pipeline needs"):
        tbe_settings([_shard("t", 10, 4, "uvm_caching", algo="lfu")], LookupOptions(prefetch_pipeline=True), "cuda")
    with pytest.raises(ValueError, match="one group key"):
        tbe_settings(MIXED[:2], LookupOptions(), "cuda")


def test_uvm_tier_on_cpu_module_is_a_clear_error():
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    for tier in ("uvm", "uvm_caching"):
        with pytest.raises(ConfigError, match=rf"memory tier '{tier}' needs a GPU, but this process computes on the"):
            ShardedEmbeddingBagCollection(SMALL, simple_plan(SMALL, 1, tier=tier), device="cpu")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(output_dtype="int8"),
            r"output_dtype='int8' is invalid: choose one of \['fp32', 'fp16', 'bf16', 'auto'\]",
        ),
        (dict(bounds_check="clamp"), r"bounds_check='clamp' is invalid: choose one of \['error', 'drop'\]"),
        (dict(cache_stats=1), r"cache_stats=1 is invalid: it must be true or false"),
    ],
)
def test_lookup_option_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LookupOptions(**kwargs)


# ---- options on CPU, distributed: fp16 weights, fp16/bf16 outputs, out-of-range ids ----------------------------
TABLES = [
    TableConfig("t_big", 97, 16, ("f_a", "f_b"), ids_per_bag=2, data_type="fp16"),
    TableConfig("t_mean", 50, 8, ("f_c",), pooling="mean", ids_per_bag=3),
    TableConfig("t_weighted", 40, 12, ("f_d",), weighted=True, ids_per_bag=2, data_type="fp16"),
    TableConfig("t_wmean", 30, 4, ("f_e",), pooling="mean", weighted=True, ids_per_bag=1),
    TableConfig("t_small", 11, 20, ("f_f",), ids_per_bag=1, data_type="fp16"),
]
FP32_TABLES = [replace(t, data_type="fp32") for t in TABLES]
SGD = FusedOptimizerConfig("sgd", lr=0.1)
ROWWISE = FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6)
ADAM = FusedOptimizerConfig("adam", lr=0.05, eps=1e-6)
# name: (tables, optimizer, options, corrupt ids, atol)
CASES = {
    "fp16_sgd": (TABLES, SGD, LookupOptions(), False, 3e-3),
    "fp16_rowwise_adagrad": (TABLES, ROWWISE, LookupOptions(), False, 3e-3),
    "fp16_adam_host": (TABLES, ADAM, LookupOptions(), False, 3e-3),
    "out_fp16": (FP32_TABLES, ROWWISE, LookupOptions(output_dtype="fp16"), False, 3e-3),
    "out_bf16": (FP32_TABLES, SGD, LookupOptions(output_dtype="bf16"), False, 2e-2),
    "out_bf16_adam_host": (FP32_TABLES, ADAM, LookupOptions(output_dtype="bf16"), False, 2e-2),
    "drop": (FP32_TABLES, ROWWISE, LookupOptions(bounds_check="drop"), True, 2e-5),
    "drop_adam_host": (FP32_TABLES, ADAM, LookupOptions(bounds_check="drop"), True, 2e-5),
    # The next batch's input exchange (and id check) runs early, between forward and backward of the current one.
    "prefetch_drop": (FP32_TABLES, ROWWISE, LookupOptions(bounds_check="drop", prefetch_pipeline=True), True, 2e-5),
}
if device_kind() == "cuda":  # FBGEMM 1.6's GPU Adam fails on fp16 weights: refused there (see lookup.py)
    del CASES["fp16_adam_host"]
    # On GPU the gradient reaches FBGEMM's Adam in bf16: a near-zero gradient element whose sign differs from the
    # float64 reference moves its weight by one Adam step (lr = 0.05) the other way (seen: 1 element of 96, 0.050).
    CASES["out_bf16_adam_host"] = (FP32_TABLES, ADAM, LookupOptions(output_dtype="bf16"), False, 0.11)
BAD_FEATURES = ("f_a", "f_c", "f_e")  # shared table, mean pooling, weighted mean pooling
STEPS = 3


def corrupt(batches, tables, seed):
    """Replace some ids of BAD_FEATURES on every rank by out-of-range ones (negative and too large)."""
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for per_rank, upstream in batches:
        new_ranks = []
        for batch in per_rank:
            batch = dict(batch)
            for f in BAD_FEATURES:
                lengths, ids, w = batch[f]
                ids = ids.clone()
                pos = torch.randperm(ids.numel(), generator=gen)[: max(1, ids.numel() // 4)]
                ids[pos] = torch.where(torch.rand(pos.numel(), generator=gen) < 0.5, -1 - pos, rows[f] + pos)
                batch[f] = (lengths, ids, w)
            new_ranks.append(batch)
        out.append((new_ranks, upstream))
    return out


def clean(batch, tables):
    """The batch with out-of-range ids (and their weights) removed from their bags."""
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    out = {}
    for f, (lengths, ids, w) in batch.items():
        keep = (ids >= 0) & (ids < rows[f])
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        new_lengths = torch.bincount(bag[keep], minlength=lengths.numel())
        out[f] = (new_lengths, ids[keep], w[keep] if w is not None else None)
    return out


def _options_worker(rank, world_size, device, batch_sizes):
    import warnings

    from embshard.collection.bounds import DroppedIdsWarning
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tier = "host" if device.type == "cpu" else "hbm"  # EMBSHARD_TEST_DEVICE=cuda runs the same cases on GPU
    results = {}
    for i, (name, (tables, opt, options, bad, _)) in enumerate(CASES.items()):
        plan = simple_plan(tables, world_size, tier=tier)
        ebc = ShardedEmbeddingBagCollection(tables, plan, opt, device=device, seed=i, options=options)
        batches = random_batches(tables, batch_sizes, STEPS, seed=i)
        if bad:
            batches = corrupt(batches, tables, seed=100 + i)
        features = [f for t in tables for f in t.feature_names]
        kjts = [to_kjt(per_rank[rank], features[::-1], device) for per_rank, _ in batches]
        outputs, warned, handle = [], [], None
        for step, (_, upstream) in enumerate(batches):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = ebc(kjts[step], prefetched=handle).to_dict()
                if options.prefetch_pipeline and step + 1 < len(kjts):
                    handle = ebc.prefetch(kjts[step + 1])
            warned += [str(w.message) for w in caught if issubclass(w.category, DroppedIdsWarning)]
            loss = sum((got[f].float() * upstream[rank][f].to(device)).sum() for f in features)
            loss.backward()
            outputs.append({f: got[f].detach().cpu() for f in features})
        dtypes = {name: w.dtype for name, _, w in ebc.local_shards()}
        results[name] = dict(
            outputs=outputs, weights=ebc.full_weights(), warned=warned, dropped=ebc.dropped_ids(), dtypes=dtypes
        )
    # Error mode (the default): every rank has a bad id, so every rank raises before any exchange.
    ebc = ShardedEmbeddingBagCollection(
        FP32_TABLES, simple_plan(FP32_TABLES, world_size, tier=tier), SGD, device=device
    )
    (per_rank, _), *_ = corrupt(random_batches(FP32_TABLES, batch_sizes, 1, seed=0), FP32_TABLES, seed=1)
    try:
        ebc(to_kjt(per_rank[rank], [f for t in FP32_TABLES for f in t.feature_names], device))
        results["error"] = None
    except ValueError as e:
        results["error"] = str(e)
    return results


WORLD_SIZES = [1, 2] if device_kind() == "cpu" else [n for n in (1, 2) if n <= torch.cuda.device_count()]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def trained(request):
    batch_sizes = [5 + r for r in range(request.param)]
    return batch_sizes, run_distributed(_options_worker, request.param, batch_sizes)


@pytest.mark.parametrize("case", list(CASES))
def test_options_parity_with_reference(trained, case):
    batch_sizes, results = trained
    tables, opt, options, bad, atol = CASES[case]
    i = list(CASES).index(case)
    batches = random_batches(tables, batch_sizes, STEPS, seed=i)
    if bad:
        batches = corrupt(batches, tables, seed=100 + i)
    ref = ReferenceEBC(tables, opt, seed=i)
    out_dtype = options.output_dtype.torch_dtype
    for step, (per_rank, upstream) in enumerate(batches):
        if bad:
            per_rank = [clean(b, tables) for b in per_rank]
        glob = {
            f: tuple(
                torch.cat([b[f][k] for b in per_rank]) if per_rank[0][f][k] is not None else None for k in range(3)
            )
            for f in per_rank[0]
        }
        want = ref.step(glob, {f: torch.cat([u[f] for u in upstream]) for f in upstream[0]})
        start = 0
        for r, B in enumerate(batch_sizes):
            for f, w in want.items():
                got = results[r][case]["outputs"][step][f]
                assert got.dtype == out_dtype, f"{case}: output dtype {got.dtype}, want {out_dtype}"
                torch.testing.assert_close(got.double(), w[start : start + B], atol=atol, rtol=1e-2)
            start += B
    for r in range(len(batch_sizes)):
        res = results[r][case]
        for t in tables:
            torch.testing.assert_close(res["weights"][t.name].double(), ref.weights[t.name], atol=atol, rtol=1e-2)
            fp16 = t.data_type.value == "fp16"
            if t.name in res["dtypes"] and opt.kind.value != "adam":  # FBGEMM really stores the table's type
                assert res["dtypes"][t.name] == (torch.float16 if fp16 else torch.float32)
            if fp16:  # (HostLookup for Adam keeps fp16 values in fp32 storage)
                assert torch.equal(res["weights"][t.name].half().float(), res["weights"][t.name])
        if bad:
            # Warned once per bad feature (the first batch), and every dropped id counted.
            assert sorted(m.split("'")[1] for m in res["warned"]) == sorted(BAD_FEATURES)
            assert all("train nothing" in m and "dropped_ids()" in m for m in res["warned"])
            want_dropped = {
                f: sum(
                    int(((b[f][1] < 0) | (b[f][1] >= ref_rows(tables, f))).sum()) for b in [pr[r] for pr, _ in batches]
                )
                for f in BAD_FEATURES
            }
            assert res["dropped"] == want_dropped and min(want_dropped.values()) > 0
        else:
            assert res["warned"] == [] and res["dropped"] == {}


def ref_rows(tables, feature):
    return next(t.num_embeddings for t in tables if feature in t.feature_names)


def test_settings_object_is_plain_data():
    # The settings are hashable plain data: a GPU run can print and compare them.
    s = tbe_settings([_shard("t", 10, 4, "uvm_caching")], LookupOptions(), "cuda")
    assert isinstance(s, TBESettings) and hash(s) == hash(
        tbe_settings([_shard("t", 10, 4, "uvm_caching")], LookupOptions(), "cuda")
    )


def test_prefetch_runs_the_input_dist_early_for_every_tier():
    """Without LookupOptions(prefetch_pipeline) prefetch still runs the input dist early (no cache to load); the
    forward of the same kjt picks the pending handle up, once; counts gathered on the host (host_counts) give the
    same result as the device's all-gather; a handle made for another batch is refused."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.sharding.exchange import parse_counts

    plan = simple_plan(FP32_TABLES, 1, tier="host")
    features = [f for t in FP32_TABLES for f in t.feature_names]
    (b0, _), (b1, _) = random_batches(FP32_TABLES, [4], 2, seed=0)
    k0, k1 = to_kjt(b0[0], features, "cpu"), to_kjt(b1[0], features, "cpu")
    ref = ShardedEmbeddingBagCollection(FP32_TABLES, plan, SGD, device="cpu")
    ebc = ShardedEmbeddingBagCollection(FP32_TABLES, plan, SGD, device="cpu")
    with torch.no_grad():
        handle = ebc.prefetch(k0)
        assert ebc.next_prefetch_step == 1
        assert torch.equal(ebc(k0).values(), ref(k0).values()) and handle.used and ebc.next_prefetch_step == 0
        row = ebc.host_counts(k1)
        row[2] = ebc.next_prefetch_step
        handle = ebc.prefetch(k1, counts=parse_counts(row.view(1, -1).numpy()))
        with pytest.raises(ValueError, match="made by prefetch\\(\\) for another batch or was already used"):
            ebc(k0, prefetched=handle)
        assert torch.equal(ebc(k1, prefetched=handle).values(), ref(k1).values())
    with pytest.raises(ConfigError, match="needs a CUDA module"):
        ebc.prefetch(k1, stream=object())
