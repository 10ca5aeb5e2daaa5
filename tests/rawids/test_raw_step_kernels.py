"""The id -> row map's training step on its fused Triton kernels (embshard/rawids/step.py; on the CPU under Triton's
interpreter, which tests/suite_plugin.py turns on where there is no CUDA; on a GPU with EMBSHARD_TEST_DEVICE=cuda)
against the torch path: rows, reset lists and the map's whole state over steps that admit and evict, steps whose
ids are all resident (nothing to place: the miss path's kernels return at once), steps with misses that admission
counting holds back, empty shards, and the reset list's compact form."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from embshard.lookup.shards import LocalShard
from embshard.rawids import IdMap
from embshard.spec.plan import Shard
from embshard.spec.tables import TableConfig

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
    for step in range(len(TABLES)):  # more distinct ids than rows: evictions; each shard once without ids
        counts = [int(torch.randint(0, 70, (1,), generator=gen)) for _ in TABLES]
        counts[step % len(TABLES)] = 0
        ids = pool[torch.randint(0, 400, (sum(counts),), generator=gen)]
        given.append(_check(fast, ref, ids, counts, step))
    assert min(given) > 0 and sum(s["evicted"] for s in fast.stats()) > 20
    resident = [fast.shard_state(s)["ids"][fast.shard_state(s)["id_last"] >= 0].cpu() for s in range(len(TABLES))]
    for step in range(1):  # only resident ids (some twice): nothing to place
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
    monkeypatch.setattr("embshard.rawids.state.map_buckets", lambda usable: 2)
    fast, ref = _maps([TableConfig("a", 41, 4, ("fa",), ids="raw")], device)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        ids = torch.randint(-(2**62), 2**62, (40,), generator=gen)
        _check(fast, ref, ids, [40], step)
    assert (ref.row_last[:40] < 0).any() and (ref.slot_row[:-1] >= 0).all()


def test_step_kernels_with_repeated_misses_and_hits(device):
    """Misses repeated many times (one new id a third of the step, in every shard at once: one claim per shard and
    id, entries of the claim table taken by other ids) beside resident ids repeated, in LRU shards and one that
    counts admissions; then steps whose ids are all resident, each many times: per row one last use and its
    copies' uses, as on the torch path."""
    tables = [
        TableConfig("a", 60, 4, ("fa",), ids="raw"),
        TableConfig("b", 40, 4, ("fb",), ids="raw", admit_min_count=3),
        TableConfig("c", 41, 4, ("fc",), ids="raw"),
    ]
    fast, ref = _maps(tables, device)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh ids every run
    pool = torch.randint(-(2**62), 2**62, (150,), generator=gen)
    for step in range(4):
        hot = pool[torch.randint(0, 150, (1,), generator=gen)]
        counts = [int(torch.randint(60, 120, (1,), generator=gen)) for _ in tables]
        parts = []
        for c in counts:
            part = pool[torch.randint(0, 150, (c,), generator=gen)]
            part[torch.rand(c, generator=gen) < 0.35] = hot  # the same id, many times, in every shard
            parts.append(part)
        _check(fast, ref, torch.cat(parts), counts, step)
    assert sum(s["evicted"] for s in ref.stats()) > 10 and ref.stats()[1]["admitted"] > 0
    resident = [fast.shard_state(s)["ids"][fast.shard_state(s)["id_last"] >= 0].cpu() for s in range(len(tables))]
    for step in range(1):
        parts = [r[torch.randint(0, len(r), (90,), generator=gen)] for r in resident]
        assert _check(fast, ref, torch.cat(parts), [90] * len(tables), f"resident {step}") == 0


class _Weights:
    """A lookup of one weight tensor and one optimizer state per shard (separate storages: each shard's reset walks
    the group's list and keeps its own entries)."""

    def __init__(self, tables, gen):
        self.w = [torch.rand(t.num_embeddings, 4, generator=gen) for t in tables]
        self.st = [{"m": torch.rand(t.num_embeddings, generator=gen)} for t in tables]

    def shard_weights(self):
        return self.w

    def shard_optimizer_states(self):
        return self.st

    def train(self):  # moves every row, so that a reset shows
        for w, st in zip(self.w, self.st):
            w.add_(0.5)
            st["m"].add_(0.25)


