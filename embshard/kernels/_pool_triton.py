"""Triton kernels of the small-table lookup: pooled forward, atomic backward, sorted (deterministic) backward and the
row update. Imported only when a Triton path runs (GPU, or CPU tensors under TRITON_INTERPRET=1).

Every kernel works on one width group (`layout.WidthGroup`): a `[rows, D]` block with D a compile-time constant,
so row addresses `row * D` are multiples of 4 elements when D is, and Triton issues 16-byte loads and vector
atomics (`red.global.add.v4.f32` on sm_90). One launch covers every feature of the group.

- `_fwd`: grid (bag tiles, features). A program pools BAGS bags of one feature: for chunks of BLOCK_N ids of
  each bag it loads the ids `[BAGS, BLOCK_N]`, gathers their rows `[BAGS, BLOCK_N, D]` and sums over the chunk.
  Bags of one tile that are shorter than the longest are masked (masked lanes issue no memory traffic).
- `_bwd_atomic`: the same tiling; each id adds its bag's output gradient (times its per-sample weight, times
  `scale`) into its row of the gradient block with relaxed atomics. No sort; the summation order of a row's
  contributions varies run to run (not bitwise reproducible).
- `_bwd_sorted` + `_bwd_sorted_fixup`: the ids stably sorted by row (torch.sort), cut into fixed tiles of P
  positions. A program forms the gradient rows of its tile's ids `[P, D]` and sums runs of equal rows with a
  segmented scan; a row whose ids all lie in the tile is written at once, a row crossing a tile boundary leaves a
  partial sum per tile, which the fix-up (run by the tile where the row starts) adds in tile order. Fixed tiles,
  fixed scan tree, fixed order of partials: bitwise reproducible; a hot row's ids are spread over many programs.
- `_update`: the fused optimizer rules of embshard.optim on the rows whose gradient is non-zero (or that were
  marked touched, when the rule changes rows with a zero gradient: weight decay, adam); zeroes the gradient rows it
  consumed and their marks, so the gradient buffer is all zeros again for the next step without a memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.kernels.layout import DeviceGroup, Tiles

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


@triton.jit
def _bag_setup(OFF, FEATS, B, BAGS: tl.constexpr):
    j = tl.program_id(1)
    f = tl.load(FEATS + j).to(tl.int64)
    bag = tl.program_id(0) * BAGS + tl.arange(0, BAGS)
    bag_ok = bag < B
    first = f * B + bag
    start = tl.load(OFF + first, mask=bag_ok, other=0).to(tl.int64)
    end = tl.load(OFF + first + 1, mask=bag_ok, other=0).to(tl.int64)
    return j, bag, bag_ok, start, end - start


@triton.jit
def _fwd(
    W,
    IDX,
    OFF,
    PSW,
    OUT,
    FEATS,
    ROW0,
    COLS,
    WGT,
    B,
    out_stride,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PSW: tl.constexpr,
):
    j, bag, bag_ok, start, length = _bag_setup(OFF, FEATS, B, BAGS)
    row0 = tl.load(ROW0 + j)
    col = tl.load(COLS + j)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    n = tl.arange(0, BLOCK_N)
    weighted = tl.load(WGT + j) != 0
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    for s in range(0, tl.max(length, axis=0), BLOCK_N):
        ok = (s + n)[None, :] < length[:, None]
        pos = start[:, None] + (s + n)[None, :]
        rows = tl.load(IDX + pos, mask=ok, other=0).to(tl.int64) + row0
        ptr = W + (rows * D)[:, :, None] + d[None, None, :]
        x = tl.load(ptr, mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
        if HAS_PSW:
            w = tl.where(weighted, tl.load(PSW + pos, mask=ok, other=1.0), 1.0)
            x = x * w[:, :, None]
        acc += tl.sum(x, axis=1)
    optr = OUT + bag[:, None].to(tl.int64) * out_stride + col + d[None, :]
    tl.store(optr, acc.to(OUT.dtype.element_ty), mask=bag_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_atomic(
    G,
    TOUCH,
    IDX,
    OFF,
    PSW,
    GOUT,
    FEATS,
    ROW0,
    COLS,
    WGT,
    B,
    gout_stride,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PSW: tl.constexpr,
    MARK: tl.constexpr,
):
    j, bag, bag_ok, start, length = _bag_setup(OFF, FEATS, B, BAGS)
    row0 = tl.load(ROW0 + j)
    col = tl.load(COLS + j)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    n = tl.arange(0, BLOCK_N)
    weighted = tl.load(WGT + j) != 0
    gptr = GOUT + bag[:, None].to(tl.int64) * gout_stride + col + d[None, :]
    go = tl.load(gptr, mask=bag_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
    for s in range(0, tl.max(length, axis=0), BLOCK_N):
        ok = (s + n)[None, :] < length[:, None]
        pos = start[:, None] + (s + n)[None, :]
        rows = tl.load(IDX + pos, mask=ok, other=0).to(tl.int64) + row0
        val = tl.broadcast_to(go[:, None, :], [BAGS, BLOCK_N, BLOCK_D])
        if HAS_PSW:
            w = tl.where(weighted, tl.load(PSW + pos, mask=ok, other=1.0), 1.0)
            val = val * w[:, :, None]
        ptr = G + (rows * D)[:, :, None] + d[None, None, :]
        tl.atomic_add(ptr, val, mask=ok[:, :, None] & d_ok[None, None, :], sem="relaxed")
        if MARK:
            tl.store(TOUCH + rows, tl.full([BAGS, BLOCK_N], 1, tl.int8), mask=ok)


@triton.jit
def _seg_add(k1, v1, k2, v2):
    return k2, tl.where(k1 == k2, v1 + v2, v2)


@triton.jit
def _bwd_sorted(
    G,
    TOUCH,
    PART,
    TINFO,
    SKEY,
    BOUNDS,
    PERM,
    BAG,
    PSW,
    GOUT,
    COLS_F,
    WGT_F,
    B,
    gout_stride,
    key0,
    R,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    HAS_PSW: tl.constexpr,
    MARK: tl.constexpr,
):
    t = tl.program_id(0)
    start = tl.load(BOUNDS + key0)
    end = tl.load(BOUNDS + key0 + R)
    p0 = start + t.to(tl.int64) * P
    if p0 < end:
        p = p0 + tl.arange(0, P)
        ok = p < end
        key = tl.load(SKEY + p, mask=ok, other=-1)
        nxt = tl.load(SKEY + p + 1, mask=p + 1 < end, other=-1)
        first = tl.load(SKEY + p0)
        head_cont = tl.load(SKEY + p0 - 1, mask=p0 > start, other=-1) == first
        last_p = tl.minimum(end, p0 + P) - 1
        last = tl.load(SKEY + last_p)
        tail_cont = tl.load(SKEY + last_p + 1, mask=last_p + 1 < end, other=-1) == last
        i = tl.load(PERM + p, mask=ok, other=0)
        bag = tl.load(BAG + i, mask=ok, other=0)
        f = bag // B
        b = bag - f * B
        col = tl.load(COLS_F + f, mask=ok, other=0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        x = tl.load(GOUT + (b * gout_stride + col)[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if HAS_PSW:
            weighted = tl.load(WGT_F + f, mask=ok, other=0) != 0
            x = x * tl.where(weighted, tl.load(PSW + i, mask=ok, other=1.0), 1.0)[:, None]
        _, run = tl.associative_scan((tl.broadcast_to(key[:, None], [P, BLOCK_D]), x), 0, _seg_add)
        tile_end = p == last_p
        seg_end = ok & ((nxt != key) | tile_end)
        from_before = (key == first) & ((tl.zeros([P], tl.int32) + head_cont.to(tl.int32)) != 0)
        complete = seg_end & (nxt != key) & (from_before == 0)
        row = key - key0
        tl.store(G + (row * D)[:, None] + d[None, :], run, mask=complete[:, None] & d_ok[None, :])
        head = seg_end & from_before
        tl.store(PART + (t * 2 * BLOCK_D + d)[None, :] + tl.zeros_like(row)[:, None], run, mask=head[:, None])
        owner = tile_end & (nxt == key) & (from_before == 0)
        tl.store(PART + ((t * 2 + 1) * BLOCK_D + d)[None, :] + tl.zeros_like(row)[:, None], run, mask=owner[:, None])
        if MARK:
            tl.store(TOUCH + row, tl.full([P], 1, tl.int8), mask=seg_end)
        tl.store(TINFO + t * 4, first)
        tl.store(TINFO + t * 4 + 1, head_cont.to(tl.int64))
        tl.store(TINFO + t * 4 + 2, last)
        tl.store(TINFO + t * 4 + 3, tail_cont.to(tl.int64))


@triton.jit
def _bwd_sorted_fixup(G, PART, TINFO, BOUNDS, key0, R, D: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr):
    t = tl.program_id(0)
    start = tl.load(BOUNDS + key0)
    end = tl.load(BOUNDS + key0 + R)
    if start + t.to(tl.int64) * P < end:
        first = tl.load(TINFO + t * 4)
        head_cont = tl.load(TINFO + t * 4 + 1) != 0
        last = tl.load(TINFO + t * 4 + 2)
        tail_cont = tl.load(TINFO + t * 4 + 3) != 0
        if tail_cont & ((last != first) | (head_cont == 0)):  # this tile holds the start of a row that goes on
            d = tl.arange(0, BLOCK_D)
            acc = tl.load(PART + (t * 2 + 1) * BLOCK_D + d)
            t2 = t + 1
            more = tail_cont
            while more:
                acc += tl.load(PART + t2 * 2 * BLOCK_D + d)
                more = (tl.load(TINFO + t2 * 4) == last) & (tl.load(TINFO + t2 * 4 + 2) == last)
                more = more & (tl.load(TINFO + t2 * 4 + 3) != 0)
                t2 += 1
            tl.store(G + (last - key0) * D + d, acc, mask=d < D)


@triton.jit
def _update(
    Wt,
    G,
    M,
    V,
    TOUCH,
    R,
    lr,
    eps,
    wd,
    beta1,
    beta2,
    bias1,
    bias2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    KIND: tl.constexpr,
    USE_TOUCH: tl.constexpr,
    HAS_WD: tl.constexpr,
    ZERO_G: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    d = tl.arange(0, BLOCK_D)
    m2 = r_ok[:, None] & (d < D)[None, :]
    e = (r * D)[:, None] + d[None, :]
    g = tl.load(G + e, mask=m2, other=0.0)
    if USE_TOUCH:
        upd = tl.load(TOUCH + r, mask=r_ok, other=0) != 0
    else:  # a zero-gradient row is left as it is by sgd, adagrad and rowwise_adagrad without weight decay
        upd = tl.sum((g != 0.0).to(tl.int32), axis=1) > 0
    mu = m2 & upd[:, None]
    w = tl.load(Wt + e, mask=mu, other=0.0)
    if HAS_WD:
        g = g + wd * w
    if KIND == 0:
        w = w - g * lr
    elif KIND == 1:
        s = tl.load(M + e, mask=mu, other=0.0) + g * g
        tl.store(M + e, s, mask=mu)
        w = w - tl.div_rn(g * lr, tl.sqrt_rn(s) + eps)
    elif KIND == 2:
        s = tl.load(M + r, mask=r_ok & upd, other=0.0) + tl.div_rn(
            tl.sum(g * g, axis=1), tl.full([BLOCK_R], D, tl.float32)
        )
        tl.store(M + r, s, mask=r_ok & upd)
        w = w - tl.div_rn(g * lr, (tl.sqrt_rn(s) + eps)[:, None])
    else:
        m = tl.load(M + e, mask=mu, other=0.0) * beta1 + (1.0 - beta1) * g
        v = tl.load(V + e, mask=mu, other=0.0) * beta2 + (1.0 - beta2) * (g * g)
        tl.store(M + e, m, mask=mu)
        tl.store(V + e, v, mask=mu)
        w = w - tl.div_rn(tl.div_rn(m, bias1), tl.sqrt_rn(tl.div_rn(v, bias2)) + eps) * lr
    tl.store(Wt + e, w, mask=mu)
    if ZERO_G:
        tl.store(G + e, tl.zeros([BLOCK_R, BLOCK_D], tl.float32), mask=mu)
    if USE_TOUCH:
        tl.store(TOUCH + r, tl.zeros([BLOCK_R], tl.int8), mask=r_ok & upd)


# ---- launchers ---------------------------------------------------------------------------------------------------
def tiles_for(dim: int, tiles: Tiles) -> tuple[int, int, int]:
    """(BLOCK_D, BAGS, BLOCK_N) for rows `dim` wide: about 2,048 gathered elements per step of a program."""
    block_d = triton.next_power_of_2(dim)
    block_n = tiles.block_n or (32 if block_d <= 16 else 16 if block_d <= 64 else 8)
    bags = tiles.bags or max(1, 2048 // (block_n * block_d))
    return block_d, bags, block_n


def forward(
    weights: list[torch.Tensor],
    groups: list[DeviceGroup],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    out: torch.Tensor,
    tiles: Tiles,
) -> None:
    """Pooled sums of every group into its columns of `out` `[B, cols]` (one launch per group)."""
    B = out.shape[0]
    for w, dg in zip(weights, groups):
        g = dg.group
        block_d, bags, block_n = tiles_for(g.dim, tiles)
        has_psw = psw is not None and dg.any_weighted
        grid = (triton.cdiv(B, bags), len(g.features))
        _fwd[grid](
            w, indices, offsets, psw if has_psw else w, out, dg.features, dg.row0, dg.cols, dg.weighted,
            B, out.stride(0), D=g.dim, BLOCK_D=block_d, BAGS=bags, BLOCK_N=block_n, HAS_PSW=has_psw,
            num_warps=tiles.num_warps,
        )  # fmt: skip


def backward_atomic(
    grads: list[torch.Tensor],
    touched: list[torch.Tensor] | None,
    groups: list[DeviceGroup],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    grad_out: torch.Tensor,
    tiles: Tiles,
    scale: float = 1.0,
) -> None:
    """Add every id's gradient row (`scale` x its bag's output gradient x its weight) into `grads[g]` with atomics;
    mark its row in `touched[g]` (int8) if given."""
    B = grad_out.shape[0]
    for k, (gbuf, dg) in enumerate(zip(grads, groups)):
        g = dg.group
        block_d, bags, block_n = tiles_for(g.dim, tiles)
        has_psw = psw is not None and dg.any_weighted
        mark = touched is not None
        grid = (triton.cdiv(B, bags), len(g.features))
        _bwd_atomic[grid](
            gbuf, touched[k] if mark else gbuf, indices, offsets, psw if has_psw else gbuf, grad_out,
            dg.features, dg.row0, dg.cols, dg.weighted, B, grad_out.stride(0), scale,
            D=g.dim, BLOCK_D=block_d, BAGS=bags, BLOCK_N=block_n, HAS_PSW=has_psw, MARK=mark,
            num_warps=tiles.num_warps,
        )  # fmt: skip


def backward_sorted(
    grads: list[torch.Tensor],
    touched: list[torch.Tensor] | None,
    groups: list[DeviceGroup],
    key0_F: torch.Tensor,
    cols_F: torch.Tensor,
    weighted_F: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    grad_out: torch.Tensor,
    tiles: Tiles,
) -> None:
    """Write the gradient of every row that has ids into `grads[g]` (other rows are left as they are: zero them
    first), summing its ids in the order of a stable sort by row: bitwise reproducible. `key0_F[f]`: first row of
    feature f's table counted over all groups (groups follow each other)."""
    B = grad_out.shape[0]
    F = key0_F.numel()
    n = indices.numel()
    if n == 0 or B == 0:
        return
    dev = indices.device
    bag = torch.repeat_interleave(torch.arange(F * B, device=dev), offsets.diff().long(), output_size=n)
    sorted_key, perm = torch.sort(key0_F[bag // B] + indices.long(), stable=True)
    total = sum(dg.group.rows for dg in groups)
    bounds = torch.searchsorted(sorted_key, torch.arange(total + 1, device=dev))
    key0 = 0
    for k, (gbuf, dg) in enumerate(zip(grads, groups)):
        g = dg.group
        block_d = triton.next_power_of_2(g.dim)
        P = tiles.sorted_block_n if block_d <= 32 else max(8, tiles.sorted_block_n * 32 // block_d)
        T = triton.cdiv(n, P)
        part = torch.empty(T + 1, 2, block_d, dtype=torch.float32, device=dev)
        tinfo = torch.zeros(T + 1, 4, dtype=torch.int64, device=dev)
        has_psw = psw is not None and dg.any_weighted
        mark = touched is not None
        _bwd_sorted[(T,)](
            gbuf, touched[k] if mark else gbuf, part, tinfo, sorted_key, bounds, perm, bag, psw if has_psw else gbuf,
            grad_out, cols_F, weighted_F, B, grad_out.stride(0), key0, g.rows, D=g.dim, BLOCK_D=block_d, P=P,
            HAS_PSW=has_psw, MARK=mark, num_warps=4,
        )  # fmt: skip
        _bwd_sorted_fixup[(T,)](gbuf, part, tinfo, bounds, key0, g.rows, D=g.dim, BLOCK_D=block_d, P=P, num_warps=1)
        key0 += g.rows


def update(
    kind: int,
    w: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    touched: torch.Tensor | None,
    lr: float,
    eps: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    step: int,
    zero_grad: bool,
    tiles: Tiles,
) -> None:
    """The update rule on the rows of one group `w` `[R, D]` with gradient `g` (see the module docstring)."""
    R, D = w.shape
    if R == 0:
        return
    m = state.get("m", w)
    v = state.get("v", w)
    block_d = triton.next_power_of_2(D)
    block_r = tiles.block_r or max(1, 512 // block_d)
    _update[(triton.cdiv(R, block_r),)](
        w, g, m, v, touched if touched is not None else w, R, lr, eps, weight_decay, beta1, beta2,
        1.0 - beta1**step, 1.0 - beta2**step, D=D, BLOCK_D=block_d, BLOCK_R=block_r, KIND=kind,
        USE_TOUCH=touched is not None, HAS_WD=weight_decay > 0, ZERO_G=zero_grad, num_warps=4,
    )  # fmt: skip
