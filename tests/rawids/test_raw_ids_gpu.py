"""Raw-id tables on a GPU: the id -> row map's step (training and evaluation; its Triton kernels for the index and
the LRU order) and the resets run with no host sync (CUDA's sync debug mode set to error), give what the same map
computes on the CPU (torch ops), and a whole lookup stage of a raw-id collection (forward after its prefetched
input exchange, then backward) syncs no more than a static one's. CUDA only (EMBSHARD_TEST_DEVICE=cuda)."""

from __future__ import annotations

import warnings

import pytest
import torch
from suite_plugin import cuda_only

from embshard.lookup.shards import LocalShard
from embshard.rawids import IdMap
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import Shard
from embshard.spec.tables import TableConfig

TABLES = [
    TableConfig("a", 300, 16, ("fa",), ids="raw"),
    TableConfig("b", 200, 8, ("fb", "fc"), ids="raw", eviction="lfu", admit_min_count=2),
]


def _map(device: torch.device) -> IdMap:
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, t.embedding_dim), t.feature_names, "hbm")
              for i, t in enumerate(TABLES)]  # fmt: skip
    return IdMap(shards, device, seed=3)


def _stream(steps: int):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(-(2**62), 2**62, (2000,), generator=gen)
    for _ in range(steps):
        counts = [int(torch.randint(1, 400, (1,), generator=gen)) for _ in TABLES]
        pos = (torch.rand(sum(counts), generator=gen) ** 2 * len(pool)).long()
        yield pool[pos], counts


