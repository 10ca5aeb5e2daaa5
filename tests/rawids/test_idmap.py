"""The id -> row map of raw-id tables on one process: LRU and LFU choose the victims a plain-Python model of the
same policy chooses (random streams, many steps), admission counting, the previous step's rows are never
evicted, evicted rows are re-initialised with their optimizer state zeroed, evaluation only reads, and a map
rebuilt from its rows (a checkpoint load) maps like the original."""

from __future__ import annotations

import pytest
import torch

from embshard.lookup.shards import LocalShard, init_rows, init_rows_at
from embshard.rawids import IdMap
from embshard.rawids.hashing import SKETCH_SALTS, hash64
from embshard.spec.plan import Shard
from embshard.spec.tables import TableConfig


def _shard(t: TableConfig, index: int = 0, rows: int | None = None, row_offset: int = 0) -> LocalShard:
    rows = rows or t.num_embeddings
    return LocalShard(t, index, Shard(0, row_offset, rows, 0, t.embedding_dim), t.feature_names, "host")


class FakeLookup:
    """A lookup's shard tensors (what IdMap.reset writes into)."""

    def __init__(self, shards, seed=0, fill=None):
        self.w = [init_rows(s.table, s.table_index, s.shard.row_offset, s.shard.num_rows, 0, s.table.embedding_dim, seed)
                  for s in shards]  # fmt: skip
        self.st = [{"m": torch.full((s.shard.num_rows,), 5.0)} for s in shards]

    def shard_weights(self):
        return self.w

    def shard_optimizer_states(self):
        return self.st


def _lookup_rows(m: IdMap, ids: list[int], shard_counts: list[int] | None = None) -> list[int]:
    with torch.no_grad():
        rows, _ = m.remap(torch.tensor(ids, dtype=torch.int64), shard_counts or [len(ids)], train=False)
    return rows.tolist()


class PolicyModel:
    """The documented policy in plain Python, for one shard of `rows` rows (the last is the zero row)."""

    def __init__(self, rows: int, lfu: bool) -> None:
        self.usable, self.lfu = rows - 1, lfu
        self.row_of: dict[int, int] = {}
        self.last = [-1] * self.usable
        self.freq = [0] * self.usable
        self.key = [None] * self.usable
        self.order = list(range(self.usable))
        self.clock = 0
        self.admitted = self.evicted = 0

    def step(self, ids: list[int]) -> list[int]:
        c = self.clock
        counts: dict[int, int] = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
        new = []
        for i in dict.fromkeys(ids):  # first occurrences, in batch order
            if i in self.row_of:
                r = self.row_of[i]
                self.last[r], self.freq[r] = c, self.freq[r] + counts[i]
            else:
                new.append(i)
        thr = max(c - 1, 0)
        if self.lfu:
            ev = sorted(
                (r for r in range(self.usable) if self.last[r] < thr), key=lambda r: (self.freq[r], self.last[r] + 1, r)
            )
        else:
            ev = [r for r in self.order if self.last[r] < thr]
        for i, r in zip(new, ev):
            self.admitted += 1
            if self.key[r] is not None:
                del self.row_of[self.key[r]]
                self.evicted += 1
            self.key[r], self.row_of[i], self.last[r], self.freq[r] = i, r, c, counts[i]
        self.order = [r for r in self.order if self.last[r] != c] + [r for r in self.order if self.last[r] == c]
        self.clock += 1
        return [self.row_of.get(i, self.usable) for i in ids]


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_victims_follow_the_policy(eviction):
    rows = 41
    t = TableConfig("t", rows, 4, ("f",), ids="raw", eviction=eviction)
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    model = PolicyModel(rows, eviction == "lfu")
    lk = FakeLookup(m.shards)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randint(-(2**62), 2**62, (200,), generator=gen)
    evicted = 0
    for step in range(60):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        pos = (torch.rand(n, generator=gen) ** 3 * len(pool)).long()  # skewed: some ids come back often
        ids = pool[pos].tolist()
        got = m(torch.tensor(ids), [n], lk).tolist()
        assert got == model.step(ids), f"step {step}"
        evicted = m.stats()[0]["evicted"]
    assert evicted > 20  # the stream did evict
    resident = {k: r for k, r in model.row_of.items()}
    assert _lookup_rows(m, list(resident)) == list(resident.values())


