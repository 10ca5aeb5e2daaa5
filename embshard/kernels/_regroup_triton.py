"""The Triton kernel of the regroup (embshard.collection.regroup_kernel): a column gather between lists of `[B, width]`
tensors, used forward (input blocks -> output groups) and backward (output gradients -> input gradients).

One launch moves every column. The grid tiles the destination columns (all destination tensors side by side) and
the batch: a program copies a `[BLOCK_B, BLOCK_W]` tile. Per destination column, `DST[c]` says which destination
tensor and column it is, and `SRC[k, c]` its k-th source (K sources: a backward column sums the gradients of every
group that used it; an unused one has only the zero source), each packed in one int32: tensor << COL_BITS | column
(`pack`), so the per-column metadata a program reads is small next to the tile it moves. Tensor addresses and row
strides change every call: up to 8 sources and 8 destinations they are kernel arguments (no copy to the device),
beyond that they come in a small per-call table `TAB` (int64: source addresses, source strides, destination
addresses, destination strides). The zero source is a 16-byte zero buffer with stride 0.

Vector loads: Triton cannot see that gathered addresses are contiguous, so when every key width, row stride and
address is a multiple of V elements (16 bytes: V = 4 fp32, 8 bf16) the pointers carry the hints "contiguous in
runs of V, first of each run 16-byte aligned", which holds because a run of V columns never crosses a key. The
caller computes V per call from the actual tensors (V = 1: no hint).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_ARGS = 8  # tensors per side passed as kernel arguments
COL_BITS = 19  # packed metadata: column in the low 19 bits, tensor index above (up to 4,095 tensors)
MAX_TENSORS = (1 << (31 - COL_BITS)) - 1
_COL_BITS = tl.constexpr(COL_BITS)  # the kernels' copies (globals in a kernel must be constexpr)
_COL_MASK = tl.constexpr((1 << COL_BITS) - 1)


def pack(refs, cols):
    """int32 metadata of columns: tensor index << COL_BITS | column (numpy or python ints -> a list)."""
    if max(cols, default=0) >= 1 << COL_BITS or max(refs, default=0) > MAX_TENSORS:
        raise ValueError(
            f"regroup kernel: a block or group {max(cols) + 1} columns wide or {max(refs) + 1} tensors; the kernel "
            f"takes up to {1 << COL_BITS} columns per tensor and {MAX_TENSORS} tensors: use impl='fbgemm'"
        )
    return [(r << COL_BITS) | c for r, c in zip(refs, cols)]


@triton.jit
def _pick(ref, x0, x1, x2, x3, x4, x5, x6, x7):
    v = tl.where(ref == 1, x1, x0)
    v = tl.where(ref == 2, x2, v)
    v = tl.where(ref == 3, x3, v)
    v = tl.where(ref == 4, x4, v)
    v = tl.where(ref == 5, x5, v)
    v = tl.where(ref == 6, x6, v)
    return tl.where(ref == 7, x7, v)


@triton.jit
def _ptrs(addr, stride, col, row, ELEM, V: tl.constexpr, VB: tl.constexpr):
    base = addr.to(tl.pointer_type(ELEM.dtype.element_ty))
    ptr = base[None, :] + (row[:, None] * stride[None, :] + col[None, :])
    if V > 1:
        ptr = tl.max_contiguous(tl.multiple_of(ptr, [1, VB]), [1, V])
    return ptr


@triton.jit
def _column_ptrs(
    meta, row, ADDRS, STRIDES, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
    ELEM, V: tl.constexpr, VB: tl.constexpr, FROM_ARGS: tl.constexpr,
):  # fmt: skip
    """Pointers `[rows, columns]` to the columns `meta` (`pack`ed tensor << COL_BITS | column) of their tensors:
    addresses and row strides picked from x0..x7 and y0..y7 (FROM_ARGS), else read from the tables ADDRS and
    STRIDES (each indexed by tensor)."""
    ref = meta >> _COL_BITS
    col = meta & _COL_MASK
    if FROM_ARGS:
        addr = _pick(ref, x0, x1, x2, x3, x4, x5, x6, x7)
        stride = _pick(ref, y0, y1, y2, y3, y4, y5, y6, y7)
    else:
        addr = tl.load(ADDRS + ref)
        stride = tl.load(STRIDES + ref)
    return _ptrs(addr, stride, col, row, ELEM, V, VB)


@triton.jit(do_not_specialize=[f"{p}{i}" for p in "astb" for i in range(8)])
def _gather_cols(
    TAB,
    SRC,
    DST,
    ELEM,
    B,
    ncols_v,
    n_src,
    n_dst,
    a0, a1, a2, a3, a4, a5, a6, a7,
    s0, s1, s2, s3, s4, s5, s6, s7,
    b0, b1, b2, b3, b4, b5, b6, b7,
    t0, t1, t2, t3, t4, t5, t6, t7,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    V: tl.constexpr,
    VB: tl.constexpr,
    FROM_ARGS: tl.constexpr,
):  # fmt: skip
    # a*, s*: source addresses and row strides, b*, t*: destination ones (FROM_ARGS); else they are in TAB
    row = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c_ok = (c // V) < ncols_v
    mask = (row < B)[:, None] & c_ok[None, :]
    ncols = ncols_v * V
    dmeta = tl.load(DST + c, mask=c_ok, other=0)
    dptr = _column_ptrs(
        dmeta, row, TAB + 2 * n_src, TAB + 2 * n_src + n_dst, b0, b1, b2, b3, b4, b5, b6, b7,
        t0, t1, t2, t3, t4, t5, t6, t7, ELEM, V, VB, FROM_ARGS,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.float32)
    for k in tl.static_range(K):
        smeta = tl.load(SRC + k * ncols + c, mask=c_ok, other=0)
        sptr = _column_ptrs(
            smeta, row, TAB, TAB + n_src, a0, a1, a2, a3, a4, a5, a6, a7,
            s0, s1, s2, s3, s4, s5, s6, s7, ELEM, V, VB, FROM_ARGS,
        )  # fmt: skip
        x = tl.load(sptr, mask=mask)
        if K == 1:
            tl.store(dptr, x, mask=mask)  # a pure copy: no conversion
        else:
            acc += x.to(tl.float32)
    if K > 1:
        tl.store(dptr, acc.to(ELEM.dtype.element_ty), mask=mask)


def launch(
    srcs,
    dsts,
    src_meta,
    dst_meta,
    batch: int,
    k: int,
    vec: int,
    block_b: int,
    block_w_bytes: int,
    num_warps: int,
) -> None:
    """One launch of `_gather_cols` from `srcs` into `dsts`, (tensor, row stride) pairs (stride 0 for the zero
    source), over `batch` rows; `src_meta` `[K, columns]` and `dst_meta` `[columns]` int32 from `pack` (`vec`
    divides the column count)."""
    import torch

    elem = dsts[0][0]
    esize = elem.element_size()
    ncols = dst_meta.numel()
    block_w = max(vec, block_w_bytes // esize)
    grid = (triton.cdiv(batch, block_b), triton.cdiv(ncols, block_w))
    src_a = [t.data_ptr() for t, _ in srcs]
    src_s = [st for _, st in srcs]
    dst_a = [t.data_ptr() for t, _ in dsts]
    dst_s = [st for _, st in dsts]
    from_args = len(srcs) <= MAX_ARGS and len(dsts) <= MAX_ARGS
    if from_args:
        tab = dst_meta  # unused
        pad = lambda v: v + [0] * (MAX_ARGS - len(v))  # noqa: E731
        scalars = pad(src_a) + pad(src_s) + pad(dst_a) + pad(dst_s)
    else:
        tab = torch.tensor(src_a + src_s + dst_a + dst_s, dtype=torch.int64).to(elem.device, non_blocking=True)
        scalars = [0] * (4 * MAX_ARGS)
    _gather_cols[grid](
        tab, src_meta, dst_meta, elem, batch, ncols // vec, len(srcs), len(dsts), *scalars,
        K=k, BLOCK_B=block_b, BLOCK_W=block_w, V=vec, VB=vec * esize, FROM_ARGS=from_args, num_warps=num_warps,
    )  # fmt: skip