def _padded_steps(tables, device, steps, seed):
    """Padded Triton steps (`padded_step`: ids at 0..n-1 of N, junk past them: ids of the pool, INT64_MAX, random)
    against the torch path on the unpadded ids, each with its reset; the LRU order in two buffers by turns."""
    from embshard.rawids.graph import padded_step, step_values
    from embshard.rawids.step import INT64_MAX

    fast, ref = _maps(tables, device)
    gen = torch.Generator().manual_seed(seed)
    lk_fast, lk_ref = _Weights(tables, gen), _Weights(tables, gen)
    lk_ref.w, lk_ref.st = [w.clone() for w in lk_fast.w], [{"m": s["m"].clone()} for s in lk_fast.st]
    lk_fast.w, lk_fast.st = [w.to(device) for w in lk_fast.w], [{"m": s["m"].to(device)} for s in lk_fast.st]
    pool = torch.randint(-(2**62), 2**62, (300,), generator=gen)
    pool[0] = INT64_MAX  # a real id equal to the pads' key
    orders = [torch.empty_like(fast.order) for _ in range(2)] if fast.lru else [None, None]
    for step, (n_of, extra) in enumerate(steps):
        counts = [int(torch.randint(0, n_of + 1, (1,), generator=gen)) for _ in tables]
        if len(tables) > 1:
            counts[step % len(tables)] = 0  # an empty shard
        n = sum(counts)
        ids = pool[torch.randint(0, 300, (n,), generator=gen)]
        junk = torch.cat([pool[torch.randint(0, 300, (extra,), generator=gen)], torch.tensor([INT64_MAX])])
        junk = torch.where(torch.rand(len(junk), generator=gen) < 0.3, torch.randint(-9, 9, junk.shape), junk)
        vals = torch.tensor(step_values(fast, counts, fast.stream_keys(1)), device=device)
        rows, resets = padded_step(
            fast, torch.cat([ids, junk]).to(device), vals, min(n + len(junk), fast.Ord), orders[step % 2],
            fast.storages(lk_fast),
        )  # fmt: skip
        fast.clock += 1
        want, want_resets = ref.remap(ids, counts, True)
        ref.reset(lk_ref, want_resets)
        where = (step, n, len(junk))
        want_given = want_resets.rows if n else torch.empty(0, dtype=torch.int64)  # no ids: no list (eager)
        assert torch.equal(rows[:n].cpu(), want) and (rows[n:] == 0).all(), where
        assert torch.equal(resets.rows[:n].cpu(), want_given) and (resets.rows[n:] == -1).all(), where
        listed, count = resets.listed
        assert sorted(listed[: int(count)].tolist()) == (want_given >= 0).nonzero().squeeze(1).tolist(), where
        for b in STATE:
            assert torch.equal(getattr(fast, b)[:-1].cpu(), getattr(ref, b)[:-1]), (where, b)
        if fast.lru:
            assert fast.order is orders[step % 2] and torch.equal(fast.order.cpu(), ref.order), where
        assert fast.stats() == ref.stats() and fast.clock == ref.clock == int(fast.clock_t), where
        if fast.sketching:
            assert torch.equal(fast.sketch.cpu(), ref.sketch), where
        for a, b in zip(lk_fast.w + [s["m"] for s in lk_fast.st], lk_ref.w + [s["m"] for s in lk_ref.st]):
            assert torch.equal(a.cpu(), b), where
        lk_fast.train()
        lk_ref.train()
    return ref


def test_padded_steps_match_the_torch_path(device):
    """Several shards (LRU, LFU, admission counting, a 2-row shard, one that admits nothing; empty shards): padded
    steps of N > n ids (pads that repeat the step's ids, INT64_MAX, a step of no ids) remap, reset and count as the
    torch path on the step's ids alone, while admitting and evicting."""
    ref = _padded_steps(TABLES, device, [(70, 40), (60, 90), (0, 64), (70, 0), (50, 1)], 11)
    assert sum(s["evicted"] for s in ref.stats()) > 20


def test_padded_steps_of_one_shard_match_the_torch_path(device):
    """One LRU shard (T = 1: the pads still form runs of their own): steps that admit, evict and hit."""
    ref = _padded_steps([TableConfig("a", 60, 4, ("fa",), ids="raw")], device, [(80, 20), (80, 3), (40, 60)], 5)
    assert ref.stats()[0]["evicted"] > 10


def test_device_clock_follows_the_host_clock(device):
    """The device clock (the Triton kernels read it) equals the host clock after Triton and torch steps, steps of no
    ids, ticks and a rebuild (a checkpoint's load: tests/rawids/test_raw_checkpoint.py)."""
    fast, ref = _maps(TABLES[:1], device)
    gen = torch.Generator().manual_seed(2)
    for m in (fast, ref):
        for n in (30, 0, 12):
            m.remap(torch.randint(-(2**62), 2**62, (n,), generator=gen).to(m.row_key.device), [n], True)
        m.tick()
        assert m.clock == int(m.clock_t) == 4
        m.row_last[3] = 40
        m.rebuild()
        assert m.clock == int(m.clock_t) == 41


