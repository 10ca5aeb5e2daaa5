"""`IdMap`: the id -> row maps of one lookup group's raw-id shards, and the step that remaps their ids (the design
and the algorithm are in the package docstring, embshard/rawids/__init__.py).

Conventions: rows are numbered in the group's concatenated row space (shard s owns rows `row_base[s] ..
row_base[s] + rows_s - 1`, its last row the zero row); per-row and per-slot buffers have one extra trailing
element, a trash slot that masked-off writes go to (fixed-size scatters instead of boolean-mask indexing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard.geometry import offsets
from embshard.lookup.shards import LocalShard, init_rows_at, table_key
from embshard.rawids.hashing import BUCKET_SALTS, SKETCH_SALTS, hash64
from embshard.tables import ConfigError, DataType, Eviction

P = 16
"""Slots per bucket of the index (an id is looked up in 2 buckets: 2P slots)."""
SLOTS_PER_ROW = 2
"""Index slots per usable row (load factor 1/2)."""
SKETCH_DEPTH = 2
"""Counters per id in the count-min sketch of admission counting."""
SKETCH_DECAY = 10
"""A shard's sketch is halved once it has counted this many times its width (recent counts weigh more)."""
_FREQ_CAP = (1 << 30) - 1
_LAST_CAP = (1 << 32) - 1
_MAX = (1 << 63) - 1


