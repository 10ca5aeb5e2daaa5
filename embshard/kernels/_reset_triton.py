"""The Triton kernels that reset the rows a raw-id table gave to new ids (embshard.rawids.IdMap.reset).

A step's reset list has one entry per id of a lookup group (its size is known on the host without a sync), most
of them -1 (no new row there), each with its shard. One launch covers every shard of the group whose tensors share
one storage (a TBE's flat weights, or one optimizer state): a program takes BLOCK_E entries and returns at once
when none of them lists a row, so the work follows the rows actually reset; per shard, the parameters (where its
rows start in the storage, its row stride, width, table row offset, ...) are read from small tables.

`reset_weights_batched_`: the rows' initial values, bit for bit those of `embshard.lookup.shards.init_rows`
(splitmix64 of the element's table index keyed by the table's key, its top 24 bits as u, then u x scale - bound in
two fp32 roundings: the kernel is compiled without FMA contraction). `zero_rows_batched_`: zeros into the rows of
an optimizer state (`[rows]` or `[rows, D]` per shard). `reset_weights_` / `zero_rows_`: one shard.
`reset_listed_`: either, for the entries a compact list of positions names (the Triton map step lists them, with
their count on the device): at most LISTED_PROGRAMS programs walk the list, so a step that gave no row launches
one kernel whose programs return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.lookup.shards import _GOLDEN, _MIX1, _MIX2, _signed, fp32

BLOCK_E = 16
"""Reset-list entries per program."""


@triton.jit
def _write_init(W, r, s, PI, PF, KEY, T, golden, mix1, mix2, BLOCK_D: tl.constexpr):
    """The initial values of rows `r` (-1: skip) of shards `s` into W."""
    base = tl.load(PI + s)  # where the shard's rows start in W (elements)
    stride = tl.load(PI + T + s)
    row_offset = tl.load(PI + 2 * T + s)
    dim = tl.load(PI + 3 * T + s)
    col_offset = tl.load(PI + 4 * T + s)
    num_cols = tl.load(PI + 5 * T + s)
    key = tl.load(KEY + s)
    scale = tl.load(PF + s)
    bound = tl.load(PF + T + s)
    c = tl.arange(0, BLOCK_D).to(tl.int64)
    z = ((r + row_offset) * dim + col_offset)[:, None] + c[None, :]  # the element's index in the table
    z = z * golden + key[:, None]
    z = z ^ ((z >> 30) & 0x3FFFFFFFF)  # logical shifts: arithmetic shift, then the high bits masked off
    z = z * mix1
    z = z ^ ((z >> 27) & 0x1FFFFFFFFF)
    z = z * mix2
    z = z ^ ((z >> 31) & 0x1FFFFFFFF)
    u = ((z >> 40) & 0xFFFFFF).to(tl.float32)
    v = u * scale[:, None] - bound[:, None]
    mask = (r >= 0)[:, None] & (c[None, :] < num_cols[:, None])
    tl.store(W + (base + r * stride)[:, None] + c[None, :], v.to(W.dtype.element_ty), mask=mask)


@triton.jit
def _write_zeros(V, r, s, PI, T, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zeros into rows `r` (-1: skip) of shards `s` of V."""
    base = tl.load(PI + s)
    stride = tl.load(PI + T + s)
    width = tl.load(PI + 2 * T + s)
    c = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (r >= 0)[:, None] & (c[None, :] < width[:, None])
    zeros = tl.zeros([BLOCK_E, BLOCK_D], V.dtype.element_ty)
    tl.store(V + (base + r * stride)[:, None] + c[None, :], zeros, mask=mask)


