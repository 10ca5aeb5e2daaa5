"""The Triton kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, so tests/kernels/test_kernels_interpret.py runs this file in its own pytest process; alone:
`TRITON_INTERPRET=1 pytest tests/kernels_interpret_cases.py`). Same cases as the device tests: small tables
against the plain-PyTorch reference (atomic and sorted backward, every update rule), the sorted mode bitwise
reproducible, the dense gradient against the torch path, the regroup against torch.cat."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import (
    OPTIMIZERS,
    TABLES,
    check_against_reference,
    full_shards,
    random_regroup_case,
    random_step,
    regroup_grad_reference,
    regroup_reference,
    train_against_reference,
)

from embshard.kernels.layout import Tiles
from embshard.kernels.small_tables import SmallTableLookup, SmallTableOptions, dense_gradients, pool
from embshard.options import LookupOptions

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
CPU = torch.device("cpu")
TRITON = SmallTableOptions(impl="triton")


@pytest.mark.parametrize(
    "opt,deterministic",
    [("sgd", False), ("rowwise_adagrad", False), ("rowwise_adagrad", True), ("adagrad", True), ("adam", False)]
    + [("rowwise_adagrad_wd", False), ("sgd_wd", True)],
)
def test_triton_trains_like_the_reference(opt, deterministic):
    cfg = OPTIMIZERS[opt]
    # small sorted tiles: hot rows cross many tile boundaries (the fix-up pass)
    kernel = SmallTableOptions(impl="triton", deterministic=deterministic, tiles=Tiles(sorted_block_n=4))
    make = lambda: SmallTableLookup(full_shards(TABLES, CPU), cfg, CPU, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


def test_triton_direct_sgd():
    cfg = OPTIMIZERS["sgd"]
    kernel = SmallTableOptions(impl="triton", direct_sgd=True)
    make = lambda: SmallTableLookup(full_shards(TABLES, CPU), cfg, CPU, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, TABLES, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, TABLES)


def test_sorted_backward_is_bitwise_reproducible_and_tiles_do_not_matter():
    cfg = OPTIMIZERS["rowwise_adagrad"]
    runs = []
    for tiles in ({}, {"bags": 2, "block_n": 4, "sorted_block_n": 2}, {}):
        kernel = SmallTableOptions(impl="triton", deterministic=True, tiles=Tiles(**tiles))
        lookup = SmallTableLookup(full_shards(TABLES[:2], CPU), cfg, CPU, seed=2, kernel=kernel)
        gen = torch.Generator().manual_seed(4)
        for _ in range(2):
            idx, off, psw, _, up = random_step(TABLES[:2], 4, gen)
            (lookup(idx, off, psw) * torch.cat(list(up.values()), dim=1)).sum().backward()
        runs.append([w.clone() for w in lookup.shard_weights()])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))  # bitwise, run to run
    for a, b in zip(runs[0], runs[1]):  # other tiles: same values up to the summation order
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_dense_gradients_and_bf16_output_match_the_torch_path(deterministic):
    lookup = SmallTableLookup(full_shards(TABLES, CPU), OPTIMIZERS["sgd"], CPU, seed=3, kernel=TRITON)
    gen = torch.Generator().manual_seed(9)
    idx, off, psw, _, up = random_step(TABLES, 6, gen)
    grad_out = torch.cat(list(up.values()), dim=1)
    weights = [p.detach() for p in lookup.weights]
    grads = {}
    for impl in ("triton", "torch"):
        g = [torch.zeros_like(w) for w in weights]
        touched = [torch.zeros(w.shape[0], dtype=torch.int8) for w in weights]
        dense_gradients(lookup.layout, g, grad_out, idx, off, psw, deterministic, impl, touched=touched)
        grads[impl] = (g, touched)
        out = pool(lookup.layout, weights, idx, off, psw, torch.bfloat16, impl)
        assert out.dtype == torch.bfloat16
        grads[impl + "_out"] = out
    for a, b in zip(grads["triton"][0], grads["torch"][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert a.abs().sum() > 0
    for a, b in zip(grads["triton"][1], grads["torch"][1]):
        assert torch.equal(a, b) and a.sum() > 0
    torch.testing.assert_close(grads["triton_out"].float(), grads["torch_out"].float(), atol=1e-2, rtol=1e-2)


def test_output_dtype_option():
    opts = LookupOptions(output_dtype="bf16")
    lookup = SmallTableLookup(full_shards(TABLES, CPU), OPTIMIZERS["sgd"], CPU, seed=3, options=opts, kernel=TRITON)
    idx, off, psw, _, _ = random_step(TABLES, 3, torch.Generator().manual_seed(1))
    assert lookup(idx, off, psw).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seed,n_keys,widths,n_blocks", [(0, 6, (4, 8, 3), 3), (1, 20, (16,), 3), (2, 8, (32, 16, 4), 3), (3, 14, (8,), 10)]
)
def test_triton_regroup(dtype, seed, n_keys, widths, n_blocks):
    # 10 blocks: more tensors than kernel arguments, their addresses go in a table copied to the device
    from embshard.kernels.regroup import KernelRegroup

    keys, dims, groups = random_regroup_case(seed, n_keys, widths, n_blocks)
    gen = torch.Generator().manual_seed(seed)
    B = 5
    blocks = [torch.randn(B, sum(d), generator=gen).to(dtype).requires_grad_(True) for d in dims]
    if seed == 2:  # a block that is a view at an odd element offset: no vector hint (the kernel must see it)
        wide = torch.randn(B, sum(dims[0]) + 1, generator=gen).to(dtype)
        blocks[0] = wide[:, 1:].detach().requires_grad_(True)
    out = KernelRegroup(keys, dims, groups, impl="triton", block_b=4, block_w_bytes=256)(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    for n in groups:
        assert torch.equal(out[n], want[n]), n
    upstream = {n: torch.randn(want[n].shape, generator=gen).to(dtype) for n in groups}
    sum((out[n].float() * upstream[n].float()).sum() for n in groups).backward()
    # fp32: exact. bf16: the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest, exact there,
    # tests/kernels/test_kernels_regroup.py), so a summed duplicate may be one bf16 step off.
    tol = 0 if dtype is torch.float32 else 2**-7
    for b, e in zip(blocks, regroup_grad_reference(upstream, keys, dims, groups, B, dtype)):
        torch.testing.assert_close(b.grad.float(), e.float(), rtol=tol, atol=0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_data_parallel_lookup_on_the_kernels(deterministic):
    from embshard.kernels.data_parallel import KernelDataParallelLookup

    cfg = OPTIMIZERS["adam"]
    tables = sorted(TABLES, key=lambda t: t.embedding_dim)
    kernel = SmallTableOptions(impl="triton", deterministic=deterministic, tiles=Tiles(sorted_block_n=4))
    make = lambda: KernelDataParallelLookup(full_shards(tables, CPU), cfg, CPU, None, seed=7, kernel=kernel)
    lookup, ref, outs = train_against_reference(make, tables, cfg, CPU, steps=2, B=4)
    check_against_reference(lookup, ref, outs, cfg, tables, with_state=False)


def test_triton_regroup_with_an_empty_block():
    # a scheme with no shard on this rank sends a [B, 0] block: it must not cost the vector path or break anything
    from embshard.kernels.regroup import KernelRegroup

    keys, dims = [["a", "b"], [], ["c"]], [[4, 8], [], [4]]
    groups = {"g": ["c", "a"], "h": ["b", "a"]}
    blocks = [torch.randn(3, 12, requires_grad=True), torch.randn(3, 0, requires_grad=True)]
    blocks.append(torch.randn(3, 4, requires_grad=True))
    out = KernelRegroup(keys, dims, groups, impl="triton")(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    assert all(torch.equal(out[n], want[n]) for n in groups)
    sum(o.sum() for o in out.values()).backward()
    assert blocks[1].grad.shape == (3, 0) and torch.equal(blocks[0].grad[:, :4], torch.full((3, 4), 2.0))
