"""The sharded collection's step as one CUDA graph (embshard/collection/emb_graph.py) trains like its eager step: table-wise,
column-wise (the weighted table, two column blocks under the exact row-wise Adagrad update) and data-parallel tables,
row-wise Adagrad, ragged bags drawn fresh every step, 1 and 2 processes.
Losses and every table's weights after each step match the eager collection's; the capacity grows when a batch
exceeds it. On the CPU, where CUDA graphs do not exist, the padded step runs without capture
(`EmbeddingStepGraph(capture=False)`: the same padded batch, exchanges sized from the padded counts, lookups with
per-id weights, backward with the fused update). A filler given weight 1 changes the result (the check can fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_harness import device_kind, run_distributed

from embshard import TableConfig
from embshard.spec.plan import MemoryTier, ShardingType

TABLES = (
    TableConfig("g_tw", 300, 8, ("g_a",), ids_per_bag=3),
    TableConfig("g_tw2", 500, 4, ("g_b", "g_c"), ids_per_bag=2),
    TableConfig("g_w", 211, 8, ("g_d",), weighted=True, ids_per_bag=4),
    TableConfig("g_dp", 12, 8, ("g_e",), ids_per_bag=2),
)
TYPES = {"g_dp": ShardingType.DATA_PARALLEL, "g_w": ShardingType.COLUMN_WISE}
# data-parallel tables on the small-table kernels (one weighted), between and after table-wise ones: their
# features get no fillers in a padded batch (runs of padded and unpadded features alternate)
SMALL_TABLES = (
    TABLES[0],
    TableConfig("g_dp", 12, 8, ("g_e",), ids_per_bag=2),
    TableConfig("g_dpw", 9, 4, ("g_f",), weighted=True, ids_per_bag=3),
    *TABLES[1:3],
    TableConfig("g_dp2", 20, 4, ("g_g",), ids_per_bag=5),
)
SMALL_TYPES = {
    "g_dp": ShardingType.DATA_PARALLEL,
    "g_dpw": ShardingType.DATA_PARALLEL,
    "g_dp2": ShardingType.DATA_PARALLEL,
}
BATCH, STEPS = 16, 7
SMALL_STEPS = 5  # the small-kernel run: past the capacity's growth at step 4, fewer of the interpreter's launches


def _collection(world, device, tables=TABLES, types=TYPES, small=False):
    from dataclasses import replace

    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.planner import simple_plan
    from embshard.spec.optim import FusedOptimizerConfig

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    plan = simple_plan(list(tables), world, world, types, tier=tier)
    if small:  # the data-parallel tables on the small-table kernels
        dp = {t for t, k in types.items() if k is ShardingType.DATA_PARALLEL}
        plan = replace(plan, tables=tuple(replace(t, kernel="small") if t.table in dp else t for t in plan.tables))
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    return ShardedEmbeddingBagCollection(list(tables), plan, opt, device=device, seed=5)


def _batch(gen, device, step, tables=TABLES):
    """Ragged bags (lengths 0..2L, more in later steps so the capacity grows), ids and weights drawn fresh."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            top = 2 * t.ids_per_bag + (step >= 4)
            le = torch.randint(0, top + 1, (BATCH,), generator=gen)
            keys.append(f)
            lengths.append(le)
            values.append(torch.randint(0, t.num_embeddings, (int(le.sum()),), generator=gen))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=gen) + 0.5
    return KeyedJaggedTensor(
        keys=keys, values=v.to(device), lengths=torch.cat(lengths).to(device), weights=w.to(device)
    )


def _counts(ebc, kjt):
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.sharding.exchange import parse_counts

    cpu = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().cpu(), lengths=kjt.lengths().cpu(),
                            weights=kjt.weights().cpu())  # fmt: skip
    row = ebc.host_counts(cpu)
    if dist.get_backend() == "nccl":  # NCCL gathers device tensors
        row = row.to(ebc.device)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return parse_counts(torch.stack(rows).cpu().numpy())


