"""fused_cross_entropy against torch.nn.functional.cross_entropy in float64 on fresh random inputs: the Triton
kernels (under Triton's interpreter on a CPU-only machine, compiled on CUDA) and the torch path, fp32 and bf16,
ignore_index and label smoothing, every reduction, with and without the in-place backward; the row passes the
sharded softmax uses; the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embshard.kernels import LaunchConfig, fused_cross_entropy, logsumexp_rows, softmax_grad_

# Without CUDA the Triton kernels run under the interpreter: tests/suite_plugin.py sets TRITON_INTERPRET=1 for the session.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}
SMALL = LaunchConfig(block=16, num_warps=1)  # several loop iterations per row even for narrow rows


def inputs(seed: int, N: int, C: int, dtype: torch.dtype, ignore_index: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, C, generator=gen) * 3).to(dtype)
    t = torch.randint(0, C, (N,), generator=gen)
    t[1] = ignore_index  # an ignored row
    t[N - 1] = C - 1  # the last column
    up = torch.randn(N, generator=gen, dtype=torch.float64)
    return x, t, up


def check(impl, dtype, smoothing, reduction, inplace, ignore_index=-100, N=6, C=37, launch=None, seed=0):
    x0, t, up = inputs(seed, N, C, dtype, ignore_index)
    xr = x0.double().clone().requires_grad_(True)  # a copy: for float64 .double() is x0 itself
    want = F.cross_entropy(xr, t, ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    up = up if reduction == "none" else up[0]
    (want * up).sum().backward()
    x = x0.detach().clone().to(DEVICE).requires_grad_(True)
    logits = x * 1  # not a leaf: the in-place gradient is written into this buffer
    got = fused_cross_entropy(
        logits,
        t.to(DEVICE),
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
        inplace_backward=inplace,
        impl=impl,
        launch=launch,
    )
    assert got.dtype == dtype and got.shape == want.shape
    (got * up.to(DEVICE, got.dtype)).sum().backward()
    tol = TOL[dtype]
    what = f"{impl} {dtype} smoothing={smoothing} {reduction} inplace={inplace}"
    scale = max(1.0, float(want.detach().abs().max()))
    torch.testing.assert_close(
        got.double().cpu(), want.detach(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    if inplace:
        assert x.grad.data_ptr() != x.data_ptr()  # the leaf's own values were not touched


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_torch(impl, dtype, smoothing):
    for i, (reduction, inplace) in enumerate((("mean", True), ("sum", False), ("none", True))):
        check(impl, dtype, smoothing, reduction, inplace, launch=SMALL if impl == "triton" else None, seed=i)
    check(impl, dtype, smoothing, "mean", True, ignore_index=3, seed=5)  # an ignore_index that is a class id
    check(impl, dtype, smoothing, "mean", False, N=4, C=300, seed=6)  # default launch: one wide block


def test_float64_on_the_torch_path_and_non_contiguous_logits():
    check("torch", torch.float64, 0.2, "mean", False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 6, generator=gen).double().requires_grad_(True)
    t = torch.randint(0, 11, (6,), generator=gen)
    want = F.cross_entropy(x.t(), t)
    got = fused_cross_entropy(x.t(), t, impl="torch", inplace_backward=True)
    torch.testing.assert_close(got, want)
    (g_want,) = torch.autograd.grad(want, x)
    (g_got,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in Triton's interpreter, on -inf lanes
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_every_row_ignored_gives_nan_and_zero_gradient_as_torch(impl):
    x = torch.randn(3, 5, device=DEVICE, requires_grad=True)
    loss = fused_cross_entropy(x * 1, torch.full((3,), -100, device=DEVICE), impl=impl, launch=SMALL)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in Triton's interpreter, on -inf lanes
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_row_passes_of_the_sharded_softmax(impl):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=gen)
    x[2, :5] = float("-inf")  # masked entries (accidental hits)
    x[4] = float("-inf")  # a row with nothing in it
    lse = logsumexp_rows(x.to(DEVICE), impl=impl, launch=SMALL).cpu()
    torch.testing.assert_close(lse, torch.logsumexp(x, 1))
    g = torch.rand(6, generator=gen)
    g[4] = 0.0
    y = x.to(DEVICE).clone()
    assert softmax_grad_(y, lse.to(DEVICE), g.to(DEVICE), impl=impl, launch=SMALL) is y
    want = torch.softmax(x, 1) * g[:, None]
    want[4] = float("nan")  # exp(-inf - -inf): the caller never uses such a row (its g is 0 and its loss inf)
    torch.testing.assert_close(y.cpu()[[0, 1, 2, 3, 5]], want[[0, 1, 2, 3, 5]])


def test_in_place_gradient_reuses_the_buffer_and_guards_saved_logits():
    x = torch.randn(4, 7, device=DEVICE, requires_grad=True)
    t = torch.tensor([0, 6, 2, 2], device=DEVICE)
    logits = x * 2
    loss = fused_cross_entropy(logits, t, inplace_backward=True)
    (g,) = torch.autograd.grad(loss, logits)
    assert g.data_ptr() == logits.data_ptr()  # no [N, C] buffer beyond the logits
    y = x.exp()  # exp saves its output for its backward: the in-place gradient must not pass silently
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fused_cross_entropy(y, t, inplace_backward=True).backward()


def test_errors_name_the_rule():
    x = torch.randn(3, 5, device=DEVICE)
    if DEVICE == "cpu":
        with pytest.raises(IndexError, match="target 5 is out of bounds for 5 classes"):
            fused_cross_entropy(x, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="reduction='avg' is invalid"):
        fused_cross_entropy(x, torch.tensor([0, 1, 1], device=DEVICE), reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing=1.5 is invalid"):
        fused_cross_entropy(x, torch.tensor([0, 1, 1], device=DEVICE), label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"logits must be \[N, C\]"):
        fused_cross_entropy(x[0], torch.tensor([0], device=DEVICE))
