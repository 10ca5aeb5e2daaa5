"""Unit tests of the explicit collectives (embshard/runtime/comm.py) and the two exchanges (sharding/exchange.py) on
several gloo processes (NCCL with EMBSHARD_TEST_DEVICE=cuda), against values computed independently here."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dist_harness import run_distributed

WORLDS = [1, 2, 3]


def _collectives(rank, world, device):
    from embshard.runtime.comm import start_all_gather, start_all_reduce, start_all_to_all

    gen = torch.Generator().manual_seed(rank)
    out = {}
    # all-to-all of rows: rank r sends (r + d + 1) rows to d, each row [r, d, random]
    send_rows = [
        torch.stack([torch.full((r_d,), float(rank)), torch.full((r_d,), float(d)), torch.rand(r_d, generator=gen)], 1)
        for d, r_d in enumerate(rank + d + 1 for d in range(world))
    ]
    x = torch.cat(send_rows).to(device).requires_grad_()
    h = start_all_to_all(x, [rank + d + 1 for d in range(world)], [s + rank + 1 for s in range(world)], label="test")
    y = h.wait()
    out["received"] = y.detach().cpu()
    out["sent"] = x.detach().cpu()
    # backward: the gradient of sum(y * c) sent back along the reverse route
    coef = torch.arange(y.shape[0], dtype=torch.float32, device=device)[:, None] + 1
    (y * coef).sum().backward()
    out["grad"] = x.grad.cpu()
    out["coef"] = coef.cpu()
    v = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    out["reduced"] = start_all_reduce(v.clone()).wait().cpu()
    out["gathered"] = start_all_gather(torch.tensor([rank, rank * rank], device=device)).wait(host=True).cpu()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_move_the_right_rows_and_gradients(world):
    res = run_distributed(_collectives, world)
    for r, out in enumerate(res):
        got = out["received"]
        # from source s, rank r receives (s + r + 1) rows tagged [s, r, *]
        expect_src = [s for s in range(world) for _ in range(s + r + 1)]
        assert got[:, 0].tolist() == expect_src and set(got[:, 1].tolist()) <= {float(r)}
        # the random column equals what source s sent to r
        for s in range(world):
            sent_s = res[s]["sent"]
            rows_to_r = sent_s[sent_s[:, 1] == r]
            mine = got[got[:, 0] == s]
            torch.testing.assert_close(mine, rows_to_r)
        # gradient: row k of my sent rows went to d at position p: grad = coef_d[p]
        for d in range(world):
            coef_d = res[d]["coef"][:, 0]
            recv_d = res[d]["received"]
            pos = (recv_d[:, 0] == r).nonzero().flatten()
            grad_rows = out["grad"][out["sent"][:, 1] == d]
            torch.testing.assert_close(grad_rows, coef_d[pos][:, None].expand(-1, 3).contiguous())
        assert out["reduced"].tolist() == [i * world + 10 * sum(range(world)) for i in range(4)]
        assert out["gathered"].tolist() == [[s, s * s] for s in range(world)]


def _exchanges(rank, world, device, batch_sizes):
    """Ids of 3 features laid out destination-major: feature f goes to rank f % world. Then pooled rows back."""
    from embshard.sharding.exchange import LocalIds, gather_batch_counts, start_pooled_exchange, start_sparse_exchange

    B = batch_sizes[rank]
    gen = torch.Generator().manual_seed(100 + rank)
    F = 3
    lengths_FB = torch.randint(0, 3, (F, B), generator=gen)
    values = [torch.randint(0, 1000, (int(n),), generator=gen) for n in lengths_FB.sum(1)]
    counts = gather_batch_counts(lengths_FB.sum(1).to(device), B, None, None, step=4)
    dest = [f % world for f in range(F)]
    order = [f for d in range(world) for f in range(F) if dest[f] == d]
    sent = [int(sum(lengths_FB[f].sum() for f in range(F) if dest[f] == d)) for d in range(world)]
    received = [int(sum(counts.ids[s, f] for f in range(F) if dest[f] == rank)) for s in range(world)]
    ids = LocalIds(
        lengths_FB[order].reshape(-1).to(device),
        torch.cat([values[f] for f in order]).to(device),
        None,
        sent,
        received,
    )
    n_features = [sum(1 for f in range(F) if dest[f] == d) for d in range(world)]
    inp = start_sparse_exchange(ids, n_features, counts.batch_sizes, None, rank).wait()
    mine = [f for f in range(F) if dest[f] == rank]
    # pooled: this rank's features' sums over the global batch, [B_global, 2 per feature]
    Bg = inp.global_batch
    pooled = torch.zeros(Bg, 2 * len(mine), device=device)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), inp.lengths.cpu().long().cumsum(0)])
    for k in range(len(mine)):
        for b in range(Bg):
            seg = inp.values.cpu()[offsets[k * Bg + b] : offsets[k * Bg + b + 1]].float()
            pooled[b, 2 * k] = seg.sum()
            pooled[b, 2 * k + 1] = float(seg.numel())
    blocks = start_pooled_exchange(pooled, counts.batch_sizes, [2 * n for n in n_features], None, rank).wait()
    return {
        "lengths_FB": lengths_FB,
        "values": values,
        "counts": counts,
        "inp": (inp.lengths.cpu(), inp.values.cpu(), inp.batch_sizes),
        "blocks": [b.cpu() for b in blocks],
        "mine": mine,
    }


@pytest.mark.parametrize("world,batch_sizes", [(1, [4]), (2, [3, 3]), (2, [4, 0]), (3, [2, 0, 5])])
def test_sparse_and_pooled_exchanges(world, batch_sizes):
    res = run_distributed(_exchanges, world, batch_sizes)
    F = 3
    for r, out in enumerate(res):
        c = out["counts"]
        assert c.batch_sizes == batch_sizes and c.bad_ranks == []
        assert np.array_equal(c.ids, np.stack([res[s]["lengths_FB"].sum(1).numpy() for s in range(world)]))
        lengths, values, _ = out["inp"]
        # feature-major over the global batch: for each of my features, source 0's bags, then source 1's ...
        want_lengths = torch.cat([res[s]["lengths_FB"][f] for f in out["mine"] for s in range(world)])
        want_values = torch.cat([res[s]["values"][f] for f in out["mine"] for s in range(world)])
        assert torch.equal(lengths.long(), want_lengths.long()) and torch.equal(values, want_values)
        # pooled back: my samples' sums and bag lengths for every feature, from its serving rank
        feats_by_rank = [[f for f in range(F) if f % world == d] for d in range(world)]
        blocks = iter(out["blocks"])
        for d in range(world):
            if not feats_by_rank[d]:
                continue
            blk = next(blocks)
            assert blk.shape == (batch_sizes[r], 2 * len(feats_by_rank[d]))
            for k, f in enumerate(feats_by_rank[d]):
                lens = res[r]["lengths_FB"][f]
                ends = lens.cumsum(0)
                sums = [res[r]["values"][f][int(e - n) : int(e)].sum().item() for n, e in zip(lens, ends)]
                assert blk[:, 2 * k].tolist() == [float(x) for x in sums]
                assert blk[:, 2 * k + 1].tolist() == lens.float().tolist()


def test_route_matrix_counts_keys_per_feature_and_rank():
    from embshard.sharding.exchange import route_matrix

    m = route_matrix([["a", "b"], ["a", "a", "c"], []], {"a": 0, "b": 1, "c": 2})
    assert m.tolist() == [[1, 2, 0], [1, 0, 0], [0, 1, 0]]


class _Launch:
    """Stands in for the CUDA event recorded after a graph replay: counts the host waits on it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_uncaptured_collectives_wait_for_the_latest_graph_launch_once(monkeypatch):
    """With NCCL graph mixing off, a collective outside a graph waits (on the host) for the latest replay of a graph
    holding collectives of its group, once; collectives of other groups, gloo groups and captures do not wait; with
    mixing on, replays are not noted."""
    import torch.distributed as dist

    from embshard.runtime import comm

    events = []

    class _Stream:
        def record_event(self):
            events.append(_Launch())
            return events[-1]

    dense, main = object(), object()  # two NCCL groups
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo" if group == "cpu group" else "nccl")
    monkeypatch.setattr(comm, "_GRAPH_LAUNCHES", {})
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    comm.graph_launched()
    assert events == [] and comm._GRAPH_LAUNCHES == {}  # mixing on (NCCL's default): nothing to keep
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "0")
    comm.graph_launched([dense])  # a dense step's graph: the dense group's all-reduce only
    comm.wait_for_graphs(main)  # another communicator: no wait
    comm.wait_for_graphs("cpu group")  # a gloo group never meets a graph
    assert events[0].waits == 0
    comm.graph_launched([dense])  # replays complete in stream order: the latest one is the one to wait for
    comm.wait_for_graphs(dense)
    assert [e.waits for e in events] == [0, 1] and comm._GRAPH_LAUNCHES == {}
    comm.graph_launched()  # a whole step's graph: every group's collectives
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    comm.wait_for_graphs(main)  # under a capture: a collective of the graph being made, no wait
    assert events[2].waits == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    comm.wait_for_graphs(main)
    comm.wait_for_graphs()  # waited for already: once
    assert [e.waits for e in events] == [0, 1, 1] and comm._GRAPH_LAUNCHES == {}


def test_whole_step_graph_turns_nccl_graph_mixing_off_on_gpus_only(monkeypatch):
    from embshard.runtime.distributed import nccl_settings

    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    nccl_settings(whole_step_graph=True, cuda=False)
    nccl_settings(whole_step_graph=False, cuda=True)
    assert "NCCL_GRAPH_MIXING_SUPPORT" not in os.environ
    nccl_settings(whole_step_graph=True, cuda=True)
    assert os.environ["NCCL_GRAPH_MIXING_SUPPORT"] == "0"
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "1")  # the environment's own setting wins
    nccl_settings(whole_step_graph=True, cuda=True)
    assert os.environ["NCCL_GRAPH_MIXING_SUPPORT"] == "1"
