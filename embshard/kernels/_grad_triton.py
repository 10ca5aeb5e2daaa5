"""Triton kernels of the small-table backward: the gradient of the pooled sums with respect to the rows, by atomics
(fast, robust to skewed ids) or by a sort (bitwise reproducible). Imported only when a Triton path runs (GPU, or
CPU tensors under TRITON_INTERPRET=1). Both work on one width group (`layout.WidthGroup`, D a compile-time
constant: 16-byte vector loads and atomics, `red.global.add.v4.f32` on sm_90) and cover all its features. Both
weigh an id by PSW where its feature's flag (WGT / WGT_F) is set, as the forward did (every feature's for a padded
batch: `PoolLayout.on` / `feature_tables` with `all_weighted`), by 1 elsewhere.

- `_bwd_atomic`: a program takes BAGS bags of one feature and walks them in chunks of BLOCK_N ids. Per chunk it
  sorts each bag's ids in registers (`tl.sort` of `id * BLOCK_N + slot`), finds the runs of equal ids (`tl.gather`
  of the right neighbour) and sums their weights (a segmented `tl.associative_scan`, the count when unweighted):
  a row repeated in a bag costs one atomic add of `weight sum x bag gradient`, so a hot row pays at most one add
  per bag chunk instead of one per id (`DEDUP`; off: one add per id, the first version). Programs are ordered so
  that GI features run side by side (`_program_tile`): the chains of adds into each table's hottest row overlap
  with the other tables' work instead of following one another. `scale` multiplies every gradient (direct sgd
  passes -lr and the weights as the buffer). Not bitwise reproducible: the order of a row's adds varies.
- `_sort_keys` + torch.sort + `_bwd_sorted` + `_bwd_sorted_fixup` (deterministic): one pass writes each id's row
  key (int32 when the rows allow) and bag; torch.sort orders the keys stably (radix sort); fixed tiles of P sorted
  positions form their rows `[P, D]` and sum runs of equal rows with a segmented scan; a row whose ids all lie in
  one tile is written at once, a row crossing tiles leaves one partial per tile, which the fix-up (run by the tile
  where the row starts) adds in tile order. Fixed tiles, scan tree and order of partials: bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.kernels._pool_triton import bags_of, feature_lanes
from embshard.kernels.layout import DeviceGroup, FeatureTables, Tiles, WidthGroup

INT32_MAX = 2**31 - 1
KEY32_LIMIT = INT32_MAX
"""Sort keys are int32 while they stay below this (int64 beyond: more registers, slower sorts)."""
INTERLEAVE_L2_BYTES = 16 << 20
"""Default interleave: as many features side by side as their tables' bytes fit in this much L2 (a third of an
H100/H200's): their rows stay in L2 while their chains of adds overlap."""


@triton.jit
def _program_tile(pid, F, NT, GI):
    """Program `pid` of F x NT -> (feature j, bag tile): GI features side by side, their tiles interleaved."""
    per = GI * NT
    phase = pid // per
    r = pid - phase * per
    g = tl.minimum(GI, F - phase * GI)
    return phase * GI + r % g, r // g


