"""The sequence collection's padded step (SequenceStepGraph; captured on CUDA, eager on the CPU) against the eager
step of an identical collection: the loss of every step, each feature's rows and lengths (the batch's own rows
first, the fillers' rows zero), and the weights after every step. The loss weighs every row of the padded output,
fillers included, by a random upstream gradient and adds its squares, so a filler left unzeroed in the forward
(the loss) or in the backward (its row's update) fails. Table-wise, column-wise and data-parallel tables, sgd,
adagrad and row-wise adagrad, world sizes 1 and 2, fresh random batches whose sizes move the capacity and the
filler windows (a batch over the capacity, a batch far under it)."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from dist_harness import device_kind
from seq_cases import OPTIMIZERS, TABLES, TIER, to_kjt

from embshard import FusedOptimizerConfig, simple_plan
from embshard.collection.sequence import ShardedEmbeddingCollection
from embshard.collection.sequence_graph import SequenceStepGraph, refusal
from embshard.sharding.exchange import parse_counts
from embshard.spec.plan import MemoryTier

DEVICE = "cuda" if device_kind() == "cuda" else "cpu"  # the refusals' and host counts' collections

GRAPH_TABLES = [replace(t, max_length=None) for t in TABLES]
SAME_WIDTH = [
    replace(t, max_length=None, embedding_dim=8) for t in TABLES
]  # one lookup on one rank: rows zeroed in place
KEYS = ["h_d", "h_a2", "h_b", "h_a", "h_c"]  # not the tables' order
CASES = [  # (tables, types per table, optimizer)
    ("same", ["table_wise"] * 4, "rowwise_adagrad"),
    ("mixed", ["table_wise"] * 4, "sgd"),
    ("mixed", ["column_wise", "table_wise", "data_parallel", "table_wise"], "adagrad"),
    ("same", ["data_parallel", "column_wise", "table_wise", "column_wise"], "sgd"),
]
# per step, the mean history length (the batch size is fixed): the second step over the first's capacity, the third
# far under it (its fillers overflow the first windows), the last like the first
MEANS = [3, 6, 1, 3, 3]


def _batch(gen: torch.Generator, B: int, mean: int) -> dict:
    out = {}
    for t in SAME_WIDTH:
        for f in t.feature_names:
            lengths = torch.randint(0, 2 * mean + 1, (B,), generator=gen)
            ids = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * t.num_embeddings).long()
            out[f] = (lengths, ids)
    return out


def _counts(ec, kjt_cpu, world: int):
    row = ec.host_counts(kjt_cpu)
    if world == 1:
        return parse_counts(row[None].numpy())
    rows = [torch.zeros_like(row) for _ in range(world)]
    torch.distributed.all_gather(rows, row)
    return parse_counts(torch.stack(rows).numpy())


def graph_worker(rank, world, device, cases, seed):
    """Per case, per step: (eager loss, padded loss, {feature: (eager rows, padded rows, padded lengths)}), and the
    largest weight difference after each step."""
    capture = torch.device(device).type == "cuda"
    out = []
    for k, (which, types, opt) in enumerate(cases):
        tables = SAME_WIDTH if which == "same" else GRAPH_TABLES
        plan = simple_plan(tables, world, world, dict(zip([t.name for t in tables], types)), tier=TIER, column_shards=2)
        eager = ShardedEmbeddingCollection(tables, plan, OPTIMIZERS[opt], device=device)
        padded = ShardedEmbeddingCollection(tables, plan, OPTIMIZERS[opt], device=device)
        gen = torch.Generator().manual_seed(seed + 1000 * k + rank)
        dims = {f: t.embedding_dim for t in tables for f in t.feature_names}
        up = {f: torch.randn(1024, dims[f], generator=gen).to(device) for f in KEYS}  # upstream gradients per row
        seen: dict = {}

        def loss_of(o, up=up, seen=seen):
            if not (capture and torch.cuda.is_current_stream_capturing()):  # a capture copies nothing out
                seen.update({f: (o[f].values().detach().cpu().clone(), o[f].lengths().cpu().clone()) for f in KEYS})
            return sum((o[f].values() * up[f][: o[f].values().shape[0]]).sum() + o[f].values().square().sum()
                       for f in KEYS)  # fmt: skip

        graph = SequenceStepGraph(padded, loss_of, capture=capture, headroom=0.0)
        steps = []
        for mean in MEANS:
            batch = _batch(gen, 40, mean)
            kjt_cpu = to_kjt(batch, KEYS, "cpu")
            kjt = kjt_cpu.to(device)
            eager_out = eager(kjt)
            want = {f: eager_out[f].values().detach().cpu() for f in KEYS}
            loss_e = sum((eager_out[f].values() * up[f][: want[f].shape[0]]).sum() + eager_out[f].values().square().sum()
                         for f in KEYS)  # fmt: skip
            loss_e.backward()
            seen.clear()
            loss_p = graph.step(kjt, _counts(padded, kjt_cpu, world))
            rows = {f: (want[f], *seen[f]) for f in KEYS} if seen else {}  # a replay runs no Python
            we, wp = eager.full_weights(), padded.full_weights()
            # relative to the table's largest weight: CUDA's backward sums a row's gradients in another order when
            # fillers share its sort (each filler adds an exact zero), a few units in the last place apart
            diff = max(float((we[t] - wp[t]).abs().max() / we[t].abs().max().clamp(min=1.0)) for t in we)
            steps.append((float(loss_e.detach()), float(loss_p), rows, diff))
        out.append((steps, graph.captures, graph.replays))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_padded_step_trains_like_the_eager_step(run, world):
    seed = int.from_bytes(os.urandom(3), "little")
    ranks = run(graph_worker, world, CASES, seed)
    for r in range(world):
        for (which, types, opt), (steps, captures, replays) in zip(CASES, ranks[r]):
            where = f"world {world} rank {r} seed {seed} {which} {types} {opt}"
            if device_kind() == "cuda":  # captured at the first three batches' sizes, replayed after
                assert captures == 3 and replays == 2, f"{where}: {captures} captures, {replays} replays"
            for s, (loss_e, loss_p, rows, diff) in enumerate(steps):
                assert abs(loss_p - loss_e) <= 1e-4 * max(1.0, abs(loss_e)), (
                    f"{where} step {s}: loss {loss_p} != {loss_e}"
                )
                for f, (want, got, lengths) in rows.items():
                    n = want.shape[0]
                    assert got.shape[0] >= n and got.shape[0] % 64 == 0, f"{where} step {s} {f}: {got.shape[0]} rows"
                    torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-6)
                    assert not got[n:].any(), f"{where} step {s} {f}: filler rows not zero"
                    assert int(lengths.sum()) == n, f"{where} step {s} {f}: lengths sum {int(lengths.sum())} != {n}"
                assert diff <= 2e-6, f"{where} step {s}: weights differ by {diff} of the largest weight"


def test_refusals_name_the_table_and_the_fix():
    def ec(tables=GRAPH_TABLES, types="table_wise", opt="sgd", dedup=False):
        plan = simple_plan(tables, 1, 1, dict.fromkeys([t.name for t in tables], types), tier=TIER)
        return ShardedEmbeddingCollection(tables, plan, OPTIMIZERS[opt], device=DEVICE, dedup=dedup)

    assert refusal(ec()) is None
    assert "dedup" in refusal(ec(dedup=["s_c"])) and "s_c" in refusal(ec(dedup=["s_c"]))
    assert "row_wise" in refusal(ec(types="row_wise"))
    assert "s_b" in refusal(ec(tables=TABLES)) and "max_length" in refusal(ec(tables=TABLES))
    assert "adam" in refusal(ec(opt="adam"))
    wd = ShardedEmbeddingCollection(GRAPH_TABLES, simple_plan(GRAPH_TABLES, 1, 1, tier=TIER),
                                    FusedOptimizerConfig("rowwise_adagrad", lr=0.1, weight_decay=0.01), device=DEVICE)  # fmt: skip
    assert "weight decay" in refusal(wd)
    with pytest.raises(ValueError, match="dedup"):
        SequenceStepGraph(ec(dedup=True), lambda o: o, capture=False)
    on_cpu = ShardedEmbeddingCollection(
        GRAPH_TABLES, simple_plan(GRAPH_TABLES, 1, 1, tier=MemoryTier.HOST), OPTIMIZERS["sgd"], device="cpu"
    )
    with pytest.raises(ValueError, match="needs a CUDA collection"):
        SequenceStepGraph(on_cpu, lambda o: o, capture=True)


def test_host_counts_make_the_same_step_without_a_sync_and_wrong_counts_are_refused():
    plan = simple_plan(TABLES, 1, 1, tier=TIER)  # max_length on s_b: the counts are those kept
    a = ShardedEmbeddingCollection(TABLES, plan, OPTIMIZERS["adagrad"], device=DEVICE)
    b = ShardedEmbeddingCollection(TABLES, plan, OPTIMIZERS["adagrad"], device=DEVICE)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(3), "little"))
    for _ in range(2):
        batch = _batch(gen, 7, 3)
        kjt_cpu = to_kjt(batch, KEYS, "cpu")
        kjt = kjt_cpu.to(DEVICE)
        counts = parse_counts(b.host_counts(kjt_cpu)[None].numpy())
        assert counts.ids.sum() == sum(int(a(kjt)[f].lengths().sum()) for f in KEYS)  # the kept ids
        oa = a(kjt)
        if DEVICE == "cuda":  # with the counts given, the forward never waits for the GPU
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            ob = b(kjt, counts=counts)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        sum(o.values().square().sum() for o in oa.values()).backward()
        sum(o.values().square().sum() for o in ob.values()).backward()
        for f in KEYS:
            assert torch.equal(oa[f].lengths(), ob[f].lengths()) and torch.equal(oa[f].values(), ob[f].values())
    wa, wb = a.full_weights(), b.full_weights()
    assert all(torch.equal(wa[t], wb[t]) for t in wa)
    bad = parse_counts(np.concatenate([b.host_counts(kjt_cpu)[None].numpy()] * 2))
    with pytest.raises(ValueError, match="gather every rank's host_counts"):
        b(kjt, counts=bad)
    c = ShardedEmbeddingCollection(GRAPH_TABLES, simple_plan(GRAPH_TABLES, 1, 1, tier=TIER), device=DEVICE)
    graph = SequenceStepGraph(c, lambda o: sum(v.values().sum() for v in o.values()), capture=False)
    lengths, ids = batch[KEYS[0]]  # the batch with one id more (a random other batch may hold as many ids as it)
    one_more = (
        lengths + (torch.arange(len(lengths)) == 0).to(lengths.dtype),
        torch.cat([torch.zeros(1, dtype=ids.dtype), ids]),
    )
    other = to_kjt({**batch, KEYS[0]: one_more}, KEYS, "cpu")
    with pytest.raises(ValueError, match="pass the counts of this same batch"):
        graph.step(kjt, parse_counts(c.host_counts(other)[None].numpy()))
    wrong = to_kjt({**_batch(gen, 7, 3), "h_c": (torch.tensor([1, 0, 0, 0, 0, 0, 0]), torch.tensor([30]))}, KEYS, "cpu")
    assert b.host_counts(wrong)[1] == 1  # one id outside s_c (30 rows)
