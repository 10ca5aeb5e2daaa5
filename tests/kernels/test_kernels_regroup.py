"""KernelRegroup against a plain torch.cat reference and FBGEMM's permute_multi_embedding (the parent Regroup), on
the test device (CPU: the torch path and FBGEMM; EMBSHARD_TEST_DEVICE=cuda: the Triton kernel too), forward and
backward, fp32 and bf16, keys repeated within and across groups, unused keys with exactly-zero gradients. The
Triton kernel on the CPU (interpreter) is tests/kernels/test_kernels_interpret.py."""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind
from kernel_cases import random_regroup_case, regroup_grad_reference, regroup_reference

from embshard.collection.regroup import Regroup
from embshard.collection.regroup_kernel import KernelRegroup

DEVICE = torch.device(device_kind())
pytestmark = pytest.mark.usefixtures("torch_kernels_on_cpu")  # CPU: the torch path, as CPU training runs
IMPLS = ["auto", "torch", "fbgemm"] + (["triton"] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed,n_keys,widths", [(0, 6, (4, 8, 3)), (1, 40, (16,)), (2, 12, (128, 16, 4))])
def test_matches_cat_forward_and_backward(impl, dtype, seed, n_keys, widths):
    keys, dims, groups = random_regroup_case(seed, n_keys, widths)
    gen = torch.Generator().manual_seed(seed)
    B = 9
    blocks = [torch.randn(B, sum(d), generator=gen).to(dtype).to(DEVICE).requires_grad_(True) for d in dims]
    rg = KernelRegroup(keys, dims, groups, impl=impl)
    out = rg(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    assert list(out) == list(groups)
    for n in groups:
        assert out[n].dtype == dtype and torch.equal(out[n], want[n]), n
    upstream = {n: torch.randn(want[n].shape, generator=gen).to(dtype).to(DEVICE) for n in groups}
    sum((out[n].float() * upstream[n].float()).sum() for n in groups).backward()
    expect = regroup_grad_reference(upstream, keys, dims, groups, B, dtype)
    kernel = impl == "triton" or impl == "auto" and DEVICE.type == "cuda"
    # The kernel sums a column's uses in fp32 in group order and rounds once: exactly the reference. torch and
    # FBGEMM add duplicates in their own order (bf16: rounding after each add).
    tol = 0 if kernel else 1e-6 if dtype is torch.float32 else 2e-2
    for i, (b, e) in enumerate(zip(blocks, expect)):
        torch.testing.assert_close(b.grad.cpu().float(), e.float(), rtol=tol, atol=tol, msg=f"block {i}")
    used = {k for g in groups.values() for k in g}
    for b, k_list, d_list in zip(blocks, keys, dims):
        pos = 0
        for k, d in zip(k_list, d_list):
            if k not in used:
                assert torch.equal(b.grad[:, pos : pos + d], torch.zeros_like(b.grad[:, pos : pos + d])), k
            pos += d


def test_same_as_permute_multi_embedding_and_errors():
    keys, dims, groups = random_regroup_case(3, 20, (16, 8))
    blocks = [torch.randn(5, sum(d), device=DEVICE) for d in dims]
    mine = KernelRegroup(keys, dims, groups)(blocks)
    theirs = Regroup(keys, dims, groups)(blocks)
    for n in groups:
        assert torch.equal(mine[n], theirs[n])
    with pytest.raises(ValueError, match="impl='cuda' is unknown"):
        KernelRegroup(keys, dims, groups, impl="cuda")
    with pytest.raises(ValueError, match="2 blocks given, 3 expected"):
        KernelRegroup(keys, dims, groups)(blocks[:2])
    with pytest.raises(ValueError, match=r"'g'.*unknown features \['nope'\]"):
        KernelRegroup(keys, dims, {"g": ["nope"]})


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "fbgemm"])
def test_empty_block(impl):
    # a scheme with no shard on this rank contributes a [B, 0] block
    keys, dims = [["a", "b"], [], ["c"]], [[4, 8], [], [4]]
    groups = {"g": ["c", "a"], "h": ["b", "a"]}
    blocks = [torch.randn(3, w, device=DEVICE, requires_grad=True) for w in (12, 0, 4)]
    out = KernelRegroup(keys, dims, groups, impl=impl)(blocks)
    want = regroup_reference([b.detach() for b in blocks], keys, dims, groups)
    assert all(torch.equal(out[n], want[n]) for n in groups)
    sum(o.sum() for o in out.values()).backward()
    assert blocks[1].grad.shape == (3, 0)
    assert torch.equal(blocks[0].grad[:, :4].cpu(), torch.full((3, 4), 2.0))
    assert torch.equal(blocks[2].grad.cpu(), torch.ones(3, 4))