def _buckets(usable: int) -> int:
    return max(1, -(-usable * SLOTS_PER_ROW // P))


def map_bytes_per_row(rows: int, eviction: Eviction | str = Eviction.LRU, admit_min_count: int = 1) -> float:
    """Bytes the id -> row map keeps per row of a raw-id shard of `rows` rows (the planner's price of the map):
    index slots (id and row, 2 per row), the row's id, last use and use count, its segment and (LRU) its place
    in the LRU order, and (admit_min_count > 1) the sketch's counters."""
    usable = max(rows - 1, 1)
    total = _buckets(usable) * P * 16 + rows * 24 + usable * 8
    if Eviction(eviction) is Eviction.LRU:
        total += usable * 8
    if admit_min_count > 1:
        total += (SKETCH_DEPTH + 1) * max(usable, 16) * 8  # the counters and each column's shard
    return total / rows


def _h2d(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 host list on `device` without a sync (pinned, non-blocking copy on CUDA)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class IdMap(nn.Module):
    """The id -> row maps of the raw-id shards `shards` of one lookup group (one per shard), on `device`.

    `remap(ids, counts)` maps a step's ids (shard after shard, `counts[s]` ids of shard s) to the shards' local
    rows; `reset(lookup, resets)` then re-initialises the rows given to new ids and zeroes the zero rows in the
    lookup's weights and optimizer state. `forward` does both."""

    def __init__(self, shards: Sequence[LocalShard], device: torch.device, seed: int | None) -> None:
        super().__init__()
        self.shards = list(shards)
        self.seed = seed
        for s in self.shards:
            if s.shard.num_rows < 2:
                raise ConfigError(
                    f"table {s.table.name!r} (ids: raw): its block at row {s.shard.row_offset} on rank "
                    f"{s.shard.rank} has {s.shard.num_rows} row; a raw-id block needs >= 2 (a zero row and a row "
                    "for ids): give the table more rows or plan it on fewer ranks (table_wise)"
                )
        rows = [s.shard.num_rows for s in self.shards]
        usable = [r - 1 for r in rows]
        buckets = [_buckets(u) for u in usable]
        widths = [max(u, 16) for u in usable]
        T = len(rows)
        self.T, self.R, self.Ord = T, sum(rows), sum(usable)
        self.NB, self.S, self.W = sum(buckets), sum(buckets) * P, sum(widths)
        self.rows_host, self.row_base_host = rows, offsets(rows)
        self.lru = any(s.table.eviction is Eviction.LRU for s in self.shards)
        self.lfu = any(s.table.eviction is Eviction.LFU for s in self.shards)
        self.sketching = any(s.table.admit_min_count > 1 for s in self.shards)
        self.clock = 0

        def buf(name: str, t: torch.Tensor) -> None:
            self.register_buffer(name, t.to(device), persistent=False)

        i64 = torch.int64
        row_base = torch.tensor(offsets(rows), dtype=i64)
        buf("row_base", row_base)
        buf("null_row", row_base + torch.tensor(rows, dtype=i64) - 1)
        buf("ord_base", torch.tensor(offsets(usable), dtype=i64))
        buf("n_usable", torch.tensor(usable, dtype=i64))
        buf("bucket_base", torch.tensor(offsets(buckets), dtype=i64))
        buf("n_buckets", torch.tensor(buckets, dtype=i64))
        buf("min_count", torch.tensor([s.table.admit_min_count for s in self.shards], dtype=i64))
        buf("is_lfu", torch.tensor([s.table.eviction is Eviction.LFU for s in self.shards]))
        buf("lane", torch.arange(P, dtype=i64))
        seg = torch.repeat_interleave(torch.arange(T, dtype=i64), torch.tensor(usable))
        usable_rows = torch.cat([b + torch.arange(u, dtype=i64) for b, u in zip(offsets(rows), usable)])
        buf("seg", seg)
        if self.lru:
            buf("order", usable_rows.clone())
        buf("row_key", torch.zeros(self.R + 1, dtype=i64))
        buf("row_last", torch.full((self.R + 1,), -1, dtype=i64))
        buf("row_freq", torch.zeros(self.R + 1, dtype=i64))
        buf("slot_key", torch.zeros(self.S + 1, dtype=i64))
        buf("slot_row", torch.full((self.S + 1,), -1, dtype=i64))
        buf("admitted", torch.zeros(T, dtype=i64))
        buf("evicted", torch.zeros(T, dtype=i64))
        if self.sketching:
            buf("sk_base", torch.tensor(offsets(widths), dtype=i64))
            buf("sk_width", torch.tensor(widths, dtype=i64))
            buf("sk_seg", torch.repeat_interleave(torch.arange(T, dtype=i64), torch.tensor(widths)))
            buf("sketch", torch.zeros(SKETCH_DEPTH, self.W, dtype=i64))
            buf("sketch_adds", torch.zeros(T, dtype=i64))

    # ---- the step ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, counts: Sequence[int], lookup: nn.Module) -> torch.Tensor:
        """Local rows of `ids` (`counts[s]` ids of shard s, shard after shard), after admitting new ids when
        training (grad enabled); resets the rows given to new ids and the zero rows in `lookup`."""
        rows, resets = self.remap(ids, counts, torch.is_grad_enabled())
        self.reset(lookup, resets)
        return rows

    def remap(
        self, ids: torch.Tensor, counts: Sequence[int], train: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(local rows of `ids`, per shard the reset list (local rows, zero mask)). `train`: admit new ids, evict,
        count uses and advance the clock; else only look up (unknown ids get the zero row)."""
        n = ids.numel()
        dev = ids.device
        counts = [int(c) for c in counts]
        if sum(counts) != n or len(counts) != self.T:
            raise ValueError(f"IdMap.remap: counts {counts} do not add up to the {n} ids of {self.T} shards")
        if n == 0:
            if train:
                self.clock += 1
            return ids.to(torch.int64), self._resets(None, counts, dev)
        ids = ids.to(torch.int64)
        bounds = offsets(counts) + [n]
        if self.T == 1:
            shard_of = torch.zeros(n, dtype=torch.int64, device=dev)
            starts = torch.zeros(1, dtype=torch.int64, device=dev)
        else:
            both = _h2d(bounds, dev)
            starts = both[:-1]
            shard_of = torch.searchsorted(both[1:], torch.arange(n, device=dev), right=True)
        if not train:
            row, _, _ = self._find(ids, shard_of)
            rows = torch.where(row >= 0, row, self.null_row[shard_of])
            return rows - self.row_base[shard_of], self._resets(None, counts, dev)
        rows, given = self._train(ids, shard_of, starts, n)
        return rows, self._resets(given, counts, dev)

    def _train(
        self, ids: torch.Tensor, shard_of: torch.Tensor, starts: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's remap (package docstring, steps 1-5): (local rows of the ids, per position of the
        batch the group row given to a new id there (its first occurrence), else -1)."""
        dev, clock, i64 = ids.device, self.clock, torch.int64
        ar = torch.arange(n, device=dev)
        # 1. unique (shard, id) pairs: a stable sort by id keeps each id's shards in order, so pairs form runs
        sid, perm = torch.sort(ids, stable=True)
        ss = shard_of[perm]
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = (sid[1:] != sid[:-1]) | (ss[1:] != ss[:-1])
        uid = torch.cumsum(first, 0) - 1  # the run of every sorted position
        valid = ar <= uid[-1]  # runs 0 .. n_unique-1
        run0 = torch.full((n,), n - 1, dtype=i64, device=dev).scatter_reduce_(0, uid, ar, "amin")
        u_key, u_shard, u_pos = sid[run0], ss[run0], perm[run0]  # u_pos: first position in the batch
        u_cnt = torch.zeros(n, dtype=i64, device=dev).index_add_(0, uid, torch.ones_like(uid))
        # 2. lookup; hits are used now
        row_u, _, cand = self._find(u_key, u_shard)
        hit = valid & (row_u >= 0)
        hrow = torch.where(hit, row_u, self.R)
        self.row_last.scatter_(0, hrow, torch.full_like(hrow, clock))
        self.row_freq.index_add_(0, hrow, u_cnt)
        # 3. admission, and each shard's admitted ids (ranked in batch order) take its victims in order
        new = valid & ~hit
        admit = new & (self._count(u_key, u_shard, u_cnt, new) >= self.min_count[u_shard]) if self.sketching else new
        flag = torch.zeros(n + 1, dtype=i64, device=dev).scatter_(0, torch.where(admit, u_pos, n), 1)[:n]
        cs_ex = torch.cat([flag.new_zeros(1), torch.cumsum(flag, 0)])
        rank = cs_ex[u_pos] - cs_ex[starts][u_shard]
        victims, n_ev = self._victims(max(clock - 1, 0))
        ok = admit & (rank < n_ev[u_shard])
        new_row = torch.where(ok, victims[torch.where(ok, self.ord_base[u_shard] + rank, self.Ord)], self.R)
        # 4. evicted ids leave the index, admitted ids enter it; rows get their new id
        old = ok & (self.row_last[new_row] >= 0)
        _, old_slot, _ = self._find(self.row_key[new_row], u_shard)
        self.slot_row.scatter_(0, torch.where(old, old_slot, self.S), -1)
        slot = self._insert(u_key, cand, ok, new_row)
        ins = ok & (slot >= 0)
        self.row_key.scatter_(0, new_row, u_key)
        self.row_last.scatter_(0, new_row, torch.where(ins, clock, -1))
        self.row_freq.scatter_(0, new_row, torch.where(ins, u_cnt, 0))
        self.admitted.index_add_(0, u_shard, ins.to(i64))
        self.evicted.index_add_(0, u_shard, old.to(i64))
        # 5. every id's row; the LRU order
        final = torch.where(hit, row_u, torch.where(ins, new_row, self.null_row[u_shard]))
        rows = torch.empty_like(final).scatter_(0, perm, final[uid]) - self.row_base[shard_of]
        if self.lru:
            self._reorder(clock)
        self.clock += 1
        given = torch.full((n + 1,), -1, dtype=i64, device=dev)
        return rows, given.scatter_(0, torch.where(ok, u_pos, n), torch.where(ok, new_row, -1))[:n]

    def _resets(self, given: torch.Tensor | None, counts: list[int], dev: torch.device) -> list[torch.Tensor | None]:
        """Per shard: at each of its positions in the step the local row given to a new id there, else -1 (None:
        no id of the shard could get a row)."""
        out: list[torch.Tensor | None] = []
        for s, (start, c) in enumerate(zip(offsets(counts), counts)):
            if given is None or c == 0:
                out.append(None)
                continue
            g = given[start : start + c]
            out.append(torch.where(g >= 0, g - self.row_base_host[s], -1))
        return out

    def reset(self, lookup: nn.Module, resets: Sequence[torch.Tensor | None]) -> None:
        """Re-initialise the rows of the reset lists (`_resets`) in `lookup`'s weights and zero their optimizer
        state; zero every shard's zero row. On CUDA one Triton program per list entry, returning at once for -1
        (embshard.kernels._reset_triton: the work follows the rows actually reset, no host sync); on the CPU the
        listed rows are picked out first. Writes through `.data`: an autograd graph still waiting for its backward
        is not invalidated. The lookup's shard tensors are taken once (they are updated in place, never replaced)."""
        if getattr(self, "_views_of", None) != id(lookup):
            self._views = (lookup.shard_weights(), lookup.shard_optimizer_states())
            self._views_of = id(lookup)
        weights, states = self._views
        with torch.no_grad():
            for s, (shard, w, st, new) in enumerate(zip(self.shards, weights, states, resets)):
                zero = self.rows_host[s] - 1
                w.data[zero].zero_()
                for v in st.values():
                    v.data[zero].zero_()
                if new is not None:
                    self._reset_rows(shard, w.data, [v.data for v in st.values()], new)

    def _reset_rows(self, s: LocalShard, w: torch.Tensor, states: list[torch.Tensor], new: torch.Tensor) -> None:
        sh = s.shard
        fp16 = s.table.data_type is DataType.FP16  # its values rounded to fp16 even where the weights are fp32
        if (
            w.is_cuda
            and self.seed is not None
            and all(v.is_cuda for v in states)
            and not (fp16 and w.dtype != torch.float16)
        ):
            from embshard.kernels._reset_triton import reset_weights_, zero_rows_

            key = table_key(self.seed, s.table_index)
            reset_weights_(w, new, sh.row_offset, s.table.embedding_dim, sh.col_offset, key, s.table.init_bound)
            for v in states:
                zero_rows_(v, new)
            return
        idx = new if w.is_cuda else new[new >= 0]  # (CUDA without a seed: the -1 entries write into the zero row)
        idx = torch.where(idx >= 0, idx, w.shape[0] - 1)
        vals = init_rows_at(s.table, s.table_index, idx + sh.row_offset, sh.col_offset, sh.num_cols, self.seed)
        vals = torch.where((idx == w.shape[0] - 1).unsqueeze(1), 0.0, vals)
        w.index_copy_(0, idx, (vals.half() if fp16 else vals).to(w.dtype))
        for v in states:
            v.index_fill_(0, idx, 0)

    def tick(self) -> None:
        """A training step without a lookup on this rank (empty global batch): the clock still advances."""
        self.clock += 1

    # ---- index -------------------------------------------------------------------------------------------
    def _find(self, keys: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group row or -1, slot or -1, the two candidate buckets `[m, 2]`) of every (shard, key). Reads the two
        buckets one after the other (`[m, P]` at a time)."""
        nb, bb = self.n_buckets[shard], self.bucket_base[shard]
        cand = torch.stack([bb + torch.remainder(hash64(keys, salt), nb) for salt in BUCKET_SALTS], 1)
        row = slot = None
        for k in range(2):
            slots = cand[:, k : k + 1] * P + self.lane  # [m, P]
            rows_k = self.slot_row[slots]
            match = (self.slot_key[slots] == keys.unsqueeze(1)) & (rows_k >= 0)
            r = torch.where(match, rows_k, -1).amax(1)
            s = torch.where(match.any(1), cand[:, k] * P + match.to(torch.int32).argmax(1), -1)
            row, slot = (r, s) if row is None else (torch.maximum(row, r), torch.maximum(slot, s))
        return row, slot, cand

    def _insert(self, keys: torch.Tensor, cand: torch.Tensor, active: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Insert the active keys (rows `rows`): into the emptier candidate bucket, then the other; the slot, or
        -1 where both were full."""
        free = [(self.slot_row[cand[:, k : k + 1] * P + self.lane] < 0).sum(1) for k in range(2)]
        swap = free[1] > free[0]
        first = torch.where(swap, cand[:, 1], cand[:, 0])
        second = torch.where(swap, cand[:, 0], cand[:, 1])
        slot = self._place(keys, first, active, rows)
        slot2 = self._place(keys, second, active & (slot < 0), rows)
        return torch.where(slot >= 0, slot, slot2)

    def _place(
        self, keys: torch.Tensor, bucket: torch.Tensor, active: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The active keys that share a bucket take its free slots in order (the q-th key the q-th free slot);
        returns the slot or -1 (bucket full), and writes the placed keys."""
        m = keys.numel()
        ar = torch.arange(m, device=keys.device)
        sb, order = torch.sort(torch.where(active, bucket, self.NB), stable=True)
        starts = torch.ones(m, dtype=torch.bool, device=keys.device)
        starts[1:] = sb[1:] != sb[:-1]
        q = torch.empty_like(ar).scatter_(0, order, ar - torch.cummax(torch.where(starts, ar, 0), 0).values)
        free = self.slot_row[bucket.unsqueeze(1) * P + self.lane] < 0
        pick = free & (torch.cumsum(free, 1) == (q + 1).unsqueeze(1))
        found = active & pick.any(1)
        slot = torch.where(found, bucket * P + pick.to(torch.int64).argmax(1), -1)
        target = torch.where(found, slot, self.S)
        self.slot_key.scatter_(0, target, keys)
        self.slot_row.scatter_(0, target, torch.where(found, rows, -1))
        return slot

    # ---- eviction ----------------------------------------------------------------------------------------
    def _victims(self, last_before: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[Ord + 1]` per shard segment its evictable rows in eviction order, then -1; `[T]` how many). A row is
        evictable if last used before step `last_before` (holding no id: last use -1)."""
        lru_v = lfu_v = None
        if self.lru:
            ev = self.row_last[self.order] < last_before
            lru_v, lru_n = self._compact(self.order, ev)
        if self.lfu:
            u = self._usable_rows()
            last = self.row_last[u]
            ev = last < last_before
            key = self.row_freq[u].clamp(max=_FREQ_CAP) * (1 << 32) + (last + 1).clamp(max=_LAST_CAP)
            idx = torch.sort(torch.where(ev, key, _MAX), stable=True).indices
            if self.T > 1:
                idx = idx[torch.sort(self.seg[idx], stable=True).indices]
            lfu_v, lfu_n = self._compact(u[idx], ev[idx])
        if lru_v is None:
            return lfu_v, lfu_n
        if lfu_v is None:
            return lru_v, lru_n
        pos_lfu = torch.cat([self.is_lfu[self.seg], self.is_lfu.new_zeros(1)])
        return torch.where(pos_lfu, lfu_v, lru_v), torch.where(self.is_lfu, lfu_n, lru_n)

    def _usable_rows(self) -> torch.Tensor:
        """`[Ord]` the usable rows of every shard, shard after shard (each shard's zero row left out: position i of
        segment s is row i + s of the group)."""
        return torch.arange(self.Ord, device=self.seg.device) + self.seg

    def _segment_bases(self, cs_ex: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per shard the exclusive cumsum at its segment's start, per shard the segment's total)."""
        start = cs_ex[self.ord_base]
        return start, cs_ex[self.ord_base + self.n_usable] - start

    def _compact(self, rows: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per segment, the kept entries of `rows` moved to the segment's front in order (the rest -1), and their
        count per segment."""
        cs = torch.cumsum(keep, 0)
        start, count = self._segment_bases(torch.cat([cs.new_zeros(1), cs]))
        pos = torch.where(keep, self.ord_base[self.seg] + cs - 1 - start[self.seg], self.Ord)
        out = torch.full((self.Ord + 1,), -1, dtype=torch.int64, device=rows.device)
        return out.scatter_(0, pos, rows), count

    def _reorder(self, clock: int) -> None:
        """LRU order: within every segment, the rows used at `clock` move to the end (stable partition)."""
        o = self.order
        used = self.row_last[o] == clock
        cs_u, cs_n = torch.cumsum(used, 0), torch.cumsum(~used, 0)
        u0, _ = self._segment_bases(torch.cat([cs_u.new_zeros(1), cs_u]))
        n0, n_unused = self._segment_bases(torch.cat([cs_n.new_zeros(1), cs_n]))
        seg, base = self.seg, self.ord_base[self.seg]
        pos = torch.where(used, base + n_unused[seg] + cs_u - 1 - u0[seg], base + cs_n - 1 - n0[seg])
        self.order.copy_(torch.empty_like(o).scatter_(0, pos, o))

    # ---- admission ---------------------------------------------------------------------------------------
    def _count(self, keys: torch.Tensor, shard: torch.Tensor, cnt: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Add the new ids' uses to the count-min sketch and return each id's estimate (decayed by halving)."""
        width, base = self.sk_width[shard], self.sk_base[shard]
        add = torch.where(new, cnt, 0)
        idx = [base + torch.remainder(hash64(keys, salt), width) for salt in SKETCH_SALTS]
        for d in range(SKETCH_DEPTH):
            self.sketch[d].index_add_(0, idx[d], add)
        est = torch.minimum(self.sketch[0][idx[0]], self.sketch[1][idx[1]])
        self.sketch_adds.index_add_(0, shard, add)
        halve = self.sketch_adds >= SKETCH_DECAY * self.sk_width
        self.sketch.copy_(torch.where(halve[self.sk_seg], self.sketch >> 1, self.sketch))
        self.sketch_adds.copy_(torch.where(halve, self.sketch_adds >> 1, self.sketch_adds))
        return est

    # ---- state -------------------------------------------------------------------------------------------
    def shard_state(self, s: int) -> dict[str, torch.Tensor]:
        """Live views of shard s's rows: 'ids' (the id of each row), 'id_last' (clock at its last use, -1: no id),
        'id_count' (uses). Write into them, then call `rebuild()`."""
        r0, r1 = self.row_base_host[s], self.row_base_host[s] + self.rows_host[s]
        return {"ids": self.row_key[r0:r1], "id_last": self.row_last[r0:r1], "id_count": self.row_freq[r0:r1]}

    def rebuild(self) -> int:
        """Rebuild the index and the LRU order from the rows' ids and last uses (after a load); the clock goes
        past every last use. Returns how many rows lost their id because no index slot was free (normally 0).
        Not part of a step: it may sync."""
        dev = self.row_key.device
        R = self.R
        rows = torch.arange(R, device=dev)
        shard = torch.repeat_interleave(torch.arange(self.T, device=dev), torch.tensor(self.rows_host, device=dev))
        used = self.row_last[:R] >= 0
        used[self.null_row] = False
        self.row_last[:R] = torch.where(used, self.row_last[:R], -1)
        self.slot_key.zero_()
        self.slot_row.fill_(-1)
        keys = self.row_key[:R]
        _, _, cand = self._find(keys, shard)
        slot = self._insert(keys, cand, used, rows)
        lost = used & (slot < 0)
        self.row_last[:R] = torch.where(lost, -1, self.row_last[:R])
        self.row_freq[:R] = torch.where(self.row_last[:R] >= 0, self.row_freq[:R], 0)
        if self.lru:
            u = self._usable_rows()
            idx = torch.sort(self.row_last[u], stable=True).indices
            if self.T > 1:
                idx = idx[torch.sort(self.seg[idx], stable=True).indices]
            self.order.copy_(u[idx])
        self.clock = max(self.clock, int(self.row_last[:R].max()) + 1)
        return int(lost.sum())

    def stats(self) -> list[dict[str, int]]:
        """Per shard: ids admitted and evicted since the last `reset_stats`, ids resident now, capacity (host
        values: syncs; for logging)."""
        last = self.row_last[: self.R]
        resident = torch.zeros(self.T, dtype=torch.int64, device=last.device)
        shard = torch.repeat_interleave(
            torch.arange(self.T, device=last.device), torch.tensor(self.rows_host, device=last.device)
        )
        resident.index_add_(0, shard, (last >= 0).to(torch.int64))
        table = torch.stack([self.admitted, self.evicted, resident]).cpu().tolist()
        return [
            {"admitted": a, "evicted": e, "resident": r, "capacity": c - 1}
            for a, e, r, c in zip(*table, self.rows_host)
        ]

    def reset_stats(self) -> None:
        """Start counting admissions and evictions afresh."""
        self.admitted.zero_()
        self.evicted.zero_()