class _Replay:
    """A captured graph's stand-in on the CPU: a replay runs the captured body again, into the captured output."""

    def __init__(self, body, out):
        self.body, self.out, self.replays = body, out, 0

    def replay(self):
        self.out.copy_(self.body())
        self.replays += 1


@pytest.mark.parametrize("capture_fails", [False, True])
def test_graph_steps_match_eager_steps_with_the_capture_stood_in_for(capture_fails, device, monkeypatch):
    """`MapGraph`'s host side (embshard/rawids/graph.py: static inputs, capacities, the two LRU order buffers by
    turns, an order from a rebuild copied in, the clocks, the rows copied out) through `IdMap.forward`, the capture
    stood in for by `_Replay`: the torch path's rows, state and resets over steps of changing sizes (one over the
    capacity: captured again), a step of no ids and an evaluation between them, with the stream keys drawn per step
    (seed None). A capture that fails warns once and leaves the map on the eager step."""
    from embshard.rawids import graph as g

    if device.type == "cuda":
        pytest.skip("the real capture: tests/rawids/test_raw_ids_gpu.py")

    def capture(self, bodies):
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        outs = [torch.full((self.N,), -7) for _ in bodies]
        return [_Replay(b, o) for b, o in zip(bodies, outs)], outs

    monkeypatch.setattr(g.MapGraph, "_eagerly", lambda self, fn: fn())
    monkeypatch.setattr(g.MapGraph, "_capture", capture)
    monkeypatch.setattr(g, "graph_refusal", lambda m, ids: m._graph and m._graph.refused)
    tables = [TableConfig("a", 50, 4, ("fa",), ids="raw"), TableConfig("b", 30, 4, ("fb",), ids="raw")]
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, 4), t.feature_names, "hbm")
              for i, t in enumerate(tables)]  # fmt: skip
    fast, ref = IdMap(shards, device, seed=None), IdMap(shards, device, seed=None)
    fast.map_kernel = fast.reset_kernel = "triton"
    ref.map_kernel, ref.reset_kernel, ref.graphed = "torch", "torch", False
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh ids every run
    lk_fast = _Weights(tables, gen)
    lk_ref = _Weights(tables, gen)
    lk_ref.w, lk_ref.st = [w.clone() for w in lk_fast.w], [{"m": s["m"].clone()} for s in lk_fast.st]
    pool = torch.randint(-(2**62), 2**62, (200,), generator=gen)
    kept = None
    with pytest.warns(RuntimeWarning, match="capturing its step failed") if capture_fails else nullcontext():
        sizes = [60, 0, 140, 30] if capture_fails else [60, 30, 0, 50, 140, 20, 100, 70, 5, 90]  # eager: fewer
        for step, n in enumerate(sizes):
            # the first table's share of the ids, a quarter to three quarters: each table evicts (a share drawn
            # from 0..n evicted too few rows in 1 of 40 runs of the four steps)
            a = int(torch.randint(n // 4, n - n // 4 + 1, (1,), generator=gen))
            ids = pool[torch.randint(0, 200, (n,), generator=gen)]
            if step == 6:  # a load: the order comes from the rebuild
                assert fast.rebuild() == ref.rebuild() == 0
            with torch.no_grad():  # evaluation only looks up
                assert torch.equal(fast(ids, [a, n - a], lk_fast), ref(ids, [a, n - a], lk_ref)), step
            got, want = [], []
            for m, lk, out in ((fast, lk_fast, got), (ref, lk_ref, want)):
                torch.manual_seed(step)  # the same stream keys
                out.append(m(ids, [a, n - a], lk))
            assert torch.equal(got[0], want[0]), step
            assert kept is None or torch.equal(*kept), step  # the last step's rows: kept, not overwritten
            kept = (got[0], want[0])
            for b in STATE:
                assert torch.equal(getattr(fast, b)[:-1], getattr(ref, b)[:-1]), (step, b)
            assert torch.equal(fast.order, ref.order) and fast.stats() == ref.stats(), step
            assert fast.clock == ref.clock == int(fast.clock_t) == int(ref.clock_t), step
            for a_, b_ in zip(lk_fast.w + [s["m"] for s in lk_fast.st], lk_ref.w + [s["m"] for s in lk_ref.st]):
                assert torch.equal(a_, b_), step
            lk_fast.train()
            lk_ref.train()
    graph = fast._graph
    assert sum(s["evicted"] for s in ref.stats()) > 10
    if capture_fails:
        assert graph.refused and graph.graphs is None and graph.captures == 0
    else:
        assert graph.refused is None and graph.captures == 2 and graph.N == 192  # 140 ids + 10%, 64s
        assert sum(r.replays for r in graph.graphs) == 5 and any(fast.order is o for o in graph.orders)
