"""Triton kernels behind embshard.kernels.cross_entropy: one program per row of the logits `[N, C]`.

- `_forward_kernel`: reads a row once, block by block, keeping the running max `m` and the running sum of
  `exp(x - m)` (online logsumexp), and, with label smoothing, the row's sum; writes the row's logsumexp and, with
  targets, its loss `lse - (1 - eps) x[t] - eps / C sum(x)` (0 for `ignore_index`). Without targets it is the
  row-wise logsumexp that the sharded full softmax runs on its chunks of logits.
- `_backward_kernel`: reads the row again, block by block, and writes `g * (exp(x - lse) - eps / C)` minus
  `g (1 - eps)` at the target, where `g` is the row's upstream gradient times `scale` (0 for ignored rows), into
  `out`, which may be the logits' own buffer (in place).
Everything is computed in fp32 whatever the storage type (fp32, bf16, fp16). Row offsets are 64-bit (N x C may
exceed 2^31 elements). Only APIs present in Triton 3.6 and 3.9 are used; with TRITON_INTERPRET=1 (set before this
module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _forward_kernel(
    x_ptr,
    stride_x,
    target_ptr,
    lse_ptr,
    loss_ptr,
    C,
    ignore_index,
    smoothing,
    HAS_TARGET: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    m = float("-inf")
    s = 0.0
    total = 0.0
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf so far: keep exp finite
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
        if SMOOTH:
            total += tl.sum(tl.where(mask, x, 0.0), 0)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    if HAS_TARGET:
        t = tl.load(target_ptr + row)
        valid = t != ignore_index
        x_t = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
        loss = lse - (1.0 - smoothing) * x_t
        if SMOOTH:
            loss -= smoothing / C * total
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))


@triton.jit
def _backward_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    target_ptr,
    lse_ptr,
    grad_ptr,
    stride_grad,
    scale_ptr,
    C,
    ignore_index,
    smoothing,
    HAS_TARGET: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_base = x_ptr + row * stride_x
    out_base = out_ptr + row * stride_out
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_ptr + row * stride_grad).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
    valid = True
    t = -1
    if HAS_TARGET:
        t = tl.load(target_ptr + row)
        valid = t != ignore_index
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(x_base + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.exp(x - lse) * g
        if SMOOTH:
            d -= g * (smoothing / C)
        if HAS_TARGET:
            d = tl.where(cols == t, d - g * (1.0 - smoothing), d)
            d = tl.where(valid, d, 0.0)
        tl.store(out_base + cols, d.to(out_ptr.dtype.element_ty), mask=mask)
