"""An `IdMap` training step on its Triton kernels (embshard/kernels/_step_triton.py): `IdMap._train`'s results
(rows, reset list, the map's new state) with per-step work that follows the step's ids, not the map's rows, and
~25 launches.

No sort of the ids: one kernel probes every id in the index, writes the hits' rows and marks and counts their rows
used; the misses (a device count) find their unique (shard, id) pairs through a claim table (their first
positions and uses) and a cumsum over batch positions ranks the new ids. Everything that places new ids (the LRU
window's victims, eviction, the index inserts without a sort, the rows' new state and the statistics) and writes
their rows, the reset list and a compact list of the positions given a row (`Resets.listed`, which the reset
kernels walk instead of the whole list) reads the admitted count on the device and returns at once when it is 0.
Left as they are: the LRU order's partition (two passes over the order), LFU's sort of the rows, and admission
counting's sketch (torch ops).

The kernels read the map's clock from the device (`IdMap.clock_t`) and, in a padded step (`padded`, the graphed
step's: embshard/rawids/graph.py), every count from the device: ids padded to a fixed N (`pad_ids`) give the same
rows, reset list and state as the step's ids alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from embshard.rawids.index import _SALTS, P

if TYPE_CHECKING:
    from embshard.rawids.state import MapState


def train_triton(
    m: MapState, ids: torch.Tensor, shard_of: torch.Tensor, bounds: torch.Tensor, wb: torch.Tensor, W: int,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`IdMap._train` on the Triton kernels at the map's device clock `m.clock_t` (left as it is): (local rows, the
    reset list, (positions given a row `[N]`, how many `[1]`: the first entries, in no particular order)).

    `padded`: `ids` `[N]` hold the step's n = bounds[T] ids (a device value) at positions 0..n-1 and pads past them
    (`pad_ids`: the key INT64_MAX, shard T), which are never looked up, admitted or counted; their rows are 0 and
    their reset entries -1. W: the LRU window's bound (a padded step's: min(N, usable rows), the window proper ends
    at wb[T] on the device)."""
    from embshard.kernels._step_triton import BLOCK, CLEAR_BLOCK, step_kernels

    k = step_kernels()
    n = ids.numel()  # N when padded
    if n >= 2**31 - 1:
        raise ValueError(f"train_triton: {n} ids; a step's batch positions must fit in 31 bits")
    dev, clock, i64, i32, T = ids.device, m.clock_t, torch.int64, torch.int32, m.T
    grid = (triton.cdiv(n, BLOCK),)
    # every id probed straight from the index: hits take their rows and mark their rows used; misses are listed
    rows, given, rep = (torch.empty(n, dtype=i64, device=dev) for _ in range(3))
    cand, n_miss = torch.empty(n, 2, dtype=i64, device=dev), torch.zeros(1, dtype=i64, device=dev)
    k["probe"][grid](
        ids, shard_of, bounds, m.bucket_tab, m.row_tab, m.slot_key, m.slot_row, m.row_last, m.row_freq, m.row_used,
        rows, given, rep, cand, n_miss, n, T, clock, _SALTS[0], _SALTS[1], k["golden"], k["mix1"], k["mix2"],
        MARK=m.lru, P=P, BLOCK=BLOCK,
    )  # fmt: skip
    # the misses' unique (shard, id) pairs: each claims an entry of a table of 2n (linear probing), whose smallest
    # position is the pair's first (its representative) and whose count its uses (nothing runs without misses)
    H = 2 * n
    claim = torch.empty(3, H, dtype=i32, device=dev)  # per entry: owner, smallest position, count
    hslot, u_cnt = torch.empty(n, dtype=i32, device=dev), torch.empty(n, dtype=i64, device=dev)
    flag = torch.zeros(n, dtype=i64, device=dev)  # at each pair's first position: 1 if admitted
    k["clear"][(triton.cdiv(H, CLEAR_BLOCK),)](claim[0], claim[1], claim[2], n_miss, H, BLOCK=CLEAR_BLOCK)
    k["claim"][grid](ids, shard_of, rep, cand, n_miss, claim[0], claim[1], claim[2], hslot, n, H, BLOCK=BLOCK)
    k["rep"][grid](rep, hslot, claim[1], claim[2], u_cnt, flag, n_miss, n, WRITE_FLAG=not m.sketching, BLOCK=BLOCK)
    if m.sketching:  # admission counting: the torch path's sketch over the misses' first positions
        pos = torch.arange(n, device=dev)
        new = rep == pos
        key, shard = torch.where(new, ids, 0), torch.where(new, shard_of, 0)
        admit = m._admitted(key, shard, torch.where(new, u_cnt, 0), new, pos, bounds)
        flag = admit.to(i64)
    cs = torch.cumsum(flag, 0)  # admitted ids up to each batch position; its last element: all of them
    total = cs[-1:]
    victims, vbase, n_ev = m._victims(max(m.clock - 1, 0), wb, W, total)
    new_row, slot = torch.empty(n, dtype=i64, device=dev), torch.empty(n, dtype=i64, device=dev)
    ok = torch.empty(n, dtype=torch.int8, device=dev)  # bit 0: given a row, 1: it held an id, 2: placed in round 2
    k["assign"][grid](
        shard_of, flag, cs, bounds, n_ev, vbase, victims, m.row_last, m.row_slot, m.slot_row, new_row, ok, n, T, m.R,
        BLOCK=BLOCK,
    )  # fmt: skip
    # the index inserts: round 1 into the emptier bucket, round 2 into the other (list heads of generations 2 x
    # clock + 1 and + 2, read from the device clock)
    head, nxt, bk = m.list_head, torch.empty(n, dtype=i64, device=dev), torch.empty(n, 2, dtype=i64, device=dev)
    k["link"][grid](m.slot_row, cand, ok, cs, head, nxt, bk, n, clock, P=P, BLOCK=BLOCK)
    k["pick"][grid](ids, m.slot_row, ok, cs, head, nxt, bk, slot, n, clock, ROUND=0, P=P, BLOCK=BLOCK)
    k["place"][grid](ids, new_row, ok, cs, head, nxt, bk, slot, m.slot_key, m.slot_row, n, clock, BLOCK=BLOCK)
    k["pick"][grid](ids, m.slot_row, ok, cs, head, nxt, bk, slot, n, clock, ROUND=1, P=P, BLOCK=BLOCK)
    k["finish"][grid](
        ids, shard_of, u_cnt, new_row, ok, slot, cs, m.slot_key, m.slot_row, m.row_key, m.row_last, m.row_freq,
        m.row_slot, m.row_used, m.evicted, m.admitted, n, T, clock, MARK=m.lru, TP=triton.next_power_of_2(T),
        BLOCK=BLOCK,
    )  # fmt: skip
    listed, count = torch.empty(n, dtype=i64, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    k["out"][grid](shard_of, rep, cs, ok, new_row, slot, m.row_tab, rows, given, listed, count, n, BLOCK=BLOCK)
    return rows, given, (listed, count)


INT64_MAX = (1 << 63) - 1
"""A pad's key (shard T; the kernels leave out every position from bounds[T] on, whatever its key)."""


def pad_ids(ids: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded step's inputs from `ids` `[N]` whose first bounds[T] are the step's ids (shard after shard; the rest
    anything): (the ids with INT64_MAX at the pads, the shard of every position: T at the pads)."""
    pos = torch.arange(ids.numel(), device=ids.device)
    shard_of = torch.searchsorted(bounds[1:], pos, right=True)
    return torch.where(pos < bounds[-1], ids, INT64_MAX), shard_of