def _worker(rank, world, device, wrong_filler=False, small=False, steps=STEPS):
    from embshard.collection.emb_graph import EmbeddingStepGraph

    tables, types = (SMALL_TABLES, SMALL_TYPES) if small else (TABLES, TYPES)
    eager, graphed = (_collection(world, device, tables, types, small) for _ in range(2))
    if small:  # the scheme reads its ids through the offsets alone: no fillers for its features
        assert graphed.schemes[-1].pads_free and len(EmbeddingStepGraph(graphed, sum, False)._padder._free) == 3
    graph = EmbeddingStepGraph(graphed, lambda out: (out.values() ** 2).sum(), capture=device.type == "cuda")
    if wrong_filler:  # fillers weighing 1: they now add their rows to the bags
        pad = graph._padder.pad

        def bad_pad(kjt, counts, cap, out=None):
            padded, full = pad(kjt, counts, cap, out=out)
            w = padded.weights()  # in place: it may be the graph's input itself
            w.copy_(torch.where(w == 0, 1.0, w))
            return padded, full

        graph._padder.pad = bad_pad
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(steps):
        kjt = _batch(gen, device, step, tables)
        counts = _counts(eager, kjt)
        loss_e = (eager(kjt).values() ** 2).sum()
        loss_e.backward()
        loss_g = graph.step(kjt, counts)
        out.append((float(loss_e), float(loss_g), eager.full_weights(), graphed.full_weights()))
    info = (graph.captures, graph.replays, graph.capacity.tolist())
    graph.close()
    return out, info


def _compare(results, rtol, atol):
    for rank, (steps, _) in enumerate(results):
        for i, (le, lg, we, wg) in enumerate(steps):
            torch.testing.assert_close(torch.tensor(lg), torch.tensor(le), rtol=rtol, atol=atol, msg=f"rank {rank} {i}")
            for name in we:
                torch.testing.assert_close(wg[name], we[name], rtol=rtol, atol=atol, msg=f"rank {rank} {i} {name}")


@pytest.mark.parametrize("world", [1, 2])
def test_graphed_step_trains_like_the_eager_step(world):
    results = run_distributed(_worker, world)
    cuda = device_kind() == "cuda"
    _compare(results, *((1e-4, 1e-5) if cuda else (1e-5, 1e-6)))
    captures, replays, cap = results[0][1]
    assert captures >= 2 if cuda else (captures, replays) == (0, 0)  # the capacity grew at step 4
    assert replays >= STEPS - 2 * captures if cuda else True
    assert all(c % 64 == 0 for c in cap) and all(r[1][2] == cap for r in results)  # every rank: one capacity


def test_graphed_step_with_unpadded_small_kernel_tables_trains_like_the_eager_step(torch_kernels_on_cpu):
    """At 2 ranks only: the small-kernel tables are data-parallel (local at any world size), and the table-wise
    tables beside them train at 1 and 2 ranks in the test above. On the CPU the small-table kernels take the torch
    path, as CPU training does (the Triton kernels' padded batches: tests/kernels_interpret_cases.py)."""
    results = run_distributed(_worker, 2, False, True, SMALL_STEPS)
    cuda = device_kind() == "cuda"
    _compare(results, *((1e-4, 1e-5) if cuda else (1e-5, 1e-6)))
    assert results[0][1][0] >= 2 if cuda else True


def _padding_worker(rank, world, device):
    from embshard.collection.padding import BatchPadder

    ebc = _collection(world, device, SMALL_TABLES, SMALL_TYPES, small=True)
    kjt = _batch(torch.Generator().manual_seed(3), device, 0, SMALL_TABLES)
    counts = _counts(ebc, kjt)
    padder = BatchPadder(ebc)
    have = np.asarray(counts.ids[0])
    cap = have + np.arange(1, len(have) + 1) * 7
    padded, full = padder.pad(kjt, counts, cap)
    assert (full.ids == cap).all() and padded.values().numel() == cap.sum()
    free = {"g_e", "g_f", "g_g"}
    used = 0
    for f in kjt.keys():
        got, own = padded[f], kjt[f]
        n, c = int(own.lengths().sum()), int(cap[padder._column[f]])
        used += n if f in free else c
        if f in free:
            assert torch.equal(got.lengths(), own.lengths()) and torch.equal(got.values(), own.values()), f
            if f == "g_f":  # weighted
                assert torch.equal(got.weights(), own.weights()), f
            continue
        want = float(own.weights().sum()) if f == "g_d" else float(n)  # fillers weigh 0
        assert int(got.lengths().sum()) == c and float(got.weights().sum()) == pytest.approx(want, rel=1e-5), f
    assert int(padded.offsets()[-1]) == used < padded.values().numel()


