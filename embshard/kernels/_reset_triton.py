"""The Triton kernels that reset the rows a raw-id table gave to new ids (embshard.rawids.IdMap.reset).

A step's reset list has one entry per id of the shard (its size is known on the host without a sync), most of
them -1 (no new row there). Torch ops would draw initial values for every entry; here a program per entry reads
its row and returns at once when it is -1, so the work follows the rows actually reset.

`reset_weights_`: the rows' initial values, bit for bit those of `embshard.lookup.shards.init_rows` (splitmix64
of the element's table index keyed by the table's key, its top 24 bits as u, then u x scale - bound in two fp32
roundings: the kernel is compiled without FMA contraction). `zero_rows_`: zeros into the rows of an optimizer
state (`[rows]` or `[rows, D]`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.lookup.shards import _GOLDEN, _MIX1, _MIX2


@triton.jit
def _reset_weights_kernel(
    W, w_stride, ROWS, row_offset, dim, col_offset, num_cols, key, golden, mix1, mix2, scale, bound,
    BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.load(ROWS + tl.program_id(0))
    if r >= 0:
        c = tl.arange(0, BLOCK)
        z = (r + row_offset) * dim + col_offset + c.to(tl.int64)  # the element's index in the table
        z = z * golden + key
        z = z ^ ((z >> 30) & 0x3FFFFFFFF)  # logical shifts: arithmetic shift, then the high bits masked off
        z = z * mix1
        z = z ^ ((z >> 27) & 0x1FFFFFFFFF)
        z = z * mix2
        z = z ^ ((z >> 31) & 0x1FFFFFFFF)
        u = ((z >> 40) & 0xFFFFFF).to(tl.float32)
        v = u * scale - bound
        tl.store(W + r * w_stride + c, v.to(W.dtype.element_ty), mask=c < num_cols)


@triton.jit
def _zero_rows_kernel(V, v_stride, ROWS, width, BLOCK: tl.constexpr):
    r = tl.load(ROWS + tl.program_id(0))
    if r >= 0:
        c = tl.arange(0, BLOCK)
        tl.store(V + r * v_stride + c, tl.zeros([BLOCK], V.dtype.element_ty), mask=c < width)


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def reset_weights_(
    w: torch.Tensor, rows: torch.Tensor, row_offset: int, dim: int, col_offset: int, key: int, bound: float
) -> None:
    """Write into the rows `rows` (int64 local rows; -1: skip) of the shard weights `w` `[rows, num_cols]` the
    initial values of table rows `rows + row_offset`, columns `col_offset ..` (the table `dim` wide, its stream key
    `key`, values in [-bound, bound))."""
    if rows.numel() == 0:
        return
    num_cols = w.shape[1]
    scale = torch.tensor(2.0 * bound / (1 << 24), dtype=torch.float32).item()  # the fp32 factor init_rows uses
    bound32 = torch.tensor(bound, dtype=torch.float32).item()
    _reset_weights_kernel[(rows.numel(),)](
        w, w.stride(0), rows, row_offset, dim, col_offset, num_cols, _signed(key), _GOLDEN, _MIX1, _MIX2,
        scale, bound32, BLOCK=triton.next_power_of_2(num_cols), enable_fp_fusion=False,
    )  # fmt: skip


def zero_rows_(v: torch.Tensor, rows: torch.Tensor) -> None:
    """Zeros into the rows `rows` (-1: skip) of `v` (`[rows]` or `[rows, D]`)."""
    if rows.numel() == 0:
        return
    width = v.shape[1] if v.dim() > 1 else 1
    stride = v.stride(0)
    _zero_rows_kernel[(rows.numel(),)](v, stride, rows, width, BLOCK=triton.next_power_of_2(width))
