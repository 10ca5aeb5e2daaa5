"""Triton kernels of the small-table lookup: pooled forward and the row update (the backward's gradient kernels are
in `_grad_triton`). Imported only when a Triton path runs (GPU, or CPU tensors under TRITON_INTERPRET=1).

Every kernel works on one width group (`layout.WidthGroup`): a `[rows, D]` block with D a compile-time constant,
so row addresses `row * D` are multiples of 4 elements when D is, and Triton issues 16-byte loads. One launch
covers every feature of the group.

- `_fwd`: grid (bag tiles, features). A program pools BAGS bags of one feature: for chunks of BLOCK_N ids of
  each bag it loads the ids `[BAGS, BLOCK_N]`, gathers their rows `[BAGS, BLOCK_N, D]` and sums over the chunk.
  Bags of one tile that are shorter than the longest are masked (masked lanes issue no memory traffic). The
  per-sample weights PSW multiply the rows of features whose flag WGT is set (`DeviceGroup.weighted`: the weighted
  tables', or every feature's for a padded batch, `PoolLayout.on(all_weighted=True)`).
- `_update`: the fused optimizer rules of embshard.spec.optim on the rows whose gradient is non-zero (or that were
  marked touched, when the rule changes rows with a zero gradient: weight decay, adam); zeroes the gradient rows it
  consumed and their marks, so the gradient buffer is all zeros again for the next step without a memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.kernels._common_triton import block_range
from embshard.kernels.layout import DeviceGroup, Tiles

SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


@triton.jit
def bags_of(OFF, f, tile, B, BAGS: tl.constexpr):
    """Bags `tile * BAGS + [0, BAGS)` of feature `f` (int64) in feature-major offsets `OFF` of B bags a feature:
    (bag, bag < B, the bag's index in the offsets, its first id, its length)."""
    bag = tile * BAGS + tl.arange(0, BAGS)
    bag_ok = bag < B
    first = f * B + bag
    start = tl.load(OFF + first, mask=bag_ok, other=0).to(tl.int64)
    end = tl.load(OFF + first + 1, mask=bag_ok, other=0).to(tl.int64)
    return bag, bag_ok, first, start, end - start


@triton.jit
def feature_lanes(ROW0, COLS, WGT, j, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Feature j of a group: its first row in the group's block, its first output column, whether its ids are
    weighted; and a program's lanes: columns d (valid where d < D) and ids n of a chunk."""
    row0 = tl.load(ROW0 + j)
    col = tl.load(COLS + j)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    weighted = tl.load(WGT + j) != 0
    return row0, col, d, d < D, n, weighted


@triton.jit
def _bag_setup(OFF, FEATS, B, BAGS: tl.constexpr):
    j = tl.program_id(1)
    f = tl.load(FEATS + j).to(tl.int64)
    bag, bag_ok, _, start, length = bags_of(OFF, f, tl.program_id(0), B, BAGS)
    return j, bag, bag_ok, start, length


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
    row0, col, d, d_ok, n, weighted = feature_lanes(ROW0, COLS, WGT, j, D, BLOCK_D, BLOCK_N)
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
    r, r_ok = block_range(R, BLOCK_R)
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
