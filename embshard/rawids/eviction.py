"""Eviction and admission of an `IdMap` (idmap.py): which rows the new ids of a step take (LRU: from a bounded
window at the front of each shard's order; LFU: a sort of the rows), the LRU order's update, and the admission
sketch (the design: embshard/rawids/__init__.py).
"""

from __future__ import annotations

import torch

from embshard.lookup.shards import _GOLDEN, _mix_
from embshard.spec.id_map import SKETCH_DEPTH

SKETCH_DECAY = 10
"""A shard's sketch is halved once it has counted this many times its width (recent counts weigh more)."""
_FREQ_CAP = (1 << 30) - 1
_LAST_CAP = (1 << 32) - 1
_MAX = (1 << 63) - 1


def bounded_prefix(cs: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The exclusive prefix of the inclusive cumsum `cs` at each of `bounds` (0 at 0): sums before each bound."""
    return torch.where(bounds > 0, cs[(bounds - 1).clamp(min=0)], 0)


class EvictionOps:
    """Victims, the LRU order and the sketch, mixed into `IdMap` (which holds the buffers)."""

    T: int
    Ord: int
    lru: bool
    lfu: bool
    clock_t: torch.Tensor

    def _victims(
        self, last_before: int, wb: torch.Tensor, W: int, total: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(victims, base, count): per shard s its evictable rows in eviction order at `victims[base[s] + k]`,
        k < count[s] (int64 `[T]`). A row is evictable if last used before step `last_before` (holding no id:
        last use -1). LRU shards: only the first min(ids of s, usable rows of s) positions of s's order are read
        (the window, `wb`: its start per shard and the end, W in all), which hold every victim the step can take
        (package docstring); LFU shards: every row, sorted. `total` (a device scalar: the ids the step admits): the
        LRU window is read on the Triton kernels at the device clock (`clock_t`, where `last_before` is max(clock -
        1, 0) too), not at all when it is 0 (entries past the victims unspecified); W may then exceed wb[T] (a padded
        step's fixed bound: positions past wb[T] are left out)."""
        lru_v = lfu_v = None
        if self.lru and total is not None:
            from embshard.kernels._step_triton import lru_window_victims_

            lru_v, lru_n = lru_window_victims_(self.order, self.row_last, wb, self.ord_base, W, self.clock_t, total)
        elif self.lru:
            lru_v, lru_n = self._lru_victims(last_before, wb, W)
        if self.lfu:
            lfu_v, lfu_n = self._lfu_victims(last_before)
        if lfu_v is None:
            return lru_v, wb[:-1], lru_n
        if lru_v is None:
            return lfu_v, self.ord_base, lfu_n
        base = torch.where(self.is_lfu, self.ord_base + W + 1, wb[:-1])
        return torch.cat([lru_v, lfu_v]), base, torch.where(self.is_lfu, lfu_n, lru_n)

    def _lru_victims(self, last_before: int, wb: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """LRU: (`[W + 1]` per shard s at wb[s].. the evictable rows of its window, in order, then -1; `[T]` how
        many)."""
        ar = torch.arange(W, device=wb.device)
        if self.T == 1:
            seg, pos = None, ar
        else:
            seg = torch.searchsorted(wb[1:], ar, right=True)
            pos = ar + (self.ord_base - wb[:-1])[seg]
        rows = self.order[pos]
        ev = self.row_last[rows] < last_before
        cs = torch.cumsum(ev, 0)
        before = bounded_prefix(cs, wb)  # evictable rows before each window segment (and in all)
        shift = wb[:-1] - before[:-1] - 1
        target = torch.where(ev, cs + (shift if seg is None else shift[seg]), W)
        out = torch.full((W + 1,), -1, dtype=torch.int64, device=wb.device).scatter_(0, target, rows)
        return out, before[1:] - before[:-1]

    def _lfu_victims(self, last_before: int) -> tuple[torch.Tensor, torch.Tensor]:
        """LFU: (`[Ord + 1]` per shard segment its evictable rows sorted by (uses, last use, row), then -1; `[T]`
        how many). A sort of the group's rows."""
        u = self._usable_rows()
        last = self.row_last[u]
        ev = last < last_before
        key = self.row_freq[u].clamp(max=_FREQ_CAP) * (1 << 32) + (last + 1).clamp(max=_LAST_CAP)
        idx = torch.sort(torch.where(ev, key, _MAX), stable=True).indices
        if self.T > 1:
            idx = idx[torch.sort(self.seg[idx], stable=True).indices]
        return self._compact(u[idx], ev[idx])

    def _usable_rows(self) -> torch.Tensor:
        """`[Ord]` the usable rows of every shard, shard after shard (each shard's zero row left out: position i of
        segment s is row i + s of the group)."""
        return torch.arange(self.Ord, device=self.seg.device) + self.seg

    def _compact(self, rows: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per segment of the usable rows, the kept entries of `rows` moved to the segment's front in order (the
        rest -1), and their count per segment."""
        cs = torch.cumsum(keep, 0)
        before = bounded_prefix(cs, self.ord_bounds)
        shift = self.ord_base - before[:-1] - 1
        pos = torch.where(keep, cs + shift[self.seg], self.Ord)
        out = torch.full((self.Ord + 1,), -1, dtype=torch.int64, device=rows.device)
        return out.scatter_(0, pos, rows), before[1:] - before[:-1]

    def _reorder(self, clock: int, row_used: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
        """LRU order: within every segment, the rows used at `clock` move to the end, in their order (a stable
        partition: one gather of the rows' last use, one cumsum, one scatter over the usable rows; on CUDA two
        Triton passes, embshard/kernels/_idmap_triton.py, reading the device clock `clock_t`, equal to `clock`;
        `row_used`: the Triton step's marks of the used rows). `self.order` becomes the new order: `out` where
        given (a buffer of its size), else a new tensor."""
        if self._kernels(self.order):
            from embshard.kernels._idmap_triton import reorder_

            self.order = reorder_(self.order, self.row_last, self.ord_bounds, self.clock_t, row_used, out)
            return
        o = self.order
        used = self.row_last[o] == clock
        cs = torch.cumsum(~used, 0)  # unused positions so far
        before = bounded_prefix(cs, self.ord_bounds)  # unused before each segment (and in all)
        to_used, to_unused = before[1:], self.ord_base - before[:-1] - 1
        if self.T > 1:
            to_used, to_unused = to_used[self.seg], to_unused[self.seg]
        ar = torch.arange(self.Ord, device=o.device)
        pos = torch.where(used, ar - cs + to_used, cs + to_unused)
        self.order = (torch.empty_like(o) if out is None else out).scatter_(0, pos, o)

    # ---- admission ---------------------------------------------------------------------------------------
    def _count(
        self, keys: torch.Tensor, shard: torch.Tensor, cnt: torch.Tensor, new: torch.Tensor, per_shard
    ) -> torch.Tensor:
        """Add the new ids' uses to the count-min sketch and return each id's estimate (decayed by halving).
        `per_shard(values)`: per shard the sum of per-id values (no atomics on T counters)."""
        add = torch.where(new, cnt, 0)
        z = keys.unsqueeze(1) * _GOLDEN + self.sketch_salts  # [m, DEPTH]
        _mix_(z, torch.empty_like(z))
        idx = self.sk_base[shard].unsqueeze(1) + torch.remainder(z, self.sk_width[shard].unsqueeze(1))
        for d in range(SKETCH_DEPTH):
            self.sketch[d].index_add_(0, idx[:, d], add)
        est = torch.minimum(self.sketch[0][idx[:, 0]], self.sketch[1][idx[:, 1]])
        self.sketch_adds += per_shard(add)
        halve = (self.sketch_adds >= SKETCH_DECAY * self.sk_width).to(torch.int64)
        self.sketch.bitwise_right_shift_(halve[self.sk_seg])
        self.sketch_adds.bitwise_right_shift_(halve)
        return est
