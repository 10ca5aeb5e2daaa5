"""The Triton kernels of an `IdMap` (embshard/rawids: index.py, eviction.py), on CUDA: the index's lookups and the
free slots of its inserts, and the LRU order's update.

One program takes BLOCK keys: it hashes each key twice (splitmix64 of `key * golden + salt`, one salt per candidate
bucket, the bits `embshard.rawids.hashing` computes), takes the shard's bucket range (first bucket, buckets) from a
small table, reads the first candidate bucket of P slots (keys and rows), the second only for keys not found in the
first, and writes the row of the slot holding the key (-1: none) and the two buckets. The torch ops it replaces (IndexOps._find_torch) build `[m, 2, P]` int64 and int32
temporaries (about 3 GB read and written at 2M keys) in ~26 launches; this reads the buckets once.

`free_counts_`: the free slots of both candidate buckets of every key (an insert takes the emptier); `pick_free_`:
the slot the q-th key placed into a bucket takes, its q-th free slot (in slot order), or -1 (the torch ops read the
bucket into `[m, P]` temporaries, scan and match them in ~10 launches).

`reorder_`: the LRU order's stable partition (per segment, the rows used at the clock move to its end, in order):
one pass marks the used positions and counts them per block, a cumsum over the blocks, a pass that scans each block
and scatters every row to its new position (its segment by a binary search of the bounds); the torch ops make ~12
passes over the group's rows. The map's Triton step marks the rows it uses in a byte per row, which the first pass
reads (a gather that stays in cache, unlike the rows' last use) and the second clears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.lookup.shards import _GOLDEN, _MIX1, _MIX2

BLOCK = 64
"""Keys per program."""


@triton.jit
def _mix(z, mix1, mix2):
    """splitmix64's output function on int64 (logical shifts: arithmetic shift, then the high bits masked off)."""
    z = z ^ ((z >> 30) & 0x3FFFFFFFF)
    z = z * mix1
    z = z ^ ((z >> 27) & 0x1FFFFFFFFF)
    z = z * mix2
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


@triton.jit
def _bucket(key, salt, first, nb, golden, mix1, mix2):
    """first + (hash mod nb), the remainder taken non-negative (torch.remainder with nb > 0)."""
    r = _mix(key * golden + salt, mix1, mix2) % nb
    return first + tl.where(r < 0, r + nb, r)


@triton.jit
def candidate_buckets(KEYS, SHARD, BTAB, i, live, salt0, salt1, golden, mix1, mix2):
    """The keys at positions `i` (read where `live`), their shards and their two candidate buckets (one per salt,
    each in its shard's range of `BTAB`: first bucket, buckets)."""
    key = tl.load(KEYS + i, mask=live, other=0)
    s = tl.load(SHARD + i, mask=live, other=0)
    first = tl.load(BTAB + 2 * s, mask=live, other=0)
    nb = tl.load(BTAB + 2 * s + 1, mask=live, other=1)
    c0 = _bucket(key, salt0, first, nb, golden, mix1, mix2)
    c1 = _bucket(key, salt1, first, nb, golden, mix1, mix2)
    return key, s, c0, c1


@triton.jit
def _probe(SLOT_KEY, SLOT_ROW, bucket, j, key, live, P: tl.constexpr):
    """Per key the row of the slot of `bucket` holding it, else -1."""
    slot = bucket[:, None] * P + j[None, :]
    sk = tl.load(SLOT_KEY + slot, mask=live[:, None], other=0)
    sr = tl.load(SLOT_ROW + slot, mask=live[:, None], other=-1).to(tl.int64)
    return tl.max(tl.where((sk == key[:, None]) & (sr >= 0), sr, -1), 1)


