"""A raw-id resume is exact: N training steps straight and N/2 steps, a checkpoint, a load into a fresh collection
and N/2 more steps give bit-identical weights, optimizer state and id -> row maps (rows, last uses, uses, the LRU
order, index slots, the clock, the admission sketch), with tables small enough that ids are admitted and evicted
after the resume (LRU, LFU, admission counting; one lookup group of several shards). One process, the CPU."""

from __future__ import annotations

import torch
from parity import to_kjt
from raw_cases import id_pools, pool_batches

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
from embshard.spec.plan import MemoryTier

TABLES = [
    TableConfig("lru", 12, 4, ("fa", "fb"), ids="raw", ids_per_bag=2),
    TableConfig("adm", 10, 4, ("fc",), ids="raw", ids_per_bag=2, admit_min_count=2),
    TableConfig("lfu", 9, 4, ("fd",), ids="raw", ids_per_bag=2, eviction="lfu"),
    TableConfig("s", 8, 4, ("fe",)),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
POOLS = {"lru": 40, "adm": 30, "lfu": 30}  # several times each table's capacity: evictions every step
OPT = FusedOptimizerConfig("adam", lr=0.05, eps=1e-6)
STEPS = 8


def _make(seed: int):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    plan = simple_plan(TABLES, 1, tier=MemoryTier.HOST)
    return ShardedEmbeddingBagCollection(TABLES, plan, OPT, device=torch.device("cpu"), seed=seed)


def _train(ebc, batches, first: int) -> None:
    for i, per_rank in enumerate(batches):
        out = ebc(to_kjt(per_rank[0], FEATURES, torch.device("cpu"))).to_dict()
        gen = torch.Generator().manual_seed(1000 + first + i)
        sum((out[f] * torch.randn(out[f].shape, generator=gen)).sum() for f in FEATURES).backward()


def _state(ebc) -> dict:
    out = {f"weight/{n}/{s.row_offset}": w.detach().clone() for n, s, w in ebc.local_shards()}
    for n, s, st in ebc.local_optimizer_states():
        out.update({f"opt/{n}/{s.row_offset}/{k}": v.detach().clone() for k, v in st.items()})
    for n, s, views in ebc.local_id_maps():
        out.update({f"map/{n}/{s.row_offset}/{k}": v.clone() for k, v in views.items()})
    for n, s, idmap, i in ebc.id_map_shards():
        out.update({f"exact/{n}/{s.row_offset}/{k}": v for k, v in idmap.exact_state(i).items()})
    out["optimizer_step"] = torch.tensor(ebc.optimizer_step)
    return out


def test_resume_is_bitwise_the_straight_run_after_more_admissions_and_evictions(tmp_path):
    batches = pool_batches(TABLES, id_pools(TABLES, POOLS, 7), [6], STEPS, seed=3)
    straight = _make(1)
    _train(straight, batches, 0)

    first = _make(1)
    _train(first, batches[: STEPS // 2], 0)
    ckpt = Checkpointer(TrainState({"ebc": first}), str(tmp_path), async_save=False, chunk_bytes=600)
    ckpt.save(STEPS // 2)
    ckpt.close()
    resumed = _make(1)  # the run's seed: the rows given to new ids after the resume are drawn from it
    load_checkpoint(latest(str(tmp_path)), TrainState({"ebc": resumed}), chunk_bytes=600)
    assert _state(resumed).keys() == _state(first).keys()
    assert all(torch.equal(a, b) for a, b in zip(_state(resumed).values(), _state(first).values()))
    before = first.raw_id_stats()
    _train(resumed, batches[STEPS // 2 :], STEPS // 2)

    stats = straight.raw_id_stats()
    assert all(stats[t]["evicted"] > before[t]["evicted"] + 3 for t in POOLS), (stats, before)  # evictions after it
    a, b = _state(straight), _state(resumed)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
