"""Regroup (permute_multi_embedding) against a plain torch.cat / indexing reference, forward and backward, with
features repeated across groups and features used by no group (whose gradient must be exactly zero)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import regroup_reference

from embshard.collection.regroup import Regroup

KEYS = [["f1", "f2", "f3"], ["f4", "f5"], ["f6"]]
DIMS = [[4, 8, 3], [5, 2], [7]]
GROUPS = {"user": ["f1", "f3"], "cross": ["f1", "f5", "f3"], "item": ["f4"]}  # f2 and f6 unused, f1/f3 repeated


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_regroup_matches_cat_forward_and_backward(batch, device):
    gen = torch.Generator().manual_seed(batch)
    blocks = [torch.randn(batch, sum(d), generator=gen).to(device).requires_grad_(True) for d in DIMS]
    ref_blocks = [b.detach().clone().requires_grad_(True) for b in blocks]
    regroup = Regroup(KEYS, DIMS, GROUPS)
    for _ in range(2):  # the cached permute metadata is reused on the second call
        out = regroup(blocks)
        want = regroup_reference(ref_blocks, KEYS, DIMS, GROUPS)
        assert list(out) == list(GROUPS)
        upstream = {n: torch.randn(want[n].shape, generator=gen).to(device) for n in GROUPS}
        for n in GROUPS:
            torch.testing.assert_close(out[n], want[n], rtol=0, atol=0)
        sum((out[n] * upstream[n]).sum() for n in GROUPS).backward()
        sum((want[n] * upstream[n]).sum() for n in GROUPS).backward()
        for b, rb in zip(blocks, ref_blocks):
            want_grad = rb.grad if rb.grad is not None else torch.zeros_like(rb)  # block used by no group
            torch.testing.assert_close(b.grad, want_grad, rtol=1e-6, atol=1e-6)
            b.grad = rb.grad = None


@pytest.mark.parametrize("device", DEVICES)
def test_unused_feature_gradient_is_exactly_zero(device):
    # FBGEMM leaves unused columns' gradient unwritten (garbage seen on CPU); Regroup must zero them.
    blocks = [torch.randn(16, sum(d), device=device, requires_grad=True) for d in DIMS]
    out = Regroup(KEYS, DIMS, GROUPS)(blocks)
    sum(o.sum() for o in out.values()).backward()
    assert torch.equal(blocks[0].grad[:, 4:12], torch.zeros(16, 8, device=device))  # f2
    assert torch.equal(blocks[2].grad, torch.zeros(16, 7, device=device))  # f6
    assert (blocks[0].grad[:, :4] == 2).all()  # f1 used twice: gradient 1 + 1


def test_regroup_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"'cross'.*unknown features \['nope'\]"):
        Regroup(KEYS, DIMS, {"cross": ["f1", "nope"]})
    with pytest.raises(ValueError, match="'empty' is empty"):
        Regroup(KEYS, DIMS, {"empty": []})
    with pytest.raises(ValueError, match="'f1' appears in two input blocks"):
        Regroup([["f1"], ["f1"]], [[4], [4]], {"g": ["f1"]})


@pytest.mark.parametrize("seed", range(6))
def test_coalesced_runs_give_the_same_groups(seed):
    # Random blocks and groups (runs kept whole, runs broken, duplicates, unused keys): merging runs must not change
    # any output or gradient, and a group that takes a whole block in order makes it one key.
    from embshard.collection.regroup import coalesce

    gen = torch.Generator().manual_seed(seed)
    names = [f"k{i}" for i in range(12)]
    cuts = sorted(torch.randperm(11, generator=gen)[:2].add(1).tolist())
    keys = [names[: cuts[0]], names[cuts[0] : cuts[1]], names[cuts[1] :]]
    dims = [[int(torch.randint(1, 5, (1,), generator=gen)) for _ in k] for k in keys]
    groups = {
        "whole": list(keys[1]),
        "mixed": [names[i] for i in torch.randint(0, 12, (7,), generator=gen).tolist()],
        "run": names[2:9] if seed % 2 else names[:2],
    }
    merged_keys, merged_dims, merged_groups = coalesce(keys, dims, list(groups.values()))
    others_use_block1 = any(k in groups["mixed"] or k in groups["run"] for k in keys[1])
    if not others_use_block1:
        assert merged_keys[1] == ["+".join(keys[1])]
    assert [sum(d) for d in merged_dims] == [sum(d) for d in dims]
    assert [k for g in merged_groups for m in g for k in m.split("+")] == [k for g in groups.values() for k in g]
    blocks = [torch.randn(5, sum(d), generator=gen).requires_grad_(True) for d in dims]
    ref_blocks = [b.detach().clone().requires_grad_(True) for b in blocks]
    out = Regroup(keys, dims, groups)(blocks)
    want = regroup_reference(ref_blocks, keys, dims, groups)
    upstream = {n: torch.randn(want[n].shape, generator=gen) for n in groups}
    for n in groups:
        torch.testing.assert_close(out[n], want[n], rtol=0, atol=0)
    sum((out[n] * upstream[n]).sum() for n in groups).backward()
    sum((want[n] * upstream[n]).sum() for n in groups).backward()
    for b, rb in zip(blocks, ref_blocks):
        torch.testing.assert_close(b.grad, rb.grad if rb.grad is not None else torch.zeros_like(rb))