def test_padding_leaves_the_small_kernel_tables_bags_alone():
    """Padded features hold their capacity (own ids in order, fillers of weight 0); the small-kernel data-parallel
    features keep their own bags, ids and weights; the capacity they leave unused is at the end, in no bag."""
    run_distributed(_padding_worker, 1)


def test_fillers_weighing_one_change_the_step():
    results = run_distributed(_worker, 2, True)
    with pytest.raises(AssertionError):
        _compare(results, 1e-5, 1e-6)


def _refusal_worker(rank, world, device):
    from embshard.collection.emb_graph import EmbeddingStepGraph, refusal

    row_wise = _collection(world, device, types={**TYPES, "g_tw2": ShardingType.ROW_WISE})
    with pytest.raises(ValueError, match="row_wise"):
        EmbeddingStepGraph(row_wise, lambda out: out.values().sum(), capture=False)
    mean = [TableConfig(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, pooling="mean") for t in TABLES[:2]]
    return refusal(_collection(world, device, tables=mean, types={}))


def test_graphed_step_refuses_what_it_cannot_capture():
    why, _ = run_distributed(_refusal_worker, 2)
    assert "mean-pooled features" in why, why


def test_capacity_is_ten_percent_over_in_multiples_of_64():
    from embshard.spec.geometry import capacity

    got = capacity(np.array([0, 1, 64, 100, 1000]))
    assert got.tolist() == [0, 64, 128, 128, 1152]
    assert int(capacity(3200)) == 3520  # exact: through floats, 3200 x 1.1 rounds above 3520


def _ownership_worker(rank, world, device):
    from embshard.collection.emb_graph import EmbeddingStepGraph

    ebc = _collection(world, device)
    gen = torch.Generator().manual_seed(7)
    kjt, other = _batch(gen, device, 0), _batch(gen, device, 1)
    with pytest.raises(AttributeError):
        ebc.step = 3  # read-only: the collection writes it (set_step, advance_step, its forward)
    with pytest.raises(ValueError, match=r"set_step\(-1\)"):
        ebc.set_step(-1)
    with pytest.raises(ValueError, match=r"keep=-1"):
        ebc.drop_prefetches(keep=-1)
    ebc.set_step(3)
    ebc.prefetch(kjt, counts=_counts(ebc, kjt))
    ebc.prefetch(other, counts=_counts(ebc, other))
    assert (ebc.pending_prefetches, ebc.next_prefetch_step) == (2, 5)
    ebc.drop_prefetches(keep=1)
    assert (ebc.pending_prefetches, ebc.next_prefetch_step) == (1, 4)
    ebc(kjt)  # consumes its prefetch; a training forward counts itself
    assert (ebc.pending_prefetches, ebc.step) == (0, 4)
    # a failed capture counts no step and leaves no prefetch; its error says how to train on
    graph = EmbeddingStepGraph(ebc, sum, capture=False)
    with pytest.raises(RuntimeError, match=r"capturing the step failed \(ValueError: boom\).*the eager step"):
        with graph._capturing():
            ebc.prefetch(other, counts=_counts(ebc, other))
            ebc.advance_step()
            raise ValueError("boom")
    assert (ebc.step, ebc.pending_prefetches) == (4, 0)
    with graph._capturing():  # a capture that works counts no step either
        ebc.advance_step()
    assert ebc.step == 4
    # every id weighted: set on every scheme and lookup while active (nested too), cleared after
    lookups = [lk for s in ebc.schemes for lk in s.lookups]

    def flags():
        return {s.every_id_weighted for s in ebc.schemes} | {lk.every_id_weighted for lk in lookups}

    assert flags() == {False} and not ebc.every_id_weighted
    with torch.no_grad():
        plain = ebc(kjt).to_dict()
        with ebc.weighing_every_id():
            with ebc.weighing_every_id():
                pass
            assert flags() == {True} and ebc.every_id_weighted
            weighed = ebc(kjt).to_dict()
    assert flags() == {False} and not ebc.every_id_weighted
    # the weighted table's bags as before; the others' ids now weigh the batch's weights (0.5 to 1.5)
    assert torch.equal(weighed["g_d"], plain["g_d"])
    return [f for f in ("g_a", "g_b", "g_e") if torch.allclose(weighed[f], plain[f])]