@triton.jit
def _seg_add(k1, v1, k2, v2):
    return k2, tl.where(k1 == k2, v1 + v2, v2)


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
    F,
    NT,
    GI,
    gout_stride,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PSW: tl.constexpr,
    MARK: tl.constexpr,
    DEDUP: tl.constexpr,
    KEY64: tl.constexpr,
):
    j, tile = _program_tile(tl.program_id(0), F, NT, GI)
    f = tl.load(FEATS + j).to(tl.int64)
    bag, bag_ok, _, start, length = bags_of(OFF, f, tile, B, BAGS)
    row0, col, d, d_ok, n, weighted = feature_lanes(ROW0, COLS, WGT, j, D, BLOCK_D, BLOCK_N)
    gptr = GOUT + bag[:, None].to(tl.int64) * gout_stride + col + d[None, :]
    go = tl.load(gptr, mask=bag_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
    nxt_n = tl.broadcast_to(tl.minimum(n + 1, BLOCK_N - 1)[None, :], [BAGS, BLOCK_N])
    at_end = tl.broadcast_to((n == BLOCK_N - 1)[None, :], [BAGS, BLOCK_N])
    for s in range(0, tl.max(length, axis=0), BLOCK_N):
        ok = (s + n)[None, :] < length[:, None]
        pos = start[:, None] + (s + n)[None, :]
        ids = tl.load(IDX + pos, mask=ok, other=0).to(tl.int64)
        if DEDUP:
            # sort each bag's ids (slot in the low bits), one add per run of equal ids: weight sum x bag gradient
            if KEY64:
                key = tl.sort(tl.where(ok, ids * BLOCK_N + n[None, :], 0x7FFFFFFFFFFFFFFF))
                valid = key != 0x7FFFFFFFFFFFFFFF
            else:
                key = tl.sort(tl.where(ok, ids.to(tl.int32) * BLOCK_N + n[None, :], 0x7FFFFFFF))
                valid = key != 0x7FFFFFFF
            sid = key // BLOCK_N
            emit = valid & ((tl.gather(sid, nxt_n, 1) != sid) | at_end)
            if HAS_PSW:
                spos = start[:, None] + s + (key % BLOCK_N).to(tl.int64)
                w = tl.where(weighted, tl.load(PSW + spos, mask=valid, other=0.0), valid.to(tl.float32))
            else:
                w = valid.to(tl.float32)
            # not `_`: a name bound before the loop (bags_of's) would be loop-carried, and Triton's compiler
            # refuses its change of type (the interpreter does not check)
            _sid_scan, wsum = tl.associative_scan((sid, w), 1, _seg_add)
            rows = sid.to(tl.int64) + row0
            val = go[:, None, :] * wsum[:, :, None]
        else:
            emit = ok
            rows = ids + row0
            val = tl.broadcast_to(go[:, None, :], [BAGS, BLOCK_N, BLOCK_D])
            if HAS_PSW:
                val = val * tl.where(weighted, tl.load(PSW + pos, mask=ok, other=1.0), 1.0)[:, :, None]
        ptr = G + (rows * D)[:, :, None] + d[None, None, :]
        tl.atomic_add(ptr, val, mask=emit[:, :, None] & d_ok[None, None, :], sem="relaxed")
        if MARK:
            tl.store(TOUCH + rows, tl.full([BAGS, BLOCK_N], 1, tl.int8), mask=emit)


@triton.jit
def _sort_keys(KEY, BAG, IDX, OFF, KEY0, B, F, NT, BAGS: tl.constexpr, BLOCK_N: tl.constexpr, KEY64: tl.constexpr):
    """Every id's key (its row counted over all groups: KEY0[feature] + id) and its bag (feature * B + b)."""
    j, tile = _program_tile(tl.program_id(0), F, NT, 1)
    f = j.to(tl.int64)
    _, _, first, start, length = bags_of(OFF, f, tile, B, BAGS)
    key0 = tl.load(KEY0 + f)
    n = tl.arange(0, BLOCK_N)
    for s in range(0, tl.max(length, axis=0), BLOCK_N):
        ok = (s + n)[None, :] < length[:, None]
        pos = start[:, None] + (s + n)[None, :]
        key = tl.load(IDX + pos, mask=ok, other=0).to(tl.int64) + key0
        if KEY64:
            tl.store(KEY + pos, key, mask=ok)
        else:
            tl.store(KEY + pos, key.to(tl.int32), mask=ok)
        tl.store(BAG + pos, tl.broadcast_to(first[:, None], [BAGS, BLOCK_N]).to(tl.int32), mask=ok)


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
    gi,
    B,
    gout_stride,
    key0,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    HAS_PSW: tl.constexpr,
    MARK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(BOUNDS + gi)
    end = tl.load(BOUNDS + gi + 1)
    p0 = start + t * P
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
        bag = tl.load(BAG + i, mask=ok, other=0).to(tl.int64)
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
        row = key.to(tl.int64) - key0
        tl.store(G + (row * D)[:, None] + d[None, :], run, mask=complete[:, None] & d_ok[None, :])
        head = seg_end & from_before
        tl.store(PART + (t * 2 * BLOCK_D + d)[None, :] + tl.zeros_like(row)[:, None], run, mask=head[:, None])
        owner = tile_end & (nxt == key) & (from_before == 0)
        tl.store(PART + ((t * 2 + 1) * BLOCK_D + d)[None, :] + tl.zeros_like(row)[:, None], run, mask=owner[:, None])
        if MARK:
            tl.store(TOUCH + row, tl.full([P], 1, tl.int8), mask=seg_end)
        tl.store(TINFO + t * 4, first.to(tl.int64))
        tl.store(TINFO + t * 4 + 1, head_cont.to(tl.int64))
        tl.store(TINFO + t * 4 + 2, last.to(tl.int64))
        tl.store(TINFO + t * 4 + 3, tail_cont.to(tl.int64))


@triton.jit
def _bwd_sorted_fixup(
    G, PART, TINFO, BOUNDS, gi, key0, D: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr, K: tl.constexpr
):
    """Run by the tile where a row crossing tiles starts: its partial, then the head partials of the following tiles
    the row reaches, K tiles at a time (each K summed in a fixed tree, the K-blocks in order)."""
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(BOUNDS + gi)
    end = tl.load(BOUNDS + gi + 1)
    tiles = (end - start + P - 1) // P
    if t < tiles:
        first = tl.load(TINFO + t * 4)
        head_cont = tl.load(TINFO + t * 4 + 1) != 0
        last = tl.load(TINFO + t * 4 + 2)
        tail_cont = tl.load(TINFO + t * 4 + 3) != 0
        if tail_cont & ((last != first) | (head_cont == 0)):  # this tile holds the start of a row that goes on
            d = tl.arange(0, BLOCK_D)
            kk = tl.arange(0, K)
            acc = tl.load(PART + (t * 2 + 1) * BLOCK_D + d)
            t2 = t + 1
            more = True
            while more:
                tk = t2 + kk
                ok = tk < tiles
                # tile tk ends inside the row (the row goes on past it): then tile tk + 1 holds more of it
                goes_on = ok & (tl.load(TINFO + tk * 4 + 2, mask=ok, other=-1) == last)
                goes_on = goes_on & (tl.load(TINFO + tk * 4 + 3, mask=ok, other=0) != 0)
                stops = (goes_on == 0).to(tl.int32)
                take = ok & ((tl.cumsum(stops, 0) - stops) == 0)  # every tile before it in the block went on
                part = tl.load(PART + (tk * 2)[:, None] * BLOCK_D + d[None, :], mask=take[:, None], other=0.0)
                acc += tl.sum(part, axis=0)
                more = tl.sum((take & goes_on).to(tl.int32), axis=0) == K
                t2 += K
            tl.store(G + (last - key0) * D + d, acc, mask=d < D)


# ---- launchers ---------------------------------------------------------------------------------------------------
def backward_tiles(dim: int, tiles: Tiles) -> tuple[int, int, int]:
    """(BLOCK_D, BAGS, BLOCK_N) of the atomic backward for rows `dim` wide: chunks of 32 ids per bag up to 32
    columns, 16 beyond (the chunk is what the dedup sorts), about 2,048 added elements per step of a program."""
    block_d = triton.next_power_of_2(dim)
    block_n = tiles.block_n or (32 if block_d <= 32 else 16)
    if tiles.dedup:
        block_n = max(2, block_n)
    bags = tiles.bags or max(1, 2048 // (block_n * block_d))
    return block_d, bags, block_n


def sorted_tile(block_d: int, tiles: Tiles) -> int:
    """Sorted positions per program of the deterministic backward: `Tiles.sorted_block_n` for rows up to 16 wide,
    fewer for wider rows (a `[P, BLOCK_D]` tile of about 1,024 elements for one warp: the fewest instructions per
    id of the segmented scan, as compiled for sm_90)."""
    return max(2, min(tiles.sorted_block_n, tiles.sorted_block_n * 16 // block_d))


def interleave(group: WidthGroup, tiles: Tiles) -> int:
    """Features of `group` whose programs run side by side (`Tiles.interleave`, default: module docstring)."""
    F = len(group.features)
    if tiles.interleave is not None:
        return max(1, min(F, tiles.interleave))
    table_bytes = sum(group.table_rows) * group.dim * 4 / max(F, 1)
    return max(1, min(F, int(INTERLEAVE_L2_BYTES // max(table_bytes, 1.0))))


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
    """Add every id's gradient row (`scale` x its bag's output gradient x its weight) into `grads[g]` with atomics
    (repeats of a row in a bag chunk summed first); mark its row in `touched[g]` (int8) if given."""
    B = grad_out.shape[0]
    for k, (gbuf, dg) in enumerate(zip(grads, groups)):
        g = dg.group
        F = len(g.features)
        block_d, bags, block_n = backward_tiles(g.dim, tiles)
        NT = triton.cdiv(B, bags)
        has_psw = psw is not None and dg.any_weighted
        mark = touched is not None
        key64 = max(g.table_rows, default=0) >= KEY32_LIMIT // block_n - 1
        _bwd_atomic[(F * NT,)](
            gbuf, touched[k] if mark else gbuf, indices, offsets, psw if has_psw else gbuf, grad_out,
            dg.features, dg.row0, dg.cols, dg.weighted, B, F, NT, interleave(g, tiles), grad_out.stride(0), scale,
            D=g.dim, BLOCK_D=block_d, BAGS=bags, BLOCK_N=block_n, HAS_PSW=has_psw, MARK=mark, DEDUP=tiles.dedup,
            KEY64=key64, num_warps=tiles.num_warps,
        )  # fmt: skip


def backward_sorted(
    grads: list[torch.Tensor],
    touched: list[torch.Tensor] | None,
    groups: list[DeviceGroup],
    features: FeatureTables,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    grad_out: torch.Tensor,
    tiles: Tiles,
) -> None:
    """Write the gradient of every row that has ids into `grads[g]` (other rows are left as they are: zero them
    first), summing its ids in the order of a stable sort by row: bitwise reproducible. `features`: the layout's
    per-feature tables (`features.key0[f]`: first row of feature f's table counted over all groups, which follow
    each other)."""
    key0_F, cols_F, weighted_F = features
    B = grad_out.shape[0]
    F = key0_F.numel()
    n = indices.numel()
    if n == 0 or B == 0:
        return
    if F * B >= INT32_MAX:
        raise ValueError(
            f"deterministic small-table backward: {F} features x batch {B} = {F * B} bags, more than int32 bag "
            "numbers hold; split the lookup or the batch, or use the atomic backward (deterministic: false)"
        )
    dev = indices.device
    total = sum(dg.group.rows for dg in groups)
    key64 = total >= KEY32_LIMIT
    keys = torch.empty(n, dtype=torch.int64 if key64 else torch.int32, device=dev)
    bag = torch.empty(n, dtype=torch.int32, device=dev)
    bags, block_n = 4, 32
    NT = triton.cdiv(B, bags)
    _sort_keys[(F * NT,)](keys, bag, indices, offsets, key0_F, B, F, NT, BAGS=bags, BLOCK_N=block_n, KEY64=key64)
    sorted_key, perm = torch.sort(keys, stable=True)
    starts, r = [0], 0
    for dg in groups:
        r += dg.group.rows
        starts.append(r)
    bounds = torch.searchsorted(sorted_key, torch.tensor(starts, dtype=sorted_key.dtype, device=dev))
    key0 = 0
    for k, (gbuf, dg) in enumerate(zip(grads, groups)):
        g = dg.group
        block_d = triton.next_power_of_2(g.dim)
        P = sorted_tile(block_d, tiles)
        T = triton.cdiv(n, P)
        part = torch.empty(T + 1, 2, block_d, dtype=torch.float32, device=dev)
        tinfo = torch.zeros(T + 1, 4, dtype=torch.int64, device=dev)
        has_psw = psw is not None and dg.any_weighted
        mark = touched is not None
        _bwd_sorted[(T,)](
            gbuf, touched[k] if mark else gbuf, part, tinfo, sorted_key, bounds, perm, bag, psw if has_psw else gbuf,
            grad_out, cols_F, weighted_F, k, B, grad_out.stride(0), key0, D=g.dim, BLOCK_D=block_d, P=P,
            HAS_PSW=has_psw, MARK=mark, num_warps=1,
        )  # fmt: skip
        _bwd_sorted_fixup[(T,)](gbuf, part, tinfo, bounds, k, key0, D=g.dim, BLOCK_D=block_d, P=P, K=32, num_warps=1)
        key0 += g.rows