@cuda_only
def test_map_step_has_no_host_sync_and_matches_the_cpu(monkeypatch):
    from embshard.lookup import TBELookup

    monkeypatch.setattr("embshard.kernels._idmap_triton.REORDER_BLOCK", 64)  # the LRU order: blocks straddle shards

    dev = torch.device("cuda", 0)
    gpu, cpu = _map(dev), _map(torch.device("cpu"))
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    lookup = TBELookup(gpu.shards, opt, dev, seed=3)
    batches = [(ids.to(dev), ids, counts) for ids, counts in _stream(12)]
    gpu(batches[0][0], batches[0][2], lookup)  # warm-up: constant tensors made once
    cpu.remap(batches[0][1], batches[0][2], True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [gpu(ids_d, counts, lookup) for ids_d, _, counts in batches[1:]]
        with torch.no_grad():
            evaluated = gpu(batches[0][0], batches[0][2], lookup)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for rows, (_, ids, counts) in zip(got, batches[1:]):
        want, _ = cpu.remap(ids, counts, True)
        assert torch.equal(rows.cpu(), want)
    with torch.no_grad():
        want, _ = cpu.remap(batches[0][1], batches[0][2], False)
    assert torch.equal(evaluated.cpu(), want)
    assert gpu.stats() == cpu.stats()


def _count_syncs(fn) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.current_stream().synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _lookup_stage_syncs(rank, world_size, device):
    from parity import to_kjt
    from raw_cases import id_pools, pool_batches, static_twin

    from embshard import simple_plan
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables = [TableConfig("tw", 500, 16, ("f0", "f1"), ids="raw"), TableConfig("rw", 400, 8, ("f2",), ids="raw")]
    plan = simple_plan(tables, world_size, sharding_types={"rw": "row_wise"}, tier="hbm")
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    batches = pool_batches(tables, id_pools(tables, {"tw": 600, "rw": 600}, 1), [64] * world_size, 6, seed=2)
    features = ["f0", "f1", "f2"]
    out = {}
    for kind, tabs in (("static", static_twin(tables)), ("raw", tables)):
        ebc = ShardedEmbeddingBagCollection(tabs, plan, opt, device=device, seed=0)
        syncs = []
        for per_rank in batches:
            batch = per_rank[rank]
            if kind == "static":
                batch = {f: (le, ids.remainder(400), w) for f, (le, ids, w) in batch.items()}
            kjt = to_kjt(batch, features, device)
            handle = ebc.prefetch(kjt)  # the input exchange and its counts (host syncs by design)

            def step(ebc=ebc, kjt=kjt, handle=handle):
                ebc(kjt, prefetched=handle).values().sum().backward()

            syncs.append(_count_syncs(step))
        out[kind] = syncs
    return out


@cuda_only
def test_lookup_stage_of_raw_tables_adds_no_host_sync(run):
    for res in run(_lookup_stage_syncs, min(2, torch.cuda.device_count())):
        # from the second step on (the first compiles the remap kernels and uploads their constants, once)
        assert all(r <= s for r, s in zip(res["raw"][1:], res["static"][1:])), res  # raw-id tables add none


@cuda_only
@pytest.mark.parametrize("seed", [3, None])
def test_graphed_steps_match_eager_steps(seed, monkeypatch):
    """A map's training steps replayed from its CUDA graph (remap, LRU order, reset; ids padded to the capacity)
    give the eager steps' rows, map state, statistics, clocks, and reset weights and optimizer state, over steps
    of changing sizes (a step of no ids, one over the capacity: captured again), with no host sync outside the
    captures. seed None: the stream keys drawn per step reach the graph (both maps draw the same under one seed)."""
    from embshard.lookup import TBELookup
    from embshard.rawids.graph import step_capacity

    monkeypatch.setattr("embshard.kernels._idmap_triton.REORDER_BLOCK", 64)  # the LRU order: blocks straddle shards
    dev = torch.device("cuda", 0)
    tables = [TableConfig("a", 300, 16, ("fa",), ids="raw"), TableConfig("b", 200, 8, ("fb", "fc"), ids="raw")]
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, t.embedding_dim), t.feature_names, "hbm")
              for i, t in enumerate(tables)]  # fmt: skip
    maps = [IdMap(shards, dev, seed=seed) for _ in range(2)]
    maps[1].graphed = False
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    lookups = [TBELookup(shards, opt, dev, seed=3) for _ in range(2)]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh ids every run
    pool = torch.randint(-(2**62), 2**62, (1500,), generator=gen)
    sizes = [300, 120, 290, 0, 40, 333, 500, 100, 480, 7, 250, 500, 60, 300, 200, 450, 90, 10, 380, 500]
    capacity = 0
    for step, n in enumerate(sizes):
        a = int(torch.randint(0, n + 1, (1,), generator=gen))
        counts = [a, n - a]
        ids = pool[(torch.rand(n, generator=gen) ** 2 * len(pool)).long()].to(dev)
        captures = n > capacity
        capacity = step_capacity(n) if captures else capacity
        torch.manual_seed(step)
        torch.cuda.set_sync_debug_mode(0 if captures else "error")
        try:
            got = maps[0](ids, counts, lookups[0])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.manual_seed(step)
        want = maps[1](ids, counts, lookups[1])
        assert torch.equal(got, want), step
        for b in ("row_key", "row_last", "row_freq", "row_slot", "slot_key", "slot_row"):  # the trash slot aside
            assert torch.equal(getattr(maps[0], b)[:-1], getattr(maps[1], b)[:-1]), (step, b)
        assert torch.equal(maps[0].order, maps[1].order) and torch.equal(maps[0].clock_t, maps[1].clock_t), step
        assert maps[0].clock == maps[1].clock == int(maps[0].clock_t) and maps[0].stats() == maps[1].stats(), step
        weights = [[w.data for w in lk.shard_weights()] for lk in lookups]
        states = [[v.data for st in lk.shard_optimizer_states() for v in st.values()] for lk in lookups]
        for t0, t1 in [*zip(*weights), *zip(*states)]:
            assert torch.equal(t0, t1), step
            t0.add_(0.5)  # training moves the rows and the state (a reset shows)
            t1.add_(0.5)
    graph = maps[0]._graph
    assert graph.refused is None and graph.captures == 2 and graph.N == step_capacity(500), graph.refused
    assert sum(s["evicted"] for s in maps[0].stats()) > 50