def test_shards_of_a_group_follow_the_policy_each():
    """Several shards in one map (two LRU of different sizes, one LFU), the same id values in all of them, steps
    where a shard gets no ids or more ids than it has rows: every shard maps and counts as its own policy model."""
    specs = [("a", 41, "lru", 0), ("b", 25, "lru", 30), ("c", 30, "lfu", 0)]
    shards = [_shard(TableConfig(name, rows + off, 4, (f"f{name}",), ids="raw", eviction=ev), i, rows, off)
              for i, (name, rows, ev, off) in enumerate(specs)]  # fmt: skip
    m = IdMap(shards, torch.device("cpu"), seed=0)
    models = [PolicyModel(rows, ev == "lfu") for _, rows, ev, _ in specs]
    lk = FakeLookup(shards)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randint(-(2**62), 2**62, (150,), generator=gen)
    for step in range(80):
        counts = [int(torch.randint(0, 50, (1,), generator=gen)) * int(torch.rand(1, generator=gen) > 0.15)
                  for _ in shards]  # fmt: skip
        ids = [pool[(torch.rand(c, generator=gen) ** 2 * len(pool)).long()].tolist() for c in counts]
        got = m(torch.tensor([i for x in ids for i in x], dtype=torch.int64), counts, lk).tolist()
        want = [r for model, x in zip(models, ids) for r in model.step(x)]
        assert got == want, f"step {step}"
    stats = m.stats()
    assert [(s["admitted"], s["evicted"]) for s in stats] == [(x.admitted, x.evicted) for x in models]
    assert all(x.evicted > 20 for x in models)


def test_lru_and_lfu_pick_the_expected_rows():
    for eviction, want_gone in (("lru", {40, 50}), ("lfu", {30, 50})):
        t = TableConfig("t", 6, 4, ("f",), ids="raw", eviction=eviction)
        m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
        lk = FakeLookup(m.shards)
        m(torch.tensor([10, 20, 30, 40, 50, 10, 10, 20, 20, 40, 40]), [11], lk)  # uses: 10:3 20:3 30:1 40:3 50:1
        m(torch.tensor([10, 20, 30]), [3], lk)  # step 1: 10, 20, 30 used again (30: 2 uses)
        m(torch.tensor([20]), [1], lk)  # step 2
        # step 3: evictable = not used at steps 2 or 3: 10 (last 1, 4 uses), 30 (1, 2), 40 (0, 3), 50 (0, 1)
        got = m(torch.tensor([60, 70]), [2], lk).tolist()
        assert 5 not in got, (eviction, got)  # both admitted
        rows = _lookup_rows(m, [10, 20, 30, 40, 50, 60, 70])
        gone = {i for i, r in zip([10, 20, 30, 40, 50], rows) if r == 5}
        assert gone == want_gone, (eviction, gone)
        assert rows[5:] == got


def test_rows_of_the_previous_step_are_not_evicted():
    t = TableConfig("t", 4, 4, ("f",), ids="raw")
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    lk = FakeLookup(m.shards)
    assert m(torch.tensor([1, 2, 3]), [3], lk).tolist() == [0, 1, 2]
    assert m(torch.tensor([4, 5]), [2], lk).tolist() == [3, 3]  # every row was used in the previous step
    assert m(torch.tensor([6, 1]), [2], lk).tolist()[1] == 0  # step 2: rows 1, 2 (ids 2, 3) are evictable now
    assert m.stats()[0] == {"admitted": 4, "evicted": 1, "resident": 3, "capacity": 3}


def test_admission_needs_the_minimum_count():
    t = TableConfig("t", 300, 4, ("f",), ids="raw", admit_min_count=3)
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    lk = FakeLookup(m.shards)
    ids = [11, 22, 33]
    width = 299
    for salt in SKETCH_SALTS:  # the three ids use distinct counters (no count-min overestimate here)
        assert len(set(torch.remainder(hash64(torch.tensor(ids), salt), width).tolist())) == 3
    z = 299
    assert m(torch.tensor([11, 22, 22]), [3], lk).tolist() == [z, z, z]  # counts 1 and 2
    assert m(torch.tensor([11, 22, 33, 33, 33]), [5], lk).tolist() == [z, 0, 1, 1, 1]  # 22: 3rd use, 33: 3 at once
    assert m(torch.tensor([11]), [1], lk).tolist() == [2]
    assert m.stats()[0]["admitted"] == 3


def test_evicted_rows_are_reinitialised_with_their_optimizer_state():
    t = TableConfig("t", 4, 8, ("f",), ids="raw")
    m = IdMap([_shard(t, index=2)], torch.device("cpu"), seed=7)
    lk = FakeLookup(m.shards, seed=7)
    m(torch.tensor([1, 2, 3]), [3], lk)
    m(torch.tensor([2, 3]), [2], lk)
    lk.w[0].add_(1.0)  # training moved every row; the state too
    lk.st[0]["m"].fill_(3.0)
    m(torch.tensor([2]), [1], lk)
    assert m(torch.tensor([9]), [1], lk).tolist() == [0]  # id 1 (row 0) evicted for id 9
    torch.testing.assert_close(lk.w[0][0], init_rows_at(t, 2, torch.tensor([0]), 0, 8, 7)[0], atol=0, rtol=0)
    assert lk.st[0]["m"][0] == 0 and (lk.st[0]["m"][1:3] == 3).all()  # only the evicted row's state is zeroed
    torch.testing.assert_close(lk.w[0][1:3], init_rows(t, 2, 1, 2, 0, 8, 7) + 1.0)  # the others kept theirs
    assert torch.count_nonzero(lk.w[0][3]) == 0 and lk.st[0]["m"][3] == 0  # the zero row


