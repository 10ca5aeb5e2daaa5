"""Fused softmax cross-entropy: `fused_cross_entropy(logits [N, C], target [N])`, torch's semantics, logits read
once forward and read and written once backward, never a probability tensor.

Data flow:
  forward   logits [N, C] --(one pass per row: online logsumexp, x[target], and sum(x) with label smoothing)-->
            lse [N] fp32, loss [N] fp32 --reduction--> loss (the logits' dtype, as torch)
  backward  logits [N, C], lse [N], upstream gradient --(one pass per row)--> grad [N, C], written into a new
            buffer or, with `inplace_backward=True`, into the logits' own buffer
Saved between them: the logits (a reference, not a copy), lse and n_valid: O(N) extra memory. With
`inplace_backward=True` the whole forward + backward needs O(N) memory beyond the logits themselves.

Semantics are torch.nn.functional.cross_entropy's for class-index targets without class weights:
  loss_i = (1 - eps) (lse_i - x_i,t_i) + eps / C * sum_j (lse_i - x_i,j);  0 and not counted if t_i == ignore_index
  mean: sum / (number of rows not ignored) (nan if every row is ignored, as torch); sum; none: [N]
  grad_i,j = g_i (softmax_i,j - eps / C - (1 - eps) [j == t_i]); 0 for ignored rows
Targets outside [0, C) other than ignore_index are an error (a device-side assert on CUDA, as torch).

Two implementations of the same math (`impl`): Triton kernels (embshard/kernels/_cross_entropy_triton.py; CUDA
tensors, or CPU tensors when TRITON_INTERPRET=1 was set before the first use) and a torch path (rows in chunks,
any device, also float64). `impl="auto"` takes Triton on CUDA and torch elsewhere. Both compute in fp32 (float64
for float64 logits on the torch path) and store the gradient in the logits' dtype.

`logsumexp_rows(x)` and `softmax_grad_(x, lse, g)` expose the two passes without targets: the sharded full softmax
(embshard/retrieval/softmax.py) runs them on its chunks of logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]
TORCH_CHUNK_ELEMENTS = 1 << 24  # torch path: rows per chunk such that a chunk holds at most this many elements


@dataclass(frozen=True)
class LaunchConfig:
    """Triton launch parameters: columns per loop iteration (a power of two) and warps per row program."""

    block: int
    """Columns of one row read per loop iteration (power of two)."""
    num_warps: int
    """Warps per program (one program per row)."""


def default_launch(C: int, dtype: torch.dtype) -> LaunchConfig:
    """16 KiB of a row per iteration (4096 fp32 or 8192 bf16/fp16 columns), 8 warps; narrower rows one block."""
    per_iteration = 4096 if dtype == torch.float32 else 8192
    block = min(per_iteration, max(16, 1 << (max(C, 1) - 1).bit_length()))
    return LaunchConfig(block, 8 if block >= 2048 else 4)


def _use_triton(x: torch.Tensor, impl: Impl) -> bool:
    if impl == "torch" or (impl == "auto" and x.device.type != "cuda"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton cross-entropy takes fp32, bf16 or fp16 logits, not {x.dtype}: use impl='torch'")
    if x.device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"impl='triton' on a {x.device.type} tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before embshard.kernels is first used, or use impl='torch'"
            )
    return True


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"logits must be [N, C], got shape {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


# ---- the two passes, Triton or torch ------------------------------------------------------------------------


def _row_options(x: torch.Tensor, target, smoothing: float, launch: LaunchConfig | None) -> dict:
    """The compile-time options and launch width both kernels take for logits `x`: with targets or not, with label
    smoothing (only with targets), the block of columns and the warps (`launch`, else `default_launch`)."""
    cfg = launch or default_launch(x.shape[1], x.dtype)
    return {
        "HAS_TARGET": target is not None,
        "SMOOTH": smoothing > 0 and target is not None,
        "BLOCK": cfg.block,
        "num_warps": cfg.num_warps,
    }


def _forward_pass(x, target, ignore_index: int, smoothing: float, impl: Impl, launch: LaunchConfig | None):
    """(lse [N] fp32, loss [N] fp32 or None). `target` None: logsumexp only."""
    N, C = x.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lse = torch.empty(N, dtype=acc, device=x.device)
    loss = torch.empty(N, dtype=acc, device=x.device) if target is not None else None
    if N == 0:
        return lse, loss
    if _use_triton(x, impl):
        from embshard.kernels._cross_entropy_triton import _forward_kernel

        _forward_kernel[(N,)](
            x,
            x.stride(0),
            target if target is not None else lse,
            lse,
            loss if loss is not None else lse,
            C,
            ignore_index,
            float(smoothing),
            **_row_options(x, target, smoothing, launch),
        )
        return lse, loss
    step = max(1, TORCH_CHUNK_ELEMENTS // max(C, 1))
    for r0 in range(0, N, step):
        xf = x[r0 : r0 + step].to(acc)
        lse[r0 : r0 + step] = torch.logsumexp(xf, dim=1)
        if target is None:
            continue
        t = target[r0 : r0 + step]
        valid = t != ignore_index
        x_t = xf.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        rows = lse[r0 : r0 + step] - (1.0 - smoothing) * x_t
        if smoothing > 0:
            rows = rows - smoothing / C * xf.sum(dim=1)
        loss[r0 : r0 + step] = torch.where(valid, rows, 0.0)
    return lse, loss


def _backward_pass(x, out, target, lse, grad, scale, ignore_index: int, smoothing: float, impl, launch) -> None:
    """out[i, j] = g_i (exp(x_ij - lse_i) - eps / C - (1 - eps) [j == t_i]), g_i = grad_i * scale (0 if ignored).
    `grad`: [N] or a 0-d tensor (broadcast); `scale`: 0-d tensor; `out` may be `x`."""
    N, C = x.shape
    if N == 0:
        return
    if _use_triton(x, impl):
        from embshard.kernels._cross_entropy_triton import _backward_kernel

        _backward_kernel[(N,)](
            x,
            x.stride(0),
            out,
            out.stride(0),
            target if target is not None else lse,
            lse,
            grad,
            grad.stride(0) if grad.dim() else 0,
            scale,
            C,
            ignore_index,
            float(smoothing),
            **_row_options(x, target, smoothing, launch),
        )
        return
    acc = lse.dtype
    step = max(1, TORCH_CHUNK_ELEMENTS // max(C, 1))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        g = (grad[r0:r1] if grad.dim() else grad.expand(r1 - r0)).to(acc) * scale.to(acc)
        d = torch.exp(x[r0:r1].to(acc) - lse[r0:r1].unsqueeze(1))
        if target is not None:
            t = target[r0:r1]
            valid = t != ignore_index
            if smoothing > 0:
                d -= smoothing / C
            hit = torch.full((r1 - r0, 1), -(1.0 - smoothing), dtype=acc, device=x.device)
            d.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), hit)
            d = torch.where(valid.unsqueeze(1), d * g.unsqueeze(1), 0.0)
        else:
            d *= g.unsqueeze(1)
        out[r0:r1] = d.to(out.dtype)


# ---- public API ---------------------------------------------------------------------------------------------


def logsumexp_rows(x: torch.Tensor, impl: Impl = "auto", launch: LaunchConfig | None = None) -> torch.Tensor:
    """Row-wise logsumexp of `x [N, C]` in one pass (fp32; float64 for float64 input on the torch path); no
    autograd."""
    x = _rows_2d(x)
    return _forward_pass(x, None, -100, 0.0, impl, launch)[0]


def softmax_grad_(
    x: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, impl: Impl = "auto", launch: LaunchConfig | None = None
) -> torch.Tensor:
    """In place: `x[i, j] <- g[i] * exp(x[i, j] - lse[i])` (the softmax's share of the cross-entropy gradient), one
    pass; returns `x` (which must have unit column stride). No autograd."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"softmax_grad_ writes in place: x must be [N, C] with unit column stride, got {x.stride()}")
    one = torch.ones((), dtype=torch.float32, device=x.device)
    _backward_pass(x, x, None, lse, g, one, -100, 0.0, impl, launch)
    return x


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, reduction, inplace, impl, launch):  # type: ignore[override]
        x = _rows_2d(logits)
        N, C = x.shape
        if target.shape != (N,):
            raise ValueError(f"target must be [N] = [{N}] class indices, got shape {tuple(target.shape)}")
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"target must hold class indices (int64 or int32), not {target.dtype}")
        target = target.to(torch.int64).contiguous()
        ok = ((target >= 0) & (target < C)) | (target == ignore_index)
        if target.device.type == "cuda":
            torch._assert_async(ok.all(), "fused_cross_entropy: a target is outside [0, C) and not ignore_index")
        elif not bool(ok.all()):
            bad = target[~ok][0].item()
            raise IndexError(
                f"fused_cross_entropy: target {bad} is out of bounds for {C} classes (ignore_index={ignore_index})"
            )
        lse, loss_rows = _forward_pass(x, target, ignore_index, smoothing, impl, launch)
        n_valid = (target != ignore_index).sum().to(lse.dtype)
        if reduction == "mean":
            loss = loss_rows.sum() / n_valid
            scale = 1.0 / n_valid
        elif reduction == "sum":
            loss, scale = loss_rows.sum(), torch.ones((), dtype=lse.dtype, device=x.device)
        else:
            loss, scale = loss_rows, torch.ones((), dtype=lse.dtype, device=x.device)
        ctx.save_for_backward(x, target, lse, scale)
        ctx.args = (ignore_index, smoothing, inplace, impl, launch, x is logits)
        return loss.to(logits.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # type: ignore[override]
        x, target, lse, scale = ctx.saved_tensors
        ignore_index, smoothing, inplace, impl, launch, same_buffer = ctx.args
        out = x.detach() if inplace else torch.empty_like(x)  # detach: the same buffer, not the saved variable
        grad = grad_loss.contiguous()
        _backward_pass(x, out, target, lse, grad, scale, ignore_index, smoothing, impl, launch)
        if inplace and same_buffer:
            torch.autograd.graph.increment_version(x)  # whoever saved the logits now sees them modified
        return out, None, None, None, None, None, None, None


def fused_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
    *,
    inplace_backward: bool = False,
    impl: Impl = "auto",
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """torch.nn.functional.cross_entropy(logits, target, ignore_index=..., label_smoothing=..., reduction=...) for
    `logits [N, C]` and class indices `target [N]`, without materialising probabilities (see the module docstring).

    inplace_backward: the backward writes the gradient into the logits' own buffer and returns it (O(N) extra
        memory in all). Contract: nothing may read `logits` after the backward (it then holds the gradient). Autograd
        enforces part of it: the logits' version counter is bumped, so an op that saved them for its own backward
        fails loudly instead of using wrong values; a plain read after backward (e.g. an accuracy) is not caught.
        Off by default: the gradient then goes to a new [N, C] buffer, as with torch.
    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch", or "auto" (Triton on CUDA, else torch).
    launch: Triton block size and warps (default: default_launch(C, dtype)); for tuning (bench/cross_entropy.py).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is invalid: use 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} is invalid: it must be in [0, 1] (as torch)")
    return _FusedCrossEntropy.apply(
        logits, target, int(ignore_index), float(label_smoothing), reduction, inplace_backward, impl, launch
    )