def test_the_collection_owns_its_step_count_prefetches_and_padded_batches_flag():
    """`step` is read-only (`set_step`, `advance_step`); `pending_prefetches` / `drop_prefetches` are the prefetch
    queue's public access (a failed capture drops its own prefetch and restores the step count); and
    `weighing_every_id` sets the padded batches' flag on every scheme and lookup, which changes the unweighted
    tables' sums, only while active."""
    (same,) = run_distributed(_ownership_worker, 1)
    assert same == [], same


def test_captured_step_counts_steps_and_undoes_a_failed_capture(monkeypatch):
    """CapturedStep (the pooled and the sequence step graphs' shared run) with the capture stood in for on the CPU:
    the first call runs the body eagerly and captures it (the capture counts no step), later calls replay (each
    counted as a step); a capture that fails undoes what the subclass says, keeps the step count and says how to
    train on."""
    from types import SimpleNamespace

    from embshard.collection import emb_graph

    class Graph:
        def __init__(self):
            self.replayed = 0

        def replay(self):
            self.replayed += 1

    def fake_capture(body, device, *, stream, record_output, around):
        warm = body()  # the warm-up: an eager step
        with around():
            captured = body()
        return warm, Graph(), captured

    monkeypatch.setattr(emb_graph, "warm_up_and_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "side stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    launched = []
    monkeypatch.setattr(emb_graph.comm, "graph_launched", lambda: launched.append(1))

    class Collection:
        device = SimpleNamespace(type="cuda")
        step = 0

        def set_step(self, step):
            self.step = step

        def advance_step(self):
            self.step += 1

    class Step(emb_graph.CapturedStep):
        eager_hint = "`c(kjt)`"

        def __init__(self, fail_capture=False):
            super().__init__(Collection(), None, True, 8)
            self.fail_capture, self.bodies, self.undone = fail_capture, 0, False

        def _body(self):
            self.bodies += 1
            self.collection.step += 1  # as a training forward counts its step
            if self.fail_capture and self.bodies == 2:
                raise RuntimeError("no capture here")
            return torch.tensor(float(self.bodies))

        def _undo_capture(self):
            def undo():
                self.undone = True

            return undo

    s = Step()
    losses = [float(s._run()) for _ in range(3)]
    assert (s.captures, s.replays, s.bodies, s.graph.replayed, len(launched)) == (1, 2, 2, 2, 2)
    assert s.collection.step == 3  # the warm-up's step and two replays; the capture's forward is not counted
    assert losses == [1.0, 2.0, 2.0]  # the warm-up's loss, then the captured loss buffer's
    s.close()
    assert s.graph is None
    f = Step(fail_capture=True)
    with pytest.raises(
        RuntimeError, match=r"Step: capturing the step failed \(RuntimeError: no capture here\).*`c\(kjt\)`"
    ):
        f._run()
    assert f.undone and f.collection.step == 1 and f.graph is None and f.captures == 0
    with pytest.raises(ValueError, match="Step: not this one"):
        emb_graph.CapturedStep(Collection(), "not this one", True, 8)
    with pytest.raises(ValueError, match="needs a CUDA collection"):
        emb_graph.CapturedStep(SimpleNamespace(device=torch.device("cpu")), None, True, 8)
