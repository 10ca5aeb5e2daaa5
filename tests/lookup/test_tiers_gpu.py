"""Memory tiers on GPU (skipped without CUDA): UVM and UVM-caching tables train exactly like HBM tables and like
the plain-PyTorch reference (several tables and tiers on one rank, LRU and LFU, small caches that evict, explicit
prefetch on the current and on a side stream, cache statistics, fp16 weights, bf16 outputs); a model larger than a
reduced HBM budget trains with UVM-caching; out-of-range ids fail as on CPU.

Run on the device: EMBSHARD_TEST_DEVICE=cuda python -m pytest -q tests/lookup/test_tiers_gpu.py
(the test sets EMBSHARD_TEST_DEVICE=cuda for its own processes if unset).
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import pytest
import torch
from dist_harness import run_distributed
from parity import check_parity, random_batches, to_kjt

from embshard import ConfigError, FusedOptimizerConfig, LookupOptions, ShardingPlan, TableConfig, simple_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TABLES = [
    TableConfig("t_big", 3000, 16, ("f_a", "f_b"), ids_per_bag=4),  # shared by two features
    TableConfig("t_mean", 500, 8, ("f_c",), pooling="mean", ids_per_bag=3),
    TableConfig("t_weighted", 800, 12, ("f_d",), weighted=True, ids_per_bag=4),
    TableConfig("t_wmean", 300, 4, ("f_e",), pooling="mean", weighted=True, ids_per_bag=2),
    TableConfig("t_small", 40, 20, ("f_f",), ids_per_bag=1),
]
FP16_TABLES = [replace(t, data_type="fp16") for t in TABLES]
ROWWISE = FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6)
ADAM = FusedOptimizerConfig("adam", lr=0.05, eps=1e-6)
ADAGRAD = FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6)
ALL_CACHED = {t.name: ("uvm_caching", 0.1, "lru") for t in TABLES}
MIXED = {
    "t_big": ("uvm_caching", 0.05, "lru"),
    "t_mean": ("hbm", 0.2, "lru"),
    "t_weighted": ("uvm", 0.2, "lru"),
    "t_wmean": ("uvm_caching", 0.1, "lfu"),
    "t_small": ("uvm_caching", 0.5, "lru"),
}
# name: (tables, optimizer, {table: (tier, cache_load_factor, cache_algorithm)} or a tier, options, driver, atol)
CASES = {
    "hbm": (TABLES, ROWWISE, "hbm", LookupOptions(), "plain", 2e-5),
    "uvm": (TABLES, ROWWISE, "uvm", LookupOptions(), "plain", 2e-5),
    "uvm_caching_lru": (TABLES, ROWWISE, ALL_CACHED, LookupOptions(), "plain", 2e-5),
    "uvm_caching_lfu": (
        TABLES,
        ROWWISE,
        {t: (x, c, "lfu") for t, (x, c, _) in ALL_CACHED.items()},
        None,
        "plain",
        2e-5,
    ),
    "mixed": (TABLES, ROWWISE, MIXED, LookupOptions(), "plain", 2e-5),
    "prefetch": (TABLES, ROWWISE, MIXED | {"t_wmean": ("uvm_caching", 0.1, "lru")}, "prefetch", "prefetch", 2e-5),
    "prefetch_stream": (TABLES, ROWWISE, ALL_CACHED, "prefetch", "prefetch_stream", 2e-5),
    "stats": (TABLES, ROWWISE, ALL_CACHED, LookupOptions(cache_stats=True), "plain", 2e-5),
    "uvm_caching_adam": (TABLES, ADAM, ALL_CACHED, LookupOptions(), "plain", 2e-5),
    "uvm_adagrad": (TABLES, ADAGRAD, "uvm", LookupOptions(), "plain", 2e-5),
    "fp16_uvm_caching": (FP16_TABLES, ROWWISE, ALL_CACHED, LookupOptions(), "plain", 3e-3),
    "fp16_hbm_nearest": (FP16_TABLES, ROWWISE, "hbm", LookupOptions(stochastic_rounding=False), "plain", 3e-3),
    "bf16_out_uvm_caching": (TABLES, ROWWISE, ALL_CACHED, LookupOptions(output_dtype="bf16"), "plain", 3e-2),
}
SAME_AS_HBM = ["uvm", "uvm_caching_lru", "uvm_caching_lfu", "mixed", "prefetch", "prefetch_stream", "stats"]
SEED, STEPS = 11, 4


@pytest.fixture(scope="module", autouse=True)
def cuda_processes():
    old = os.environ.get("EMBSHARD_TEST_DEVICE")
    os.environ["EMBSHARD_TEST_DEVICE"] = "cuda"
    yield
    if old is None:
        del os.environ["EMBSHARD_TEST_DEVICE"]
    else:
        os.environ["EMBSHARD_TEST_DEVICE"] = old


def tiered_plan(tables, world_size: int, tiers) -> ShardingPlan:
    """simple_plan placement with a tier (and cache settings) per table: tiers is a tier name or
    {table: (tier, cache_load_factor, cache_algorithm)}."""
    plan = simple_plan(tables, world_size, tier="hbm")
    if isinstance(tiers, str):
        tiers = {t.name: (tiers, 0.2, "lru") for t in tables}
    table_plans = []
    for tp in plan.tables:
        tier, clf, algo = tiers[tp.table]
        table_plans.append(replace(tp, tier=tier, cache_load_factor=clf, cache_algorithm=algo))
    return ShardingPlan(plan.world_size, plan.local_world_size, tuple(table_plans))


def _options(spec) -> LookupOptions:
    if spec == "prefetch":
        return LookupOptions(prefetch_pipeline=True)
    return spec or LookupOptions()


def _train(rank, world_size, device, name, batch_sizes):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables, opt, tiers, options, driver, _ = CASES[name]
    plan = tiered_plan(tables, world_size, tiers)
    ebc = ShardedEmbeddingBagCollection(tables, plan, opt, device=device, seed=SEED, options=_options(options))
    features = [f for t in tables for f in t.feature_names]
    batches = random_batches(tables, batch_sizes, STEPS, SEED)
    kjts = [to_kjt(per_rank[rank], features[::-1], device) for per_rank, _ in batches]
    stream = torch.cuda.Stream(device) if driver == "prefetch_stream" else None
    handle, outputs = None, []
    for step, (_, upstream) in enumerate(batches):
        got = ebc(kjts[step], prefetched=handle).to_dict()
        if driver != "plain" and step + 1 < STEPS:
            handle = ebc.prefetch(kjts[step + 1], stream=stream)  # before this step's backward
        loss = sum((got[f].float() * upstream[rank][f].to(device)).sum() for f in features)
        loss.backward()
        outputs.append({f: got[f].detach().float().cpu() for f in features})
    result = {"outputs": outputs}
    if name == "stats":  # before full_weights(): reading weights writes the cache back and empties it
        result["stats"] = ebc.cache_stats(gather=True)
        result["log"] = ebc.format_cache_stats()
        ebc.reset_cache_stats()
        result["after_reset"] = ebc.cache_stats()
    result["weights"] = ebc.full_weights()
    return result


def _main_worker(rank, world_size, device, batch_sizes):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    results = {name: _train(rank, world_size, device, name, batch_sizes) for name in CASES}
    # Out-of-range ids: the same error as on CPU (every rank has one, so every rank raises before any exchange).
    ebc = ShardedEmbeddingBagCollection(TABLES, tiered_plan(TABLES, world_size, ALL_CACHED), ROWWISE, device=device)
    (per_rank, _), *_ = random_batches(TABLES, batch_sizes, 1, 0)
    batch = dict(per_rank[rank])
    lengths, ids, w = batch["f_c"]
    batch["f_c"] = (lengths, torch.where(torch.arange(ids.numel()) == 0, 500 + rank, ids), w)
    try:
        ebc(to_kjt(batch, [f for t in TABLES for f in t.feature_names], device))
        results["error"] = None
    except ValueError as e:
        results["error"] = str(e)
    try:
        ShardedEmbeddingBagCollection(TABLES, simple_plan(TABLES, world_size, tier="host"), ROWWISE, device=device)
        results["host_error"] = None
    except ConfigError as e:
        results["host_error"] = str(e)
    return results


WORLD_SIZES = [n for n in (1, 2) if n <= max(torch.cuda.device_count(), 1)]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def trained(request):
    batch_sizes = [64 + 16 * r for r in range(request.param)]
    return batch_sizes, run_distributed(_main_worker, request.param, batch_sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_tier_parity_with_reference(trained, name):
    batch_sizes, results = trained
    tables, opt, _, _, _, atol = CASES[name]
    check_parity([r[name] for r in results], tables, opt, batch_sizes, STEPS, SEED, atol=atol)


@pytest.mark.parametrize("name", SAME_AS_HBM)
def test_tiers_match_hbm(trained, name):
    _, results = trained
    for r in results:
        for step, (got, want) in enumerate(zip(r[name]["outputs"], r["hbm"]["outputs"])):
            for f in want:
                torch.testing.assert_close(
                    got[f], want[f], atol=1e-6, rtol=1e-6, msg=lambda m, c=f"{name} step {step} {f}": f"{c}: {m}"
                )
        for t in TABLES:
            torch.testing.assert_close(
                r[name]["weights"][t.name],
                r["hbm"]["weights"][t.name],
                atol=1e-6,
                rtol=1e-6,
                msg=lambda m, c=f"{name} weights of {t.name}": f"{c}: {m}",
            )


def test_cache_stats(trained):
    batch_sizes, results = trained
    case = results[0]["stats"]
    stats = case["stats"]
    print("\n" + case["log"])
    assert set(stats) == {t.name for t in TABLES}
    batches = random_batches(TABLES, batch_sizes, STEPS, SEED)
    for t in TABLES:
        s = stats[t.name]
        want = sum(int(b[f][1].numel()) for per_rank, _ in batches for b in per_rank for f in t.feature_names)
        assert s["requested"] == want, (t.name, s)
        assert 0 < s["unique_misses"] <= s["requested"] and 0.0 <= s["hit_rate"] < 1.0
        # A small table's rows may all have been evicted by the last step's inserts: >= 0 per table, > 0 in total.
        assert 0 <= s["cached_rows"] <= min(s["rows"], s["group_cache_slots"])
        assert s["group_evictions"] is not None and s["group_evictions"] >= 0
    assert sum(s["cached_rows"] for s in stats.values()) > 0, stats
    # The biggest table has ~300 rows of cache and several hundred distinct ids a step: rows were evicted.
    assert stats["t_big"]["group_evictions"] > 0
    after = case["after_reset"]
    assert all(s["requested"] == 0 and s["unique_misses"] == 0 and s["hit_rate"] is None for s in after.values())
    assert all(s["group_evictions"] == 0 for s in after.values())


def _budget_worker(rank, world_size, device, budget_bytes, rows, dim, steps):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    torch.cuda.set_per_process_memory_fraction(budget_bytes / torch.cuda.get_device_properties(device).total_memory)
    tables = [TableConfig(f"big{i}", rows, dim, (f"f{i}",), ids_per_bag=8) for i in range(2)]
    out = {"table_bytes": sum(t.weight_bytes for t in tables)}
    try:
        ShardedEmbeddingBagCollection(tables, tiered_plan(tables, 1, "hbm"), ROWWISE, device=device, seed=None)
        out["hbm_fits"] = True
    except torch.cuda.OutOfMemoryError:
        out["hbm_fits"] = False
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cached = {t.name: ("uvm_caching", 0.01, "lru") for t in tables}
    ebc = ShardedEmbeddingBagCollection(
        tables,
        tiered_plan(tables, 1, cached),
        BUDGET_OPT,
        device=device,
        seed=None,
        options=LookupOptions(cache_stats=True),
    )
    out.update(regression(ebc, tables, rows, steps, device))
    out.update(peak_bytes=torch.cuda.max_memory_allocated(device), stats=ebc.format_cache_stats())
    return out


BUDGET_OPT = FusedOptimizerConfig("sgd", lr=2.0)


def regression(ebc, tables, rows: int, steps: int, device, hot_rows: int = 50_000, B: int = 4096, L: int = 8) -> dict:
    """Train `ebc` to predict, from the sum of a bag's pooled embedding, the sum of hidden scores of its ids (hot
    rows spread over each table). Returns the losses and whether probed rows moved."""
    gen = torch.Generator(device).manual_seed(0)
    hot = (torch.arange(hot_rows, device=device) * 2654435761) % rows
    score = ((torch.arange(hot_rows, device=device) * 40503) % 1000).float() / 1000 - 0.5
    names = [t.feature_names[0] for t in tables]
    probe = hot[:8].tolist()
    before = {n: w[probe].float().cpu() for n, _, w in ebc.local_shards()}
    losses = []
    for _ in range(steps):
        k = torch.randint(0, hot_rows, (len(tables), B * L), device=device, generator=gen)
        kjt = to_kjt({f: (torch.full((B,), L), hot[k[i]].cpu(), None) for i, f in enumerate(names)}, names, device)
        label = score[k].view(len(tables), B, L).sum(-1)
        got = ebc(kjt).to_dict()
        loss = sum(((got[f].sum(1) - label[i]) ** 2).sum() for i, f in enumerate(names)) / B
        loss.backward()
        losses.append(float(loss.detach()))
    moved = all(not torch.equal(before[n], w[probe].float().cpu()) for n, _, w in ebc.local_shards())
    return {"losses": losses, "moved": moved}


def test_uvm_caching_trains_a_model_larger_than_the_hbm_budget():
    budget = 1 << 30
    (res,) = run_distributed(_budget_worker, 1, budget, 4_000_000, 64, 30)
    print(
        f"\nbudget {budget / 2**30:.1f} GiB, tables {res['table_bytes'] / 2**30:.1f} GiB, HBM plan fits: "
        f"{res['hbm_fits']}, UVM-caching peak HBM {res['peak_bytes'] / 2**30:.2f} GiB, loss "
        f"{res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}\n{res['stats']}"
    )
    assert res["table_bytes"] > budget and not res["hbm_fits"]
    assert res["moved"]
    first, last = sum(res["losses"][:3]) / 3, sum(res["losses"][-3:]) / 3
    assert last < 0.5 * first, res["losses"]
