"""The sequence lookup's cut of each shard's ids into bags for FBGEMM's no-bag TBE (embshard.lookup.sequence
bag_offsets): every id in exactly one bag of its own key, in order, at most BAG_IDS ids a bag, and the TBE's rows and
fused update the same as with one bag a key."""

from __future__ import annotations

import pytest
import torch

from embshard.lookup.sequence import BAG_IDS, bag_offsets


@pytest.mark.parametrize("sizes", [[0], [1], [5, 0, 70], [BAG_IDS], [BAG_IDS + 1, 3], [1000, 999, 1, 0, 64]])
def test_bags_cover_each_key_in_order(sizes):
    off = bag_offsets(sizes)
    T = len(sizes)
    assert (off.numel() - 1) % T == 0
    B = (off.numel() - 1) // T
    assert off[0] == 0 and off[-1] == sum(sizes)
    assert bool((off[1:] >= off[:-1]).all())
    starts = [sum(sizes[:t]) for t in range(T)]
    for t, n in enumerate(sizes):
        assert off[t * B] == starts[t]  # key t's bags start at its first id and end where key t + 1 begins
        end = off[(t + 1) * B] if t + 1 < T else off[-1]
        assert end == starts[t] + n
    assert int((off[1:] - off[:-1]).max()) <= BAG_IDS


def test_tbe_rows_and_update_equal_one_bag_per_key():
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    specs = [(50, 8, fb.EmbeddingLocation.HOST, fb.ComputeDevice.CPU), (40, 8, fb.EmbeddingLocation.HOST,
                                                                         fb.ComputeDevice.CPU)]  # fmt: skip
    kw = dict(pooling_mode=PoolingMode.NONE, optimizer=fb.OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    tbes = [fb.SplitTableBatchedEmbeddingBagsCodegen(specs, **kw) for _ in range(2)]
    w0 = [w.detach().clone() for w in tbes[0].split_embedding_weights()]
    for tbe in tbes[1:]:
        for w, src in zip(tbe.split_embedding_weights(), w0):
            w.detach().copy_(src)
    sizes = [
        int(torch.randint(BAG_IDS, 5 * BAG_IDS, (1,), generator=gen)),
        int(torch.randint(0, 9, (1,), generator=gen)),
    ]
    ids = [torch.randint(0, 50, (sizes[0],), generator=gen), torch.randint(0, 40, (sizes[1],), generator=gen)]
    idx = torch.cat(ids)
    grad = torch.randn(sum(sizes), 8, generator=gen)
    rows_many = tbes[0](idx, bag_offsets(sizes))
    rows_one = tbes[1](idx, torch.tensor([0, sizes[0], sum(sizes)]))
    ref = torch.cat([w0[0][ids[0]], w0[1][ids[1]]])
    torch.testing.assert_close(rows_many, ref, rtol=0, atol=0)
    torch.testing.assert_close(rows_one, ref, rtol=0, atol=0)
    rows_many.backward(grad)
    rows_one.backward(grad)
    for a, b, w in zip(tbes[0].split_embedding_weights(), tbes[1].split_embedding_weights(), w0):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, w) or sizes[1] == 0  # the update happened