@triton.jit
def _reset_weights_kernel(
    W, ROWS, SHARD, n, PI, PF, KEY, T, golden, mix1, mix2, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    r = tl.load(ROWS + e, mask=e < n, other=-1)
    if tl.max(r, 0) >= 0:
        s = tl.load(SHARD + e, mask=e < n, other=0)
        _write_init(W, r, s, PI, PF, KEY, T, golden, mix1, mix2, BLOCK_D)


@triton.jit
def _zero_rows_kernel(V, ROWS, SHARD, n, PI, T, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    r = tl.load(ROWS + e, mask=e < n, other=-1)
    if tl.max(r, 0) >= 0:
        s = tl.load(SHARD + e, mask=e < n, other=0)
        _write_zeros(V, r, s, PI, T, BLOCK_E, BLOCK_D)


@triton.jit
def _listed(LIST, COUNT, ROWS, SHARD, e, lo, hi, s0, ns):
    """Entries e of the list of positions: (their rows, -1 where none or outside positions lo..hi-1 or shards
    s0..s0+ns-1; their shards - s0)."""
    live = e < tl.load(COUNT)
    p = tl.load(LIST + e, mask=live, other=0)
    live = live & (p >= lo) & (p < hi)
    s = tl.load(SHARD + p, mask=live, other=0) - s0
    live = live & (s >= 0) & (s < ns)
    r = tl.load(ROWS + p, mask=live, other=-1)
    return tl.where(live, r, -1), tl.where(live, s, 0)


@triton.jit
def _reset_listed_kernel(
    V, LIST, COUNT, ROWS, SHARD, lo, hi, s0, ns, PI, PF, KEY, T, golden, mix1, mix2, ZEROS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    step = tl.num_programs(0) * BLOCK_E
    for start in range(tl.program_id(0) * BLOCK_E, tl.load(COUNT), step):
        r, s = _listed(LIST, COUNT, ROWS, SHARD, start + tl.arange(0, BLOCK_E), lo, hi, s0, ns)
        if ZEROS:
            _write_zeros(V, r, s, PI, T, BLOCK_E, BLOCK_D)
        else:
            _write_init(V, r, s, PI, PF, KEY, T, golden, mix1, mix2, BLOCK_D)


LISTED_PROGRAMS = 1024
"""Programs of a listed reset at most (each walks the list in steps of all of them)."""


def reset_listed_(
    flat: torch.Tensor,
    listed: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    shard: torch.Tensor,
    span: tuple[int, int, int, int],
    ints: torch.Tensor,
    floats: torch.Tensor | None,
    keys: torch.Tensor | None,
    width: int,
) -> None:
    """`reset_weights_batched_` (`floats` and `keys` given) or `zero_rows_batched_` (None) for the entries of the
    reset list `rows` / `shard` (per batch position) at the positions `listed` (positions `[n]`, the first
    `count[0]` valid), those of positions lo..hi-1 and shards s0..s0+ns-1 only (`span`), shard s at index s - s0
    of the tables. The work follows the count (a device scalar): programs past it return at once."""
    n = rows.numel()
    if n == 0:
        return
    lo, hi, s0, ns = span
    T = ints.shape[1]
    zeros = floats is None
    grid = (min(triton.cdiv(n, BLOCK_E), LISTED_PROGRAMS),)
    _reset_listed_kernel[grid](
        flat, listed[0], listed[1], rows, shard, lo, hi, s0, ns, ints, ints if zeros else floats,
        ints if zeros else keys, T, _GOLDEN, _MIX1, _MIX2, ZEROS=zeros, BLOCK_E=BLOCK_E,
        BLOCK_D=triton.next_power_of_2(width), enable_fp_fusion=False,
    )  # fmt: skip


def reset_weights_batched_(
    flat: torch.Tensor,
    rows: torch.Tensor,
    shard: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    width: int,
) -> None:
    """Write initial values into the rows `rows` (int64 local rows; -1: skip) of shards `shard` (int64) whose
    weights live in `flat` (the storage, 1-d). Per shard: `ints` `[6, T]` int64: first element, row stride, table
    row offset, table dim, column offset, columns; `floats` `[2, T]` fp32: scale (2 x bound / 2^24), bound; `keys`
    `[T]` int64: the table's stream key. `width`: the widest shard's columns."""
    n = rows.numel()
    if n == 0:
        return
    T = ints.shape[1]
    _reset_weights_kernel[(triton.cdiv(n, BLOCK_E),)](
        flat, rows, shard, n, ints, floats, keys, T, _GOLDEN, _MIX1, _MIX2,
        BLOCK_E=BLOCK_E, BLOCK_D=triton.next_power_of_2(width), enable_fp_fusion=False,
    )  # fmt: skip


def zero_rows_batched_(flat: torch.Tensor, rows: torch.Tensor, shard: torch.Tensor, ints: torch.Tensor, width: int):
    """Zeros into the rows `rows` (-1: skip) of shards `shard` of an optimizer state living in `flat` (1-d);
    `ints` `[3, T]` int64 per shard: first element, row stride, elements per row."""
    n = rows.numel()
    if n == 0:
        return
    T = ints.shape[1]
    _zero_rows_kernel[(triton.cdiv(n, BLOCK_E),)](
        flat, rows, shard, n, ints, T, BLOCK_E=BLOCK_E, BLOCK_D=triton.next_power_of_2(width)
    )


def reset_weights_(
    w: torch.Tensor, rows: torch.Tensor, row_offset: int, dim: int, col_offset: int, key: int, bound: float
) -> None:
    """Write into the rows `rows` (int64 local rows; -1: skip) of the shard weights `w` `[rows, num_cols]` the
    initial values of table rows `rows + row_offset`, columns `col_offset ..` (the table `dim` wide, its stream key
    `key`, values in [-bound, bound))."""
    dev = w.device
    ints = torch.tensor([[0], [w.stride(0)], [row_offset], [dim], [col_offset], [w.shape[1]]], device=dev)
    floats = torch.tensor([[fp32(2.0 * bound / (1 << 24))], [fp32(bound)]], dtype=torch.float32, device=dev)
    keys = torch.tensor([_signed(key)], dtype=torch.int64, device=dev)
    reset_weights_batched_(w, rows, torch.zeros_like(rows), ints, floats, keys, w.shape[1])


def zero_rows_(v: torch.Tensor, rows: torch.Tensor) -> None:
    """Zeros into the rows `rows` (-1: skip) of `v` (`[rows]` or `[rows, D]`)."""
    width = v.shape[1] if v.dim() > 1 else 1
    ints = torch.tensor([[0], [v.stride(0)], [width]], device=v.device)
    zero_rows_batched_(v, rows, torch.zeros_like(rows), ints, width)
