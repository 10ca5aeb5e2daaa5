"""One cross layer's running sum in one pass (DLRM-DCNv2's cross network, embshard/models/dcn.py).

A low-rank cross layer is x_{l+1} = x_0 * y + x_l with y = W (V x_l) + b. Under bf16 autocast the products are
bf16 and the running sum x_l is kept in fp32 (as torchrec's LowRankCrossNet has it, through its fp32 bias). In
torch that is an fp32 addcmul with bf16 factors, a cast of the sum to bf16 for the next product, and in the
backward two mixed-dtype products, two casts and an add: about eight passes over `[B, width]` per layer, several
of them in kernels that cannot vectorise mixed dtypes. `cross_sum(x, x0, y)` does the forward in one pass, writing
the fp32 sum and its copy in x0's dtype (the next product's input), and the backward in one pass
(_cross_triton.py). Same arithmetic as the torch ops, in fp32.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cross_sum", "fused_available"]

BLOCK = 1024  # elements per program


def fused_available(x: torch.Tensor | None, x0: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether `cross_sum` takes these tensors: an fp32 running sum (or None: the first layer's, x0 itself), x0 in a
    16-bit dtype (autocast), same shapes, on a CUDA GPU (or any device under Triton's interpreter)."""
    if not (x0.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if x is not None and (x.dtype != torch.float32 or x.shape != x0.shape or x.device != x0.device):
        return False
    return x0.dtype in (torch.bfloat16, torch.float16) and x0.shape == y.shape and x0.device == y.device


def cross_sum(
    x: torch.Tensor | None, x0: torch.Tensor, y: torch.Tensor, keep_sum: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x + x0 * y in fp32, the same in x0's dtype), differentiable in x, x0 and y (`fused_available` first).
    `x` None: the first layer, whose running sum is x0 itself (no fp32 copy of it is made, and its gradient comes
    out as one tensor). `keep_sum` False (the last layer, whose fp32 sum nothing reads): (None, the sum in x0's
    dtype), the fp32 sum not written."""
    out = _CrossSum.apply(x, x0, y, keep_sum)
    return out if keep_sum else (None, out)


class _CrossSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x0, y, keep_sum):  # type: ignore[override]
        from embshard.kernels._cross_triton import _cross_forward

        first = x is None
        x0, y = x0.contiguous(), y.contiguous()
        x = x0 if first else x.contiguous()  # first: a pointer the kernel does not read
        out_lo = torch.empty_like(x0)
        out = torch.empty(x0.shape if keep_sum else (1,), dtype=torch.float32, device=x0.device)  # (1,): not written
        n = x0.numel()
        if n:
            grid = (-(-n // BLOCK),)
            _cross_forward[grid](x, x0, y, out, out_lo, n, BLOCK=BLOCK, FIRST=first, HI=keep_sum, LO=True)
        ctx.first, ctx.keep_sum = first, keep_sum
        ctx.save_for_backward(x0, y)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        return (out, out_lo) if keep_sum else out_lo

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        from embshard.kernels._cross_triton import _cross_backward

        g_out, g_lo = grads if ctx.keep_sum else (None, grads[0])
        x0, y = ctx.saved_tensors
        if g_out is None and g_lo is None:
            return None, None, None, None
        gx0, gy = torch.empty_like(x0), torch.empty_like(y)
        gx = None if ctx.first else torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
        n = x0.numel()
        if n:
            unread = torch.empty(1, dtype=torch.float32, device=x0.device)  # a pointer the kernel does not touch
            g = g_out.contiguous() if g_out is not None else unread
            g_lo_ = g_lo.contiguous() if g_lo is not None else unread
            _cross_backward[(-(-n // BLOCK),)](
                g,
                g_lo_,
                x0,
                y,
                gx if gx is not None else unread,
                gx0,
                gy,
                n,
                BLOCK=BLOCK,
                HAS_G=g_out is not None,
                HAS_LO=g_lo is not None,
                FIRST=ctx.first,
            )
        return gx, gx0, gy, None
