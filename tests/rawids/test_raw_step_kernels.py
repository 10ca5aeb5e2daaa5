"""The id -> row map's training step on its fused Triton kernels (embshard/rawids/step.py; on the CPU under Triton's
interpreter, which tests/conftest.py turns on where there is no CUDA; on a GPU with EMBSHARD_TEST_DEVICE=cuda)
against the torch path: rows, reset lists and the map's whole state over steps that admit and evict, steps whose
ids are all resident (nothing to place: the miss path's kernels return at once), steps with misses that admission
counting holds back, empty shards, and the reset list's compact form."""

from __future__ import annotations

import pytest
import torch

from embshard.lookup.shards import LocalShard
from embshard.plan import Shard
from embshard.rawids import IdMap
from embshard.tables import TableConfig

pytest.importorskip("triton")

TABLES = [
    TableConfig("a", 50, 4, ("fa",), ids="raw"),
    TableConfig("b", 40, 4, ("fb",), ids="raw", admit_min_count=2),
    TableConfig("c", 30, 4, ("fc",), ids="raw", eviction="lfu"),
    TableConfig("d", 2, 4, ("fd",), ids="raw"),
    TableConfig("e", 20, 4, ("fe",), ids="raw", admit_min_count=10**6),  # admits nothing
]
STATE = ("row_key", "row_last", "row_freq", "row_slot", "slot_key", "slot_row")  # compared without the trash slot


def _maps(tables, device):
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, 4), t.feature_names, "hbm")
              for i, t in enumerate(tables)]  # fmt: skip
    fast, ref = IdMap(shards, device, seed=1), IdMap(shards, torch.device("cpu"), seed=1)
    fast.map_kernel, ref.map_kernel = "triton", "torch"
    return fast, ref


def _check(fast, ref, ids, counts, where):
    rows, resets = fast.remap(ids.to(fast.row_key.device), counts, True)
    want, want_resets = ref.remap(ids, counts, True)
    assert torch.equal(rows.cpu(), want), where
    assert torch.equal(resets.rows.cpu(), want_resets.rows), where
    listed, count = resets.listed
    given = sorted(listed[: int(count)].tolist())
    assert given == (want_resets.rows >= 0).nonzero().squeeze(1).tolist(), where
    for b in STATE:
        assert torch.equal(getattr(fast, b)[:-1].cpu(), getattr(ref, b)[:-1]), (where, b)
    assert torch.equal(fast.order.cpu(), ref.order), where
    assert fast.stats() == ref.stats(), where
    if fast.sketching:
        assert torch.equal(fast.sketch.cpu(), ref.sketch), where
    return int(count)


def test_step_kernels_match_torch(device):
    """Admitting and evicting steps (LRU, LFU, admission counting, a 2-row shard, shards without ids), then steps
    whose ids are all resident: equal rows, resets, state and statistics, and no row given in steady state."""
    fast, ref = _maps(TABLES, device)
    gen = torch.Generator().manual_seed(7)
    pool = torch.randint(-(2**62), 2**62, (400,), generator=gen)
    given = []
    for step in range(8):  # more distinct ids than rows: evictions
        counts = [int(torch.randint(0, 70, (1,), generator=gen)) for _ in TABLES]
        counts[step % len(TABLES)] = 0
        ids = pool[torch.randint(0, 400, (sum(counts),), generator=gen)]
        given.append(_check(fast, ref, ids, counts, step))
    assert min(given) > 0 and sum(s["evicted"] for s in fast.stats()) > 20
    resident = [fast.shard_state(s)["ids"][fast.shard_state(s)["id_last"] >= 0].cpu() for s in range(len(TABLES))]
    for step in range(3):  # only resident ids (some twice): nothing to place
        counts, parts = [], []
        for r in resident:
            pick = r[torch.randint(0, max(len(r), 1), (min(len(r), 1) * 25,), generator=gen)]
            counts.append(len(pick))
            parts.append(pick)
        assert _check(fast, ref, torch.cat(parts), counts, f"steady {step}") == 0
    # misses that admission counting holds back: fewer admitted (b), none (e)
    fresh = torch.randint(-(2**62), 2**62, (60,), generator=gen)
    assert _check(fast, ref, fresh, [0, 30, 0, 0, 30], "held back") < 30
    assert _check(fast, ref, fresh[30:], [0, 0, 0, 0, 30], "held back") == 0


def test_step_kernels_with_full_buckets(device, monkeypatch):
    """One shard whose index has two buckets (32 slots for 40 rows): new ids fill the emptier bucket, then the other,
    and the last find no slot (their rows are given but left unused), as on the torch path."""
    monkeypatch.setattr("embshard.rawids.idmap._buckets", lambda usable: 2)
    fast, ref = _maps([TableConfig("a", 41, 4, ("fa",), ids="raw")], device)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        ids = torch.randint(-(2**62), 2**62, (40,), generator=gen)
        _check(fast, ref, ids, [40], step)
    assert (ref.row_last[:40] < 0).any() and (ref.slot_row[:-1] >= 0).all()