@triton.jit
def _find_kernel(
    KEYS, SHARD, BTAB, SLOT_KEY, SLOT_ROW, ROW, CAND, m, salt0, salt1, golden, mix1, mix2,
    P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    key, _, c0, c1 = candidate_buckets(KEYS, SHARD, BTAB, i, live, salt0, salt1, golden, mix1, mix2)
    tl.store(CAND + 2 * i, c0, mask=live)
    tl.store(CAND + 2 * i + 1, c1, mask=live)
    j = tl.arange(0, P).to(tl.int64)
    best = _probe(SLOT_KEY, SLOT_ROW, c0, j, key, live, P)
    best = tl.maximum(best, _probe(SLOT_KEY, SLOT_ROW, c1, j, key, live & (best < 0), P))  # the other if not found
    tl.store(ROW + i, best, mask=live)


def find_(
    keys: torch.Tensor,
    shard: torch.Tensor,
    bucket_tab: torch.Tensor,
    slot_key: torch.Tensor,
    slot_row: torch.Tensor,
    salts: tuple[int, int],
    slots_per_bucket: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of every key in the index or -1 (int64 `[m]`), its two candidate buckets (int64 `[m, 2]`)). `keys`,
    `shard` int64 `[m]`; `bucket_tab` int64 `[T, 2]` (first bucket, buckets) per shard; `slot_key` int64 and
    `slot_row` (int32 or int64) the slots (at least buckets x P); `salts` the two buckets' signed 64-bit salts."""
    m = keys.numel()
    row = torch.empty(m, dtype=torch.int64, device=keys.device)
    cand = torch.empty(m, 2, dtype=torch.int64, device=keys.device)
    if m:
        _find_kernel[(triton.cdiv(m, BLOCK),)](
            keys, shard, bucket_tab, slot_key, slot_row, row, cand, m, salts[0], salts[1], _GOLDEN, _MIX1, _MIX2,
            P=slots_per_bucket, BLOCK=BLOCK,
        )  # fmt: skip
    return row, cand


@triton.jit
def _free_counts_kernel(SLOT_ROW, CAND, NFREE, m, P: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    j = tl.arange(0, P).to(tl.int64)
    for c in tl.static_range(2):
        b = tl.load(CAND + 2 * i + c, mask=live, other=0)
        sr = tl.load(SLOT_ROW + b[:, None] * P + j[None, :], mask=live[:, None], other=0)
        tl.store(NFREE + 2 * i + c, tl.sum((sr < 0).to(tl.int64), 1), mask=live)


@triton.jit
def _pick_free_kernel(SLOT_ROW, BUCKET, Q, ACTIVE, SLOT, m, P: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    act = tl.load(ACTIVE + i, mask=live, other=0) != 0
    b = tl.load(BUCKET + i, mask=live, other=0)
    q = tl.load(Q + i, mask=live, other=0)
    j = tl.arange(0, P).to(tl.int64)
    free = tl.load(SLOT_ROW + b[:, None] * P + j[None, :], mask=(live & act)[:, None], other=0) < 0
    rank = tl.cumsum(free.to(tl.int64), 1)  # free slots so far, slot order
    at = tl.min(tl.where(free & (rank == q[:, None] + 1), j[None, :], P), 1)
    tl.store(SLOT + i, tl.where(act & (at < P), b * P + at, -1), mask=live)


def free_counts_(slot_row: torch.Tensor, cand: torch.Tensor, slots_per_bucket: int) -> torch.Tensor:
    """`[m, 2]` int64: the free slots (row -1) of both candidate buckets `cand` (int64 `[m, 2]`) of every key."""
    m = cand.shape[0]
    out = torch.empty(m, 2, dtype=torch.int64, device=cand.device)
    if m:
        _free_counts_kernel[(triton.cdiv(m, BLOCK),)](slot_row, cand, out, m, P=slots_per_bucket, BLOCK=BLOCK)
    return out


def pick_free_(
    slot_row: torch.Tensor, bucket: torch.Tensor, q: torch.Tensor, active: torch.Tensor, slots_per_bucket: int
) -> torch.Tensor:
    """`[m]` int64: for every active key, the (q+1)-th free slot of its bucket (slot order), else -1 (bucket full,
    or inactive). `bucket`, `q` int64 `[m]`, `active` bool `[m]`."""
    m = bucket.numel()
    out = torch.empty(m, dtype=torch.int64, device=bucket.device)
    if m:
        _pick_free_kernel[(triton.cdiv(m, BLOCK),)](
            slot_row, bucket, q, active, out, m, P=slots_per_bucket, BLOCK=BLOCK
        )
    return out


@triton.jit
def _segment_of(WB, w, live, T, LOGT: tl.constexpr):
    """The segment s of window position w: the last s in 0..T with wb[s] <= w (a binary search of `[T + 1]`)."""
    lo = tl.zeros_like(w)
    hi = tl.zeros_like(w) + T + 1
    for _ in tl.static_range(LOGT):
        go = lo < hi
        mid = (lo + hi) // 2
        le = tl.load(WB + mid, mask=live & go, other=0) <= w
        lo = tl.where(go & le, mid + 1, lo)
        hi = tl.where(go & ~le, mid, hi)
    return lo - 1


REORDER_BLOCK = 1024
"""Positions of the LRU order per program of `reorder_`."""


@triton.jit
def _used_kernel(ORDER, ROW_LAST, ROW_USED, USED, COUNTS, n, CLOCK, MARKED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    o = tl.load(ORDER + i, mask=live, other=0)
    if MARKED:  # a byte per row (in cache), not the row's last use
        used = (tl.load(ROW_USED + o, mask=live, other=0) != 0) & live
    else:
        used = (tl.load(ROW_LAST + o, mask=live, other=-1) == tl.load(CLOCK)) & live
    tl.store(USED + i, used.to(tl.int8), mask=live)
    tl.store(COUNTS + tl.program_id(0), tl.sum(used.to(tl.int64), 0))


@triton.jit
def _reorder_kernel(ORDER, USED, ROW_USED, PREFIX, BEFORE, BOUNDS, OUT, n, T, MARKED: tl.constexpr,
                    LOGT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    u = tl.load(USED + i, mask=live, other=0).to(tl.int64)
    cu = tl.cumsum(u, 0) + tl.load(PREFIX + tl.program_id(0))  # used positions up to i (inclusive)
    s = _segment_of(BOUNDS, i, live, T, LOGT)
    before = tl.load(BEFORE + s, mask=live, other=0)  # used positions before the segment
    end = tl.load(BOUNDS + s + 1, mask=live, other=0) - tl.load(BEFORE + s + 1, mask=live, other=0)
    pos = tl.where(u != 0, end + cu - 1, i - cu + before)
    o = tl.load(ORDER + i, mask=live, other=0)
    tl.store(OUT + pos, o, mask=live)
    if MARKED:
        tl.store(ROW_USED + o, tl.zeros([BLOCK], tl.int8), mask=live & (u != 0))


def reorder_(
    order: torch.Tensor,
    row_last: torch.Tensor,
    bounds: torch.Tensor,
    clock: torch.Tensor,
    row_used: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new LRU order (int64 `[n]`, written into `out` where given, else a new tensor): within each segment
    (`bounds` int64 `[T + 1]`: their first positions and n) the rows of `order` whose `row_last` is the map's clock
    (`clock` int64 `[1]` on the device; `row_used`: whose mark is set; the marks are cleared) move to the segment's
    end, both parts keeping their order. A row used at position i of segment s goes to
    bounds[s + 1] - used(segments <= s) + used(positions <= i) - 1, an unused one to i - used(positions <= i) +
    used(segments < s)."""
    n = order.numel()
    dev = order.device
    blocks = triton.cdiv(n, REORDER_BLOCK)
    used = torch.empty(n, dtype=torch.int8, device=dev)
    counts = torch.zeros(blocks + 1, dtype=torch.int64, device=dev)  # counts[k + 1]: used positions of block k
    out = torch.empty_like(order) if out is None else out
    if n == 0:
        return out
    marked = row_used is not None
    mark = row_used if marked else used
    _used_kernel[(blocks,)](order, row_last, mark, used, counts[1:], n, clock, MARKED=marked, BLOCK=REORDER_BLOCK)
    prefix = torch.cumsum(counts, 0)  # used positions before each block (and in all)
    blk = torch.div(bounds, REORDER_BLOCK, rounding_mode="floor")
    at = (blk * REORDER_BLOCK).unsqueeze(1) + torch.arange(REORDER_BLOCK, device=dev)  # [T + 1, BLOCK]
    inside = at < bounds.unsqueeze(1)  # the block's positions before the bound
    part = torch.where(inside, used[at.clamp_(max=n - 1)], 0).sum(1)
    before = prefix[blk] + part  # used positions before each segment (and in all)
    T = bounds.numel() - 1
    _reorder_kernel[(blocks,)](
        order, used, mark, prefix, before, bounds, out, n, T, MARKED=marked, LOGT=(T + 1).bit_length() + 1,
        BLOCK=REORDER_BLOCK,
    )  # fmt: skip
    return out
