"""The HSTU layers' two attention layouts (embshard/models/hstu_attention.py): the jagged tile-pair attention
equals the padded reference on outputs and on every gradient (fp32, 1e-5; 5e-5 on a GPU), for length mixes with
histories of 1 item and of the longest allowed, several tile sizes, with and without the time bias; time buckets;
the tile pairs cover only each history's own causal tiles."""

from __future__ import annotations

import torch
from dist_harness import device_kind

from embshard.models.hstu_attention import JaggedAttention, time_buckets
from embshard.models.sequential import HSTUDense

CUDA = device_kind() == "cuda" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
MAX = 9  # model max_length: histories of up to 10 items
TOL = 1e-5 if DEVICE.type == "cpu" else 5e-5  # a GPU's fp32 matmuls may sum in other orders


def _run(model: HSTUDense, items, lengths, context, times, weights):
    items = items.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(items, lengths, context, times)
    (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), items.grad, grads


def test_jagged_attention_equals_padded_on_outputs_and_gradients():
    g = torch.Generator().manual_seed(0)
    mixes = [[1, 10, 3, 1, 10], [10] * 3, [1], [2, 7, 0, 5, 9], torch.randint(0, 11, (12,), generator=g).tolist()]
    cases = [(3, lens, i % 2 == 1) for i, lens in enumerate(mixes)]
    cases += [(1, mixes[0], True), (1, mixes[3], False), (64, mixes[1], True), (64, mixes[4], False)]
    cases += [(4, mixes[0], False), (4, mixes[4], True)]
    for tile, lens, time_bias in cases:
        torch.manual_seed(tile)
        padded = HSTUDense(8, 3, 2, 2, MAX, attention="padded", tile=tile, time_bias=time_bias).to(DEVICE)
        for p in padded.parameters():  # every bias and weight away from its initial value
            torch.nn.init.normal_(p, std=0.3)
        jagged = HSTUDense(8, 3, 2, 2, MAX, attention="jagged", tile=tile, time_bias=time_bias).to(DEVICE)
        jagged.load_state_dict(padded.state_dict())
        lengths = torch.tensor(lens, device=DEVICE)
        N = int(lengths.sum())
        items, context = torch.randn(N, 8, device=DEVICE), torch.randn(len(lens), 3, device=DEVICE)
        times = torch.cumsum(torch.randint(0, 10**6, (N,), device=DEVICE), 0) + 10**9
        weights = torch.randn(N, 8, device=DEVICE)
        ref, got = (_run(m, items, lengths, context, times, weights) for m in (padded, jagged))
        torch.testing.assert_close(got[0], ref[0], rtol=TOL, atol=TOL)
        torch.testing.assert_close(got[1], ref[1], rtol=TOL, atol=TOL)
        assert got[2].keys() == ref[2].keys()
        assert ("layers.0.time_bias" in ref[2]) == time_bias
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], rtol=TOL, atol=TOL, msg=name)


def test_time_buckets_and_tile_pairs():
    gaps = torch.tensor([0, 1, -1, 2, 3, 100, 10**9, -(10**9), 1 << 62])
    b = time_buckets(gaps).tolist()
    assert b[:3] == [0, 0, 0] and b[3] == 2 and b[4] == 3 and b[5] == 15 and b[6] == b[7] == 68 and b[8] == 127
    lengths = torch.tensor([5, 1, 0, 9])
    att = JaggedAttention(lengths, 4, torch.device("cpu"))
    assert att.num_tiles == 2 + 1 + 0 + 3
    # causal pairs inside each history only: (1+2) + 1 + (1+2+3); a padded batch would need 4 x 3 x 3 tile pairs
    assert att.pair_q.tolist() == [0, 1, 1, 2, 3, 4, 4, 5, 5, 5]
    assert att.delta_P.tolist() == [0, 1, 0, 0, 0, 1, 0, 2, 1, 0]
    assert att.slot_N.tolist() == [0, 1, 2, 3, 4, 8, *range(12, 21)]
    assert int(att.weight_PTT.count_nonzero()) == 15 + 1 + 45  # every (query, key <= query) pair once
