"""The Triton kernel of the regroup (embshard.kernels.regroup): a column gather between lists of `[B, width]`
tensors, used forward (input blocks -> output groups) and backward (output gradients -> input gradients).

One launch moves every column. The grid tiles the destination columns (all destination tensors side by side) and
the batch: a program copies a `[BLOCK_B, BLOCK_W]` tile. Per destination column, `DST_REF`/`DST_COL` say which
destination tensor and column it is, and `SRC_REF[k]`/`SRC_COL[k]` its k-th source (K sources: a backward column
sums the gradients of every group that used it; an unused one has only the zero source). Tensor addresses and row
strides come in a small per-call table `TAB` (int64: source addresses, source strides, destination addresses,
destination strides); the zero source is a 16-byte zero buffer with stride 0.

Vector loads: Triton cannot see that gathered addresses are contiguous, so when every key width, row stride and
address is a multiple of V elements (16 bytes: V = 4 fp32, 8 bf16) the pointers carry the hints "contiguous in
runs of V, first of each run 16-byte aligned", which holds because a run of V columns never crosses a key. The
caller computes V per call from the actual tensors (V = 1: no hint).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ptrs(TAB, ref, col, row, addr0, stride0, ELEM, V: tl.constexpr, VB: tl.constexpr):
    addr = tl.load(TAB + addr0 + ref)
    stride = tl.load(TAB + stride0 + ref)
    base = addr.to(tl.pointer_type(ELEM.dtype.element_ty))
    ptr = base[None, :] + (row[:, None] * stride[None, :] + col[None, :])
    if V > 1:
        ptr = tl.max_contiguous(tl.multiple_of(ptr, [1, VB]), [1, V])
    return ptr


@triton.jit
def _gather_cols(
    TAB,
    SRC_REF,
    SRC_COL,
    DST_REF,
    DST_COL,
    ELEM,
    B,
    ncols_v,
    n_src,
    n_dst,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    V: tl.constexpr,
    VB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c_ok = (c // V) < ncols_v
    mask = (row < B)[:, None] & c_ok[None, :]
    ncols = ncols_v * V
    dref = tl.load(DST_REF + c, mask=c_ok, other=0)
    dcol = tl.load(DST_COL + c, mask=c_ok, other=0)
    dptr = _ptrs(TAB, dref, dcol, row, 2 * n_src, 2 * n_src + n_dst, ELEM, V, VB)
    if K == 1:
        sref = tl.load(SRC_REF + c, mask=c_ok, other=0)
        scol = tl.load(SRC_COL + c, mask=c_ok, other=0)
        x = tl.load(_ptrs(TAB, sref, scol, row, 0, n_src, ELEM, V, VB), mask=mask)
        tl.store(dptr, x, mask=mask)
    else:
        acc = tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.float32)
        for k in tl.static_range(K):
            sref = tl.load(SRC_REF + k * ncols + c, mask=c_ok, other=0)
            scol = tl.load(SRC_COL + k * ncols + c, mask=c_ok, other=0)
            acc += tl.load(_ptrs(TAB, sref, scol, row, 0, n_src, ELEM, V, VB), mask=mask).to(tl.float32)
        tl.store(dptr, acc.to(ELEM.dtype.element_ty), mask=mask)


def launch(
    tab,
    src_ref,
    src_col,
    dst_ref,
    dst_col,
    elem,
    batch: int,
    ncols: int,
    n_src: int,
    n_dst: int,
    k: int,
    vec: int,
    block_b: int,
    block_w_bytes: int,
    num_warps: int,
) -> None:
    """One launch of `_gather_cols` over `ncols` destination columns and `batch` rows (`vec` divides ncols)."""
    esize = elem.element_size()
    block_w = max(vec, block_w_bytes // esize)
    grid = (triton.cdiv(batch, block_b), triton.cdiv(ncols, block_w))
    _gather_cols[grid](
        tab, src_ref, src_col, dst_ref, dst_col, elem, batch, ncols // vec, n_src, n_dst,
        K=k, BLOCK_B=block_b, BLOCK_W=block_w, V=vec, VB=vec * esize, num_warps=num_warps,
    )  # fmt: skip
