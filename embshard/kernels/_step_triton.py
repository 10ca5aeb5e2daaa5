"""The Triton kernels of an `IdMap` training step on CUDA (embshard/rawids/step.py drives them), with the torch
path's results (IdMap._train, index.py, eviction.py), without sorting the ids.

Every kernel takes BLOCK batch positions per program. `_probe_kernel` reads every id's first candidate bucket
straight from the index (the second only in programs holding a miss) and, for a hit, writes its row, the row's last
use (the same clock from every copy of an id), its mark for the LRU order and its use count (one atomic add per
copy: an id's copies alone share the address); a miss gets the zero row for now, and its position, candidate
buckets and the step's miss count (a device scalar) are recorded. Pads (positions from n = bounds[T] on, key
INT64_MAX and shard T in a padded step) are never looked up, admitted or counted: row 0, reset entry -1.

The misses' unique (shard, id) pairs come from a claim table of 2n entries (owner, smallest position, count; int32),
cleared only in a step with misses: each miss hashes its two buckets to an entry, claims it with a compare-and-swap
where free (a plain read first: an entry's owner never changes within the step) or moves to the next while it
holds another pair (linear probing), then takes the entry's minimum position and adds one use. The pair's
representative is its first batch position (the torch path's `u_pos`), which carries its state from then on
(uses, new row, slot, list links): the miss path runs over batch positions and acts at the positions flagged
admitted. With no miss, the claim kernels return at once; every kernel after the admitted ids' cumsum (the LRU
window's victims, eviction, the index inserts, the rows' new state, the misses' rows) reads the admitted count on
the device and returns at once when it is 0: a step whose ids are all resident costs the probe and a cumsum. The
map's clock is read from the device (`CLOCK`, int64 `[1]`), never passed as a value, so a captured graph replays
any step.

Inserts rank the ids wanting one bucket without a sort: every active id pushes its position on its bucket's list
(`atomic_xchg` of a list head; ids of one bucket only meet there, at most a few under the hash), then walks the
list counting the ids of smaller key (a bucket's ids are of one shard, each once): its rank q, that of the torch
path's stable sort of the unique ids. A head holds (generation << 32 | position), the generation 2 x clock + round,
so heads of earlier rounds read as empty and are never cleared. The rows given to new ids are listed for the reset
(per program one atomic reservation of its entries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.kernels._idmap_triton import _probe, _segment_of, candidate_buckets
from embshard.lookup.shards import _GOLDEN, _MIX1, _MIX2

BLOCK = 128
"""Entries (batch positions or window positions) per program."""
CLEAR_BLOCK = 1024
"""Entries of the misses' claim table per program of its clearing."""


