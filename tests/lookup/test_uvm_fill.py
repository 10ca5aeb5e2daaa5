"""embshard/lookup/uvm_fill.py: host threads zero a buffer piece by piece (`wait(view)` returns with the view's
pieces zero), and FBGEMM's `apply_split_helper` run through `host_first_touch_helper` registers the same buffers
(names, sizes, dtypes, zeros, placements and offsets) as FBGEMM's own, with the UVM buffer from the given
allocator; the patch is applied only inside `uvm_first_touch()`."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("fbgemm_gpu")

from fbgemm_gpu import split_table_batched_embeddings_ops_training as training  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation  # noqa: E402

from embshard.lookup import uvm_fill  # noqa: E402
from embshard.lookup.uvm_fill import HostFirstTouch, host_first_touch_helper, uvm_first_touch  # noqa: E402


def test_pieces_zeroed_and_waited(monkeypatch):
    monkeypatch.setattr(uvm_fill, "PIECE_BYTES", 4 * 1000)  # 1000 fp32 a piece: many pieces
    gen = torch.Generator().manual_seed(0)
    buf = torch.rand(37_001, generator=gen) + 1.0  # no zero anywhere before
    rows = buf[:37_000].view(-1, 8)
    touch = HostFirstTouch(threads=3)
    touch.zero_async(buf)
    for r0 in torch.randint(0, rows.shape[0] - 50, (20,), generator=gen).tolist():
        view = rows[r0 : r0 + 50]
        touch.wait(view)
        assert torch.count_nonzero(view) == 0
    touch.wait(buf[-1:])
    assert buf[-1] == 0
    touch.close()
    assert torch.count_nonzero(buf) == 0
    with pytest.raises(ValueError, match="contiguous"):
        HostFirstTouch(1).zero_async(rows.t())


class _Module(torch.nn.Module):
    pass


def _apply(helper, split, prefix, dtype, **kw):
    m = _Module()
    log: list[str] = []
    helper(
        m.register_buffer, functools.partial(setattr, m), torch.device("cpu"), False, [0, 1, 1, 2], split, prefix,
        dtype, uvm_tensors_log=log, **kw
    )  # fmt: skip
    return m, log


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("enforce_hbm", [False, True])
def test_same_buffers_as_fbgemm(monkeypatch, dtype, enforce_hbm):
    monkeypatch.setattr(uvm_fill, "PIECE_BYTES", 256)
    specs = [(50, 8, EmbeddingLocation.MANAGED_CACHING, None), (30, 4, EmbeddingLocation.DEVICE, None)]
    specs.append((20, 12, EmbeddingLocation.MANAGED, None))
    uvm_sizes = []
    for rowwise in (False, True):
        split = training.construct_split_state(specs, rowwise=rowwise, cacheable=not rowwise)
        uvm_sizes.append(split.uvm_size)
        want, want_log = _apply(training.apply_split_helper, split, "weights", dtype, enforce_hbm=enforce_hbm)
        allocated = []

        def allocate(device, dt, n, allocated=allocated):
            allocated.append(n)
            return torch.full((n,), float("nan"), dtype=dt, device=device)

        touch = HostFirstTouch(threads=2)
        helper = host_first_touch_helper(training.apply_split_helper, touch, allocate, lambda t: t)
        got, got_log = _apply(helper, split, "weights", dtype, enforce_hbm=enforce_hbm)
        touch.close()
        assert allocated == ([] if enforce_hbm or split.uvm_size == 0 else [split.uvm_size])
        assert got_log == want_log
        assert dict(got.named_buffers()).keys() == dict(want.named_buffers()).keys()
        for name, w in want.named_buffers():
            g = dict(got.named_buffers())[name]
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), name
        for attr in ("weights_physical_placements", "weights_physical_offsets"):
            assert getattr(got, attr) == getattr(want, attr)
    assert uvm_sizes == [50 * 8 + 20 * 12, 0]  # per-element state in UVM; row-wise state on the device


def test_applied_only_inside_the_context(monkeypatch):
    original = training.apply_split_helper
    monkeypatch.delenv("EMBSHARD_UVM_FIRST_TOUCH", raising=False)  # a benchmark's setting in the environment
    with uvm_first_touch(threads=1) as touch:  # the default: FBGEMM's own fill
        assert touch is None and training.apply_split_helper is original
    monkeypatch.setenv("EMBSHARD_UVM_FIRST_TOUCH", "host")
    with uvm_first_touch(threads=1) as touch:
        assert isinstance(touch, HostFirstTouch) and training.apply_split_helper is not original
    assert training.apply_split_helper is original
    with pytest.raises(RuntimeError), uvm_first_touch(threads=1):
        raise RuntimeError("a failing constructor")
    assert training.apply_split_helper is original
    monkeypatch.setenv("EMBSHARD_UVM_FIRST_TOUCH", "fbgemm")
    with uvm_first_touch() as touch:
        assert touch is None and training.apply_split_helper is original
    monkeypatch.setenv("EMBSHARD_UVM_FIRST_TOUCH", "gpu")
    with pytest.raises(ValueError, match="EMBSHARD_UVM_FIRST_TOUCH='gpu' is invalid: choose host or fbgemm"):
        with uvm_first_touch():
            pass
    monkeypatch.setenv("EMBSHARD_UVM_THREADS", "0")
    with pytest.raises(ValueError, match="EMBSHARD_UVM_THREADS='0' must be a whole number >= 1"):
        uvm_fill.default_threads()
    monkeypatch.setenv("EMBSHARD_UVM_THREADS", "3")
    assert uvm_fill.default_threads() == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tier", ["uvm_caching", "uvm"])
def test_uvm_tbe_same_as_fbgemm_fill(monkeypatch, tier):
    """On a GPU: a TBE built with the host first touch holds FBGEMM's managed memory (UVM, not device memory),
    weights bit for bit `init_rows` and the same as with FBGEMM's own fill, and zero per-element optimizer state."""
    from embshard import FusedOptimizerConfig, TableConfig
    from embshard.lookup import LocalShard, TBELookup, init_rows
    from embshard.spec.plan import Shard

    monkeypatch.setattr(uvm_fill, "PIECE_BYTES", 1 << 16)  # many pieces
    monkeypatch.setattr("embshard.lookup.tbe.INIT_BLOCK_BYTES", 1 << 15)  # many blocks, waited piece by piece
    tables = [TableConfig("ta", 3001, 64, ("fa",)), TableConfig("tb", 777, 16, ("fb",))]
    shards = [LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, t.embedding_dim), t.feature_names, tier)
              for i, t in enumerate(tables)]  # fmt: skip
    opt = FusedOptimizerConfig("adagrad", lr=0.1)
    zeroed: list[int] = []
    zero_async = HostFirstTouch.zero_async

    def counted(self, host, address=None):
        zeroed.append(host.numel())
        return zero_async(self, host, address)

    monkeypatch.setattr(HostFirstTouch, "zero_async", counted)
    built = {}
    for way in ("host", "fbgemm"):
        monkeypatch.setenv("EMBSHARD_UVM_FIRST_TOUCH", way)
        zeroed.clear()
        lk = TBELookup(shards, opt, torch.device("cuda", 0), seed=7)
        torch.cuda.synchronize()
        n = 3001 * 64 + 777 * 16
        assert zeroed == ([n, n] if way == "host" else []), zeroed  # weights and adagrad's state, on host threads
        assert torch.ops.fbgemm.is_uvm_tensor(lk.tbe.weights_uvm) and lk.tbe.weights_uvm.numel() == 3001 * 64 + 777 * 16
        assert (
            torch.count_nonzero(lk.tbe.momentum1_uvm) == 0
            and lk.tbe.momentum1_uvm.numel() == lk.tbe.weights_uvm.numel()
        )
        built[way] = [w.clone() for w in lk.shard_weights()]
    for s, w_host, w_fbgemm in zip(shards, built["host"], built["fbgemm"]):
        want = init_rows(s.table, s.table_index, 0, s.table.num_embeddings, 0, s.table.embedding_dim, 7, "cpu")
        assert torch.equal(w_host.cpu(), want) and torch.equal(w_fbgemm.cpu(), want)