def test_evaluation_only_reads():
    t = TableConfig("t", 8, 4, ("f",), ids="raw")
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    lk = FakeLookup(m.shards)
    m(torch.tensor([5, 6]), [2], lk)
    before = (m.clock, m.row_last.clone(), m.row_freq.clone(), m.stats())
    with torch.no_grad():
        assert m(torch.tensor([5, 7, 6]), [3], lk).tolist() == [0, 7, 1]  # 7 is unknown: the zero row
    assert (m.clock, m.stats()) == (before[0], before[3])
    assert torch.equal(m.row_last, before[1]) and torch.equal(m.row_freq, before[2])


def test_shards_of_one_group_keep_their_own_maps_and_a_rebuilt_map_maps_the_same():
    a = TableConfig("a", 10, 4, ("fa",), ids="raw")
    b = TableConfig("b", 7, 4, ("fb",), ids="raw", eviction="lfu")
    shards = [_shard(a, 0), _shard(b, 1, rows=5, row_offset=2)]  # b: a block of rows 2..6
    m = IdMap(shards, torch.device("cpu"), seed=0)
    lk = FakeLookup(shards)
    got = m(torch.tensor([3, 4, 3, 4, 5]), [2, 3], lk).tolist()  # the same ids in both shards
    assert got == [0, 1, 0, 1, 2]
    m(torch.tensor([100, 101, 102, 103, 104, 105]), [3, 3], lk)
    ids = [3, 4, 100, 101, 102, 200, 3, 4, 5, 103, 104, 105, 201]
    want = _lookup_rows(m, ids, [6, 7])
    copy = IdMap(shards, torch.device("cpu"), seed=0)
    for s in range(2):
        for k, v in m.shard_state(s).items():
            copy.shard_state(s)[k].copy_(v)
    assert copy.rebuild() == 0
    assert _lookup_rows(copy, ids, [6, 7]) == want
    assert copy.clock == m.clock
    assert torch.equal(copy.order, m.order)


@pytest.mark.parametrize("eviction,min_count", [("lru", 1), ("lfu", 1), ("lru", 3)])
def test_the_planners_price_is_the_maps_memory(eviction, min_count):
    from embshard.rawids import map_bytes_per_row

    rows = 5000
    t = TableConfig("t", rows, 4, ("f",), ids="raw", eviction=eviction, admit_min_count=min_count)
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    held = sum(b.numel() * b.element_size() for b in m.buffers())
    if eviction == "lru":  # the order a step writes beside the one it reads (kept by the graphed step)
        held += m.order.numel() * m.order.element_size()
    assert abs(held - map_bytes_per_row(rows, eviction, min_count) * rows) < 1024  # per-shard constants aside


def test_kernel_choice_comes_from_the_environment(monkeypatch):
    """EMBSHARD_RAWID_KERNELS picks where the map's steps run (torch: the fallback to compare the kernels with); the
    torch path on the CPU under 'triton' would need Triton's interpreter, so only the choice itself is checked."""
    t = TableConfig("t", 64, 4, ("f",), ids="raw")
    assert IdMap([_shard(t)], torch.device("cpu"), seed=0).map_kernel == "auto"
    monkeypatch.setenv("EMBSHARD_RAWID_KERNELS", "torch")
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    assert m.map_kernel == m.reset_kernel == "torch"
    rows, _ = m.remap(torch.tensor([5, 7, 5]), [3], True)
    assert rows[0] == rows[2] != rows[1]
    monkeypatch.setenv("EMBSHARD_RAWID_KERNELS", "cuda")
    with pytest.raises(ValueError, match="EMBSHARD_RAWID_KERNELS='cuda' is invalid: choose auto"):
        IdMap([_shard(t)], torch.device("cpu"), seed=0)


def test_graph_choice_comes_from_the_environment(monkeypatch):
    """EMBSHARD_RAWID_GRAPH: 1 (the default) lets CUDA training steps replay a graph, 0 keeps them eager; the map
    on the CPU never replays one (it says why)."""
    from embshard.rawids.graph import graph_refusal, step_capacity

    t = TableConfig("t", 64, 4, ("f",), ids="raw")
    m = IdMap([_shard(t)], torch.device("cpu"), seed=0)
    assert m.graphed and graph_refusal(m, torch.zeros(3, dtype=torch.int64)) == "not on CUDA"
    monkeypatch.setenv("EMBSHARD_RAWID_GRAPH", "0")
    assert not IdMap([_shard(t)], torch.device("cpu"), seed=0).graphed
    monkeypatch.setenv("EMBSHARD_RAWID_GRAPH", "yes")
    with pytest.raises(ValueError, match="EMBSHARD_RAWID_GRAPH='yes' is invalid: set 1"):
        IdMap([_shard(t)], torch.device("cpu"), seed=0)
    assert [step_capacity(n) for n in (1, 58, 59, 300)] == [64, 64, 128, 384]  # 10% over, a multiple of 64