@triton.jit
def _probe_kernel(
    IDS, SHARD, BOUNDS, BTAB, ROW_TAB, SLOT_KEY, SLOT_ROW, ROW_LAST, ROW_FREQ, ROW_USED, ROWS, GIVEN, REP, CAND,
    NMISS, n, T, CLOCK, salt0, salt1, golden, mix1, mix2, MARK: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    live = inside & (i < tl.load(BOUNDS + T))  # positions past the real ids: a padded step's pads
    key, s, c0, c1 = candidate_buckets(IDS, SHARD, BTAB, i, live, salt0, salt1, golden, mix1, mix2)
    j = tl.arange(0, P).to(tl.int64)
    row = _probe(SLOT_KEY, SLOT_ROW, c0, j, key, live, P)
    again = live & (row < 0)
    if tl.max(again.to(tl.int32), 0) > 0:  # the second bucket only for ids not in the first: none, mostly
        row = tl.maximum(row, _probe(SLOT_KEY, SLOT_ROW, c1, j, key, again, P))
    hit = live & (row >= 0)
    miss = live & (row < 0)
    tl.store(ROW_LAST + row, tl.zeros_like(row) + tl.load(CLOCK), mask=hit)  # the same clock from every copy
    tl.atomic_add(ROW_FREQ + row, tl.full([BLOCK], 1, tl.int64), mask=hit, sem="relaxed")  # an id's copies: one each
    if MARK:  # used now: the LRU order's partition reads (and clears) the mark
        tl.store(ROW_USED + row, tl.full([BLOCK], 1, tl.int8), mask=hit)
    r0 = tl.load(ROW_TAB + 2 * s, mask=live, other=0)
    final = tl.where(hit, row, tl.load(ROW_TAB + 2 * s + 1, mask=live, other=0))  # a miss: the zero row, for now
    tl.store(ROWS + i, tl.where(live, final - r0, 0), mask=inside)  # pads: row 0
    tl.store(GIVEN + i, tl.full([BLOCK], -1, tl.int64), mask=inside)
    tl.store(REP + i, tl.where(miss, i, -1), mask=inside)
    tl.store(CAND + 2 * i, c0, mask=miss)
    tl.store(CAND + 2 * i + 1, c1, mask=miss)
    k = tl.sum(miss.to(tl.int64), 0)
    if k > 0:
        tl.atomic_add(NMISS, k)


@triton.jit
def _claim_clear_kernel(OWN, MINP, CNT, NMISS, H, BLOCK: tl.constexpr):
    if tl.load(NMISS) > 0:
        h = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = h < H
        tl.store(OWN + h, tl.full([BLOCK], -1, tl.int32), mask=live)
        tl.store(MINP + h, tl.full([BLOCK], 2147483647, tl.int32), mask=live)
        tl.store(CNT + h, tl.zeros([BLOCK], tl.int32), mask=live)


@triton.jit
def _claim_kernel(IDS, SHARD, REP, CAND, NMISS, OWN, MINP, CNT, HSLOT, n, H, BLOCK: tl.constexpr):
    if tl.load(NMISS) > 0:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        act = inside & (tl.load(REP + i, mask=inside, other=-1) >= 0)
        if tl.max(act.to(tl.int32), 0) > 0:
            key = tl.load(IDS + i, mask=act, other=0)
            s = tl.load(SHARD + i, mask=act, other=0)
            h = (tl.load(CAND + 2 * i, mask=act, other=0) * 1000003 + tl.load(CAND + 2 * i + 1, mask=act, other=0)) % H
            me = i.to(tl.int32)
            slot = tl.zeros_like(i) - 1
            pending = act
            while tl.max(pending.to(tl.int32), 0) > 0:
                cur = tl.load(OWN + h, mask=pending, other=0)
                try_ = pending & (cur < 0)  # free: claim it (a compare-and-swap; others read it first)
                ptr = tl.where(try_, OWN + h, HSLOT + i)  # the rest swap their own entry with itself: no change
                old = tl.atomic_cas(ptr, tl.where(try_, -1, 0).to(tl.int32), tl.where(try_, me, 0))
                won = try_ & (old < 0)
                owner = tl.where(try_, old, cur).to(tl.int64)
                look = pending & ~won & (owner >= 0)
                okey = tl.load(IDS + owner, mask=look, other=0)
                osh = tl.load(SHARD + owner, mask=look, other=-1)
                mine = pending & (won | (look & (okey == key) & (osh == s)))
                slot = tl.where(mine, h, slot)
                pending = pending & ~mine
                h = tl.where(pending, (h + 1) % H, h)  # taken by another id: the next entry
            tl.atomic_min(MINP + slot, me, mask=act)
            tl.atomic_add(CNT + slot, tl.full([BLOCK], 1, tl.int32), mask=act, sem="relaxed")
            tl.store(HSLOT + i, slot.to(tl.int32), mask=act)


@triton.jit
def _rep_kernel(REP, HSLOT, MINP, CNT, UCNT, FLAG, NMISS, n, WRITE_FLAG: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(NMISS) > 0:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        act = inside & (tl.load(REP + i, mask=inside, other=-1) >= 0)
        if tl.max(act.to(tl.int32), 0) > 0:
            slot = tl.load(HSLOT + i, mask=act, other=0).to(tl.int64)
            rep = tl.load(MINP + slot, mask=act, other=0).to(tl.int64)
            tl.store(REP + i, rep, mask=act)
            at = act & (rep == i)
            tl.store(UCNT + i, tl.load(CNT + slot, mask=at, other=0).to(tl.int64), mask=at)
            if WRITE_FLAG:
                tl.store(FLAG + i, tl.full([BLOCK], 1, tl.int64), mask=at)


@triton.jit
def _window_kernel(
    ORDER, ROW_LAST, WB, OBASE, TOT, EV, ROWS, SEG, COUNTS, BSTART, W, T, CLOCK,
    LOGT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(TOT) > 0:
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = (w < W) & (w < tl.load(WB + T))  # positions past wb[T] (a padded step's capacity): absent
        last_before = tl.maximum(tl.load(CLOCK) - 1, 0)
        s = _segment_of(WB, w, live, T, LOGT)
        pos = w + tl.load(OBASE + s, mask=live, other=0) - tl.load(WB + s, mask=live, other=0)
        row = tl.load(ORDER + pos, mask=live, other=0)
        ev = live & (tl.load(ROW_LAST + row, mask=live, other=0) < last_before)
        e = ev.to(tl.int64)
        tl.store(EV + w, e.to(tl.int8), mask=live)
        tl.store(ROWS + w, row, mask=live)
        tl.store(SEG + w, s, mask=live)
        tl.store(COUNTS + pid + 1, tl.sum(e, 0))
        seg_start = live & (w == tl.load(WB + s, mask=live, other=-1))
        tl.store(BSTART + s, tl.cumsum(e, 0) - e, mask=seg_start)  # evictable before it in its block


@triton.jit
def _compact_kernel(EV, ROWS, SEG, WB, PREFIX, BSTART, TOT, OUT, NEV, W, T, BLOCK: tl.constexpr):
    if tl.load(TOT) > 0:
        pid = tl.program_id(0)
        w = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = (w < W) & (w < tl.load(WB + T))
        e = tl.load(EV + w, mask=live, other=0).to(tl.int64)
        s = tl.load(SEG + w, mask=live, other=0)
        b = tl.load(WB + s, mask=live, other=0)
        before = tl.load(PREFIX + b // BLOCK, mask=live, other=0) + tl.load(BSTART + s, mask=live, other=0)
        r = tl.cumsum(e, 0) + tl.load(PREFIX + pid) - before  # evictable of the segment up to w (inclusive)
        tl.store(OUT + b + r - 1, tl.load(ROWS + w, mask=live, other=0), mask=live & (e != 0))
        tl.store(NEV + s, r, mask=live & (w == tl.load(WB + s + 1, mask=live, other=0) - 1))


def lru_window_victims_(
    order: torch.Tensor, row_last: torch.Tensor, wb: torch.Tensor, ord_base: torch.Tensor, W: int,
    clock: torch.Tensor, total: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`EvictionOps._lru_victims` at the map's clock `clock` (int64 `[1]` on the device: rows last used before
    max(clock - 1, 0) are evictable) for a step that admits `total` ids (a device scalar): (`[W + 1]` per shard s at
    wb[s].. the evictable rows of its LRU window in order (entries past them unspecified), `[T]` how many). The
    window's positions are those below wb[T] (device) and W (host: wb[T] itself, or a padded step's fixed bound
    over it). Nothing runs but two small fills when `total` is 0 (then every count is 0)."""
    T = wb.numel() - 1
    dev = wb.device
    blocks = max(triton.cdiv(W, BLOCK), 1)
    counts = torch.zeros(blocks + 1, dtype=torch.int64, device=dev)
    nev = torch.zeros(T, dtype=torch.int64, device=dev)
    out = torch.empty(W + 1, dtype=torch.int64, device=dev)
    if W == 0:
        return out, nev
    ev = torch.empty(W, dtype=torch.int8, device=dev)
    rows = torch.empty(W, dtype=torch.int64, device=dev)
    seg = torch.empty(W, dtype=torch.int64, device=dev)
    bstart = torch.zeros(T, dtype=torch.int64, device=dev)
    logt = (T + 1).bit_length() + 1
    _window_kernel[(blocks,)](
        order, row_last, wb, ord_base, total, ev, rows, seg, counts, bstart, W, T, clock, LOGT=logt, BLOCK=BLOCK
    )
    prefix = torch.cumsum(counts, 0)
    _compact_kernel[(blocks,)](ev, rows, seg, wb, prefix, bstart, total, out, nev, W, T, BLOCK=BLOCK)
    return out, nev


@triton.jit
def _assign_kernel(
    SHARD, FLAG, CS, BOUNDS, NEV, VBASE, VICT, ROW_LAST, ROW_SLOT, SLOT_ROW, NEWROW, OK, n, T, R, BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(CS + n - 1) > 0:
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = p < n
        admit = inside & (tl.load(FLAG + p, mask=inside, other=0) != 0)
        s = tl.load(SHARD + p, mask=admit, other=0)
        b = tl.load(BOUNDS + s, mask=admit, other=0)
        before = tl.load(CS + b - 1, mask=admit & (b > 0), other=0)  # admitted before the shard
        rank = tl.load(CS + p, mask=admit, other=0) - 1 - before
        ok = admit & (rank < tl.load(NEV + s, mask=admit, other=0))
        row = tl.load(VICT + tl.load(VBASE + s, mask=ok, other=0) + rank, mask=ok, other=R)
        old = ok & (tl.load(ROW_LAST + row, mask=ok, other=-1) >= 0)
        slot = tl.load(ROW_SLOT + row, mask=old, other=-1).to(tl.int64)
        tl.store(SLOT_ROW + slot, tl.full([BLOCK], -1, SLOT_ROW.dtype.element_ty), mask=old & (slot >= 0))
        tl.store(NEWROW + p, tl.where(ok, row, R), mask=admit)
        tl.store(OK + p, (ok.to(tl.int8) | (old.to(tl.int8) << 1)), mask=inside)  # every position: 0 if not given


@triton.jit
def _push(HEAD, NXT, bucket, u, act, gen):
    """Push every active id u (a batch position) on its bucket's list: its next is the head's if of this
    generation, else -1."""
    old = tl.atomic_xchg(HEAD + bucket, gen + u, mask=act)
    nxt = tl.where(old - (old & 0x7FFFFFFF) == gen, old & 0x7FFFFFFF, -1)
    tl.store(NXT + u, nxt, mask=act)


@triton.jit
def _pick(IDS, HEAD, NXT, SLOT_ROW, bucket, key, act, gen, P: tl.constexpr):
    """The slot an active id takes in its bucket: the q-th free one (slot order), q the ids of its bucket's list
    with a smaller key (a bucket's ids are of one shard, each once); -1 when there are not enough."""
    h = tl.load(HEAD + bucket, mask=act, other=-1)
    cur = tl.where(act & (h - (h & 0x7FFFFFFF) == gen), h & 0x7FFFFFFF, -1)
    q = tl.zeros_like(key)
    while tl.max(cur, 0) >= 0:
        q += ((cur >= 0) & (tl.load(IDS + cur, mask=cur >= 0, other=0) < key)).to(tl.int64)
        cur = tl.load(NXT + cur, mask=cur >= 0, other=-1)
    j = tl.arange(0, P).to(tl.int64)
    free = tl.load(SLOT_ROW + bucket[:, None] * P + j[None, :], mask=act[:, None], other=0) < 0
    rank = tl.cumsum(free.to(tl.int64), 1)
    at = tl.min(tl.where(free & (rank == q[:, None] + 1), j[None, :], P), 1)
    return tl.where(act & (at < P), bucket * P + at, -1)


@triton.jit
def _generation(CLOCK, ROUND: tl.constexpr):
    """The list heads' generation of insert round ROUND (0, 1) at the map's clock: (2 x clock + 1 + ROUND) << 32."""
    return (2 * tl.load(CLOCK) + 1 + ROUND) << 32


@triton.jit
def _given(OK, n, BLOCK: tl.constexpr):
    """(this program's batch positions, which of them were given a row, whether any was)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    okb = tl.load(OK + p, mask=p < n, other=0)
    act = (p < n) & ((okb & 1) != 0)
    return p, okb, act, tl.max(act.to(tl.int32), 0) > 0


@triton.jit
def _link_kernel(SLOT_ROW, CAND, OK, CS, HEAD, NXT, BK, n, CLOCK, P: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(CS + n - 1) > 0:
        p, okb, act, some = _given(OK, n, BLOCK)
        if some:
            j = tl.arange(0, P).to(tl.int64)
            c0 = tl.load(CAND + 2 * p, mask=act, other=0)
            c1 = tl.load(CAND + 2 * p + 1, mask=act, other=0)
            f0 = tl.sum(
                (tl.load(SLOT_ROW + c0[:, None] * P + j[None, :], mask=act[:, None], other=0) < 0).to(tl.int32), 1
            )
            f1 = tl.sum(
                (tl.load(SLOT_ROW + c1[:, None] * P + j[None, :], mask=act[:, None], other=0) < 0).to(tl.int32), 1
            )
            swap = f1 > f0  # the emptier first, the first candidate on ties
            b1 = tl.where(swap, c1, c0)
            tl.store(BK + 2 * p, b1, mask=act)
            tl.store(BK + 2 * p + 1, tl.where(swap, c0, c1), mask=act)
            _push(HEAD, NXT, b1, p, act, _generation(CLOCK, 0))


@triton.jit
def _pick_kernel(IDS, SLOT_ROW, OK, CS, HEAD, NXT, BK, SLOT, n, CLOCK, ROUND: tl.constexpr, P: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    if tl.load(CS + n - 1) > 0:
        p, okb, act, some = _given(OK, n, BLOCK)
        if ROUND == 1:
            act = act & ((okb & 4) != 0)
        if some:
            bucket = tl.load(BK + 2 * p + ROUND, mask=act, other=0)
            key = tl.load(IDS + p, mask=act, other=0)
            gen = _generation(CLOCK, ROUND)
            tl.store(SLOT + p, _pick(IDS, HEAD, NXT, SLOT_ROW, bucket, key, act, gen, P), mask=act)


@triton.jit
def _place_kernel(IDS, NEWROW, OK, CS, HEAD, NXT, BK, SLOT, SLOT_KEY, SLOT_ROW, n, CLOCK, BLOCK: tl.constexpr):
    """Round 1's ids into their slots; ids that found none go on their other bucket's list (round 2)."""
    if tl.load(CS + n - 1) > 0:
        p, okb, act, some = _given(OK, n, BLOCK)
        if some:
            slot = tl.load(SLOT + p, mask=act, other=-1)
            put = act & (slot >= 0)
            tl.store(SLOT_KEY + slot, tl.load(IDS + p, mask=put, other=0), mask=put)
            row = tl.load(NEWROW + p, mask=put, other=0)
            tl.store(SLOT_ROW + slot, row.to(SLOT_ROW.dtype.element_ty), mask=put)
            retry = act & (slot < 0)
            tl.store(OK + p, okb | 4, mask=retry)
            _push(HEAD, NXT, tl.load(BK + 2 * p + 1, mask=retry, other=0), p, retry, _generation(CLOCK, 1))


@triton.jit
def _finish_kernel(
    IDS, SHARD, UCNT, NEWROW, OK, SLOT, CS, SLOT_KEY, SLOT_ROW, ROW_KEY, ROW_LAST, ROW_FREQ, ROW_SLOT, ROW_USED,
    EVICTED, ADMITTED, n, T, CLOCK, MARK: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.load(CS + n - 1) > 0:
        p, okb, ok, some = _given(OK, n, BLOCK)
        if some:
            slot = tl.load(SLOT + p, mask=ok, other=-1)
            row = tl.load(NEWROW + p, mask=ok, other=0)
            key = tl.load(IDS + p, mask=ok, other=0)
            ins = ok & (slot >= 0)
            put2 = ins & ((okb & 4) != 0)  # placed in round 2
            tl.store(SLOT_KEY + slot, key, mask=put2)
            tl.store(SLOT_ROW + slot, row.to(SLOT_ROW.dtype.element_ty), mask=put2)
            tl.store(ROW_KEY + row, key, mask=ok)
            tl.store(ROW_LAST + row, tl.where(ins, tl.load(CLOCK), -1), mask=ok)
            tl.store(ROW_FREQ + row, tl.where(ins, tl.load(UCNT + p, mask=ok, other=0), 0), mask=ok)
            tl.store(ROW_SLOT + row, slot.to(ROW_SLOT.dtype.element_ty), mask=ok)
            if MARK:
                tl.store(ROW_USED + row, tl.full([BLOCK], 1, tl.int8), mask=ins)
            # per shard: evicted (old rows) and admitted (inserted) ids, summed in the block, then one add each
            s = tl.load(SHARD + p, mask=ok, other=-1)
            t = tl.arange(0, TP)
            at = s[:, None] == t[None, :]
            ev = tl.sum(tl.where(at & ((okb & 2) != 0)[:, None], 1, 0), 0).to(tl.int64)
            ad = tl.sum(tl.where(at & ins[:, None], 1, 0), 0).to(tl.int64)
            tl.atomic_add(EVICTED + t, ev, mask=(t < T) & (ev != 0))
            tl.atomic_add(ADMITTED + t, ad, mask=(t < T) & (ad != 0))


@triton.jit
def _out_kernel(SHARD, REP, CS, OK, NEWROW, SLOT, ROW_TAB, ROWS, GIVEN, LIST, LCOUNT, n, BLOCK: tl.constexpr):
    if tl.load(CS + n - 1) > 0:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        rep = tl.load(REP + i, mask=inside, other=-1)  # a miss's first position (the probe wrote the rest)
        miss = inside & (rep >= 0)
        if tl.max(miss.to(tl.int32), 0) > 0:
            ok = miss & ((tl.load(OK + rep, mask=miss, other=0) & 1) != 0)
            nr = tl.load(NEWROW + rep, mask=ok, other=0)
            ins = ok & (tl.load(SLOT + rep, mask=ok, other=-1) >= 0)
            r0 = tl.load(ROW_TAB + 2 * tl.load(SHARD + i, mask=ok, other=0), mask=ok, other=0)
            tl.store(ROWS + i, nr - r0, mask=ins)
            given = ok & (rep == i)
            tl.store(GIVEN + i, nr - r0, mask=given)
            k = tl.sum(given.to(tl.int32), 0)
            if k > 0:  # list the positions given a row (one reservation per program; order is free)
                base = tl.atomic_add(LCOUNT, k)
                at = base + tl.cumsum(given.to(tl.int32), 0) - 1
                tl.store(LIST + at, i, mask=given)


def step_kernels() -> dict:
    """The kernels and constants (for embshard/rawids/step.py)."""
    return {
        "probe": _probe_kernel, "clear": _claim_clear_kernel, "claim": _claim_kernel, "rep": _rep_kernel,
        "assign": _assign_kernel, "link": _link_kernel, "pick": _pick_kernel, "place": _place_kernel,
        "finish": _finish_kernel, "out": _out_kernel, "golden": _GOLDEN, "mix1": _MIX1, "mix2": _MIX2,
    }  # fmt: skip
