"""An `IdMap` training step on its Triton kernels (embshard/kernels/_step_triton.py): `IdMap._train`'s results
(rows, reset list, the map's new state) with per-step work that follows the step's ids, not the map's rows, and
~30 launches.

After torch's stable sort of the ids: run starts and one cumsum give the unique ids (slots below a device count);
one kernel looks them up and marks the hits used; a cumsum over batch positions ranks the new ids. Everything that
places new ids (the LRU window's victims, eviction, the index inserts without a sort, the rows' new state and the
statistics) reads the admitted count on the device and returns at once when it is 0. The last kernel writes every
id's row, the reset list and a compact list of the positions given a row (`Resets.listed`), which the reset
kernels walk instead of the whole list. Left as they are: the LRU order's partition (two passes over the order),
LFU's sort of the rows, and admission counting's sketch (torch ops).

The kernels read the map's clock from the device (`IdMap.clock_t`) and, in a padded step (`padded`, the graphed
step's: embshard/rawids/graph.py), every count from the device: ids padded to a fixed N (`pad_ids`) give the same
rows, reset list and state as the step's ids alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from embshard.rawids.eviction import bounded_prefix
from embshard.rawids.index import _SALTS, P

if TYPE_CHECKING:
    from embshard.rawids.idmap import IdMap


def train_triton(
    m: IdMap, ids: torch.Tensor, shard_of: torch.Tensor, bounds: torch.Tensor, wb: torch.Tensor, W: int,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`IdMap._train` on the Triton kernels at the map's device clock `m.clock_t` (left as it is): (local rows, the
    reset list, (positions given a row `[N]`, how many `[1]`: the first entries, in no particular order)).

    `padded`: `ids` `[N]` hold the step's n = bounds[T] ids (a device value) at positions 0..n-1 and pads past them
    (`pad_ids`: the key INT64_MAX, shard T), which are never looked up, admitted or counted; their rows are 0 and
    their reset entries -1. W: the LRU window's bound (a padded step's: min(N, usable rows), the window proper ends
    at wb[T] on the device)."""
    from embshard.kernels._step_triton import BLOCK, step_kernels

    k = step_kernels()
    n = ids.numel()  # N when padded
    dev, clock, i64, T = ids.device, m.clock_t, torch.int64, m.T
    grid = (triton.cdiv(n, BLOCK),)
    sid, perm = torch.sort(ids, stable=True)
    first = torch.empty(n, dtype=torch.int8, device=dev)
    k["runs"][grid](sid, perm, shard_of, first, n, MULTI=T > 1 or padded, BLOCK=BLOCK)  # pads: their own run
    csu = torch.cumsum(first, 0)  # the run of each sorted position + 1; at position n_real - 1: the unique ids
    u_key, u_shard, u_pos = (torch.empty(n, dtype=i64, device=dev) for _ in range(3))
    run0 = torch.empty(n + 1, dtype=i64, device=dev)
    k["uniq"][grid](sid, perm, shard_of, first, csu, u_key, u_shard, u_pos, run0, n, BLOCK=BLOCK)
    row_u, u_cnt = torch.empty(n, dtype=i64, device=dev), torch.empty(n, dtype=i64, device=dev)
    cand = torch.empty(n, 2, dtype=i64, device=dev)
    flag = torch.zeros(n, dtype=i64, device=dev)
    k["find"][grid](
        u_key, u_shard, run0, csu, bounds, u_pos, m.bucket_tab, m.slot_key, m.slot_row, m.row_last, m.row_freq,
        m.row_used, row_u, cand, u_cnt, flag, T, clock, _SALTS[0], _SALTS[1], k["golden"], k["mix1"], k["mix2"],
        WRITE_FLAG=not m.sketching, MARK=m.lru, P=P, BLOCK=BLOCK,
    )  # fmt: skip
    if m.sketching:  # admission counting: the torch path's sketch over the valid unique ids
        valid = torch.arange(n, device=dev) < bounded_prefix(csu, bounds[T:])
        new = valid & (row_u < 0)
        key, shard = torch.where(valid, u_key, 0), torch.where(valid, u_shard, 0)
        pos = torch.where(valid, u_pos, n)
        admit = m._admitted(key, shard, torch.where(valid, u_cnt, 0), new, pos, bounds)
        flag = torch.zeros(n + 1, dtype=i64, device=dev).index_fill_(0, torch.where(admit, pos, n), 1)[:n]
    cs = torch.cumsum(flag, 0)  # admitted ids up to each batch position; its last element: all of them
    total = cs[-1:]
    victims, vbase, n_ev = m._victims(max(m.clock - 1, 0), wb, W, total)
    new_row, slot = torch.empty(n, dtype=i64, device=dev), torch.empty(n, dtype=i64, device=dev)
    ok = torch.empty(n, dtype=torch.int8, device=dev)  # bit 0: given a row, 1: it held an id, 2: placed in round 2
    k["assign"][grid](
        u_pos, u_shard, flag, cs, csu, bounds, n_ev, vbase, victims, m.row_last, m.row_slot, m.slot_row, new_row, ok,
        n, T, m.R, BLOCK=BLOCK,
    )  # fmt: skip
    # the index inserts: round 1 into the emptier bucket, round 2 into the other (list heads of generations 2 x
    # clock + 1 and + 2, read from the device clock)
    head, nxt, bk = m.list_head, torch.empty(n, dtype=i64, device=dev), torch.empty(n, 2, dtype=i64, device=dev)
    k["link"][grid](m.slot_row, cand, ok, csu, cs, bounds, head, nxt, bk, n, T, clock, P=P, BLOCK=BLOCK)
    k["pick"][grid](m.slot_row, ok, csu, cs, bounds, head, nxt, bk, slot, n, T, clock, ROUND=0, P=P, BLOCK=BLOCK)
    k["place"][grid](
        u_key, new_row, ok, csu, cs, bounds, head, nxt, bk, slot, m.slot_key, m.slot_row, n, T, clock, BLOCK=BLOCK
    )
    k["pick"][grid](m.slot_row, ok, csu, cs, bounds, head, nxt, bk, slot, n, T, clock, ROUND=1, P=P, BLOCK=BLOCK)
    k["finish"][grid](
        u_key, u_shard, u_cnt, new_row, ok, slot, csu, cs, bounds, m.slot_key, m.slot_row, m.row_key, m.row_last,
        m.row_freq, m.row_slot, m.row_used, m.evicted, m.admitted, n, T, clock, MARK=m.lru,
        TP=triton.next_power_of_2(T), BLOCK=BLOCK,
    )  # fmt: skip
    rows, given = torch.empty(n, dtype=i64, device=dev), torch.empty(n, dtype=i64, device=dev)
    listed, count = torch.empty(n, dtype=i64, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    k["out"][grid](
        perm, shard_of, first, csu, cs, bounds, row_u, ok, new_row, slot, m.row_tab, rows, given, listed, count, n, T,
        BLOCK=BLOCK,
    )  # fmt: skip
    return rows, given, (listed, count)


INT64_MAX = (1 << 63) - 1
"""A pad's key: after the stable sort the pads (shard T) follow every real id, an id INT64_MAX's run included."""


def pad_ids(ids: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded step's inputs from `ids` `[N]` whose first bounds[T] are the step's ids (shard after shard; the rest
    anything): (the ids with INT64_MAX at the pads, the shard of every position: T at the pads)."""
    pos = torch.arange(ids.numel(), device=ids.device)
    shard_of = torch.searchsorted(bounds[1:], pos, right=True)
    return torch.where(pos < bounds[-1], ids, INT64_MAX), shard_of
