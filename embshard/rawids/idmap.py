"""`IdMap`: the id -> row maps of one lookup group's raw-id shards, and the step that remaps their ids (the design
and the algorithm are in the package docstring, embshard/rawids/__init__.py). The index is in index.py, eviction
and admission in eviction.py, the rows' reset in reset.py.

Conventions: rows are numbered in the group's concatenated row space (shard s owns rows `row_base[s] ..
row_base[s] + rows_s - 1`, its last row the zero row); per-row and per-slot buffers have one extra trailing
element, a trash slot that masked-off writes go to (fixed-size scatters instead of boolean-mask indexing; only
plain stores go there, never atomic adds: a GPU serialises atomics on one address). Per-shard sums of per-id values
are taken by a scatter into batch positions (shard after shard) and a cumsum, not by atomic adds into T counters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from embshard.lookup.shards import LocalShard, _signed
from embshard.rawids.eviction import SKETCH_DEPTH, EvictionOps, bounded_prefix
from embshard.rawids.hashing import BUCKET_SALTS, SKETCH_SALTS
from embshard.rawids.index import IndexOps, P
from embshard.rawids.reset import ResetOps, Resets
from embshard.runtime.ops import small_to_device
from embshard.spec.geometry import offsets
from embshard.spec.raw_ids import index_buckets, index_itemsize, map_bytes_per_row
from embshard.spec.tables import ConfigError, Eviction

__all__ = ["P", "IdMap", "Resets", "map_bytes_per_row"]

KERNELS_ENV = "EMBSHARD_RAWID_KERNELS"


def kernel_choice() -> str:
    """Where the map's steps run: EMBSHARD_RAWID_KERNELS, 'auto' (the default: Triton kernels on CUDA, torch ops
    elsewhere), 'torch' (torch ops everywhere: a fallback to compare with) or 'triton'."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}={choice!r} is invalid: choose auto (the default), torch or triton")
    return choice


def _buckets(usable: int) -> int:
    """Buckets of the index of a shard with `usable` rows for ids (embshard.spec.raw_ids.index_buckets)."""
    return index_buckets(usable)


def _index_dtype(rows: int, slots: int) -> torch.dtype:
    """The dtype of slot -> row and row -> slot: int32 while both fit."""
    return torch.int32 if index_itemsize(rows, slots) == 4 else torch.int64


class IdMap(IndexOps, EvictionOps, ResetOps, nn.Module):
    """The id -> row maps of the raw-id shards `shards` of one lookup group (one per shard), on `device`.

    `remap(ids, counts)` maps a step's ids (shard after shard, `counts[s]` ids of shard s) to the shards' local
    rows; `reset(lookup, resets)` then re-initialises the rows given to new ids and zeroes the zero rows in the
    lookup's weights and optimizer state. `forward` does both."""

    def __init__(self, shards: Sequence[LocalShard], device: torch.device, seed: int | None) -> None:
        super().__init__()
        self.shards = list(shards)
        self.seed = seed
        self.map_kernel = self.reset_kernel = kernel_choice()
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
        self.rows_host, self.row_base_host, self.usable_host = rows, offsets(rows), usable
        self.lru = any(s.table.eviction is Eviction.LRU for s in self.shards)
        self.lfu = any(s.table.eviction is Eviction.LFU for s in self.shards)
        self.sketching = any(s.table.admit_min_count > 1 for s in self.shards)
        self.clock = 0
        """The map's clock (steps so far, a host int); `clock_t` holds the same on the device (the Triton kernels
        read it), equal at every step boundary: the Triton step advances it on the device, in its stream."""
        from embshard.rawids.graph import graph_choice  # graph.py names IdMap: imported here, not at the top

        self.graphed = graph_choice()
        """Training steps replay a CUDA graph where `graph.graph_refusal` allows (EMBSHARD_RAWID_GRAPH)."""
        self._graph = None  # its graph.MapGraph, made at the first graphed step

        def buf(name: str, t: torch.Tensor) -> None:
            self.register_buffer(name, t.to(device), persistent=False)

        i64 = torch.int64
        idx = _index_dtype(self.R, self.S)
        row_base = torch.tensor(offsets(rows), dtype=i64)
        buf("row_tab", torch.stack([row_base, row_base + torch.tensor(rows) - 1], 1))  # [T, 2]: first row, zero row
        buf("ord_base", torch.tensor(offsets(usable), dtype=i64))
        buf("ord_bounds", torch.tensor(offsets(usable) + [self.Ord], dtype=i64))
        buf("bucket_tab", torch.tensor([offsets(buckets), buckets], dtype=i64).T.contiguous())  # first, buckets
        buf("bucket_salts", torch.tensor([_signed(s) for s in BUCKET_SALTS], dtype=i64))
        buf("min_count", torch.tensor([s.table.admit_min_count for s in self.shards], dtype=i64))
        buf("is_lfu", torch.tensor([s.table.eviction is Eviction.LFU for s in self.shards]))
        buf("seg", torch.repeat_interleave(torch.arange(T, dtype=i64), torch.tensor(usable)))
        if self.lru:
            buf("order", torch.cat([b + torch.arange(u, dtype=i64) for b, u in zip(offsets(rows), usable)]))
        buf("row_key", torch.zeros(self.R + 1, dtype=i64))
        buf("row_last", torch.full((self.R + 1,), -1, dtype=i64))
        buf("row_freq", torch.zeros(self.R + 1, dtype=i64))
        buf("row_slot", torch.full((self.R + 1,), -1, dtype=idx))
        buf("slot_key", torch.zeros(self.S + 1, dtype=i64))
        buf("slot_row", torch.full((self.S + 1,), -1, dtype=idx))
        buf("list_head", torch.full((self.NB,), -1, dtype=i64))  # the Triton step's inserts (rawids/step.py)
        buf("row_used", torch.zeros(self.R + 1 if self.lru else 1, dtype=torch.int8))  # its marks of used rows
        buf("clock_t", torch.zeros(1, dtype=i64))
        buf("admitted", torch.zeros(T, dtype=i64))
        buf("evicted", torch.zeros(T, dtype=i64))
        if self.sketching:
            buf("sk_base", torch.tensor(offsets(widths), dtype=i64))
            buf("sk_width", torch.tensor(widths, dtype=i64))
            buf("sk_seg", torch.repeat_interleave(torch.arange(T, dtype=i64), torch.tensor(widths)))
            buf("sketch_salts", torch.tensor([_signed(s) for s in SKETCH_SALTS], dtype=i64))
            buf("sketch", torch.zeros(SKETCH_DEPTH, self.W, dtype=i64))
            buf("sketch_adds", torch.zeros(T, dtype=i64))

    # ---- the step ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, counts: Sequence[int], lookup: nn.Module) -> torch.Tensor:
        """Local rows of `ids` (`counts[s]` ids of shard s, shard after shard), after admitting new ids when
        training (grad enabled); resets the rows given to new ids and the zero rows in `lookup`. A training step
        on CUDA replays the map's CUDA graph where `graph.graph_refusal` allows (embshard/rawids/graph.py)."""
        if self.graphed and ids.numel() and torch.is_grad_enabled():
            from embshard.rawids import graph

            if graph.graph_refusal(self, ids) is None:
                if self._graph is None:
                    self._graph = graph.MapGraph(self)
                rows = self._graph.step(ids, counts, lookup)
                if rows is not None:
                    return rows
        rows, resets = self.remap(ids, counts, torch.is_grad_enabled())
        self.reset(lookup, resets)
        return rows

    def remap(self, ids: torch.Tensor, counts: Sequence[int], train: bool) -> tuple[torch.Tensor, Resets]:
        """(local rows of `ids`, the reset list). `train`: admit new ids, evict, count uses and advance the clock;
        else only look up (unknown ids get the zero row)."""
        n = ids.numel()
        dev = ids.device
        counts = [int(c) for c in counts]
        if sum(counts) != n or len(counts) != self.T:
            raise ValueError(f"IdMap.remap: counts {counts} do not add up to the {n} ids of {self.T} shards")
        ids = ids.to(torch.int64)
        if n == 0:
            if train:
                self.tick()
            return ids, Resets(None, ids, counts)
        host = offsets(counts) + [n]
        if train and self.lru:  # the LRU window: per shard min(its ids, its usable rows) positions of its order
            window = [min(c, u) for c, u in zip(counts, self.usable_host)]
            host += offsets(window) + [sum(window)]
        both = small_to_device(host, dev)
        bounds, wb = both[: self.T + 1], both[self.T + 1 :]
        if self.T == 1:
            shard_of = torch.zeros(n, dtype=torch.int64, device=dev)
        else:
            shard_of = torch.searchsorted(bounds[1:], torch.arange(n, device=dev), right=True)
        if not train:
            row, _ = self._find(ids, shard_of)
            tab = self.row_tab[shard_of]
            return torch.where(row >= 0, row, tab[:, 1]) - tab[:, 0], Resets(None, shard_of, counts)
        W = host[-1] if self.lru else 0
        if self._kernels(ids):
            rows, given, listed = self._train_triton(ids, shard_of, bounds, wb, W)
            if self.lru:
                self._reorder(self.clock, self.row_used)
            self.tick()
            return rows, Resets(given, shard_of, counts, listed)
        rows, given = self._train(ids, shard_of, bounds, wb, W)
        return rows, Resets(given, shard_of, counts)

    def _train(
        self, ids: torch.Tensor, shard_of: torch.Tensor, bounds: torch.Tensor, wb: torch.Tensor, W: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's remap (package docstring, steps 1-5): (local rows of the ids, per position of the
        batch the local row given to a new id there (its first occurrence), else -1). `bounds`: the shards' first
        positions and n; `wb`, W: the LRU window's (`_victims`)."""
        n = ids.numel()
        dev, clock, i64 = ids.device, self.clock, torch.int64
        ar = torch.arange(n, device=dev)
        # 1. unique (shard, id) pairs: a stable sort by id keeps each id's shards in order, so pairs form runs; the
        #    runs' first positions by a scatter (unused runs n..: n), their counts by difference
        sid, perm = torch.sort(ids, stable=True)
        ss = shard_of[perm] if self.T > 1 else shard_of
        first = torch.ones(n, dtype=torch.bool, device=dev)
        torch.ne(sid[1:], sid[:-1], out=first[1:])
        if self.T > 1:
            first[1:].logical_or_(ss[1:] != ss[:-1])
        uid = torch.cumsum(first, 0) - 1  # the run of every sorted position
        run0 = torch.full((n + 2,), n, dtype=i64, device=dev).scatter_(0, torch.where(first, uid, n + 1), ar)
        u_cnt = run0[1 : n + 1] - run0[:n]
        valid = u_cnt > 0  # runs 0 .. n_unique-1
        run0 = run0[:n].clamp_(max=n - 1)
        u_key, u_shard, u_pos = sid[run0], ss[run0], perm[run0]  # u_pos: first position in the batch
        # 2. lookup; hits are used now
        row_u, cand = self._find(u_key, u_shard)
        hit = valid & (row_u >= 0)
        hrow = torch.where(hit, row_u, self.R)
        self.row_last.index_fill_(0, hrow, clock)
        self.row_freq.scatter_(0, hrow, self.row_freq[hrow] + u_cnt)  # one id per row: no atomics
        # 3. admission, and each shard's admitted ids (ranked in batch order) take its victims in order
        new = valid & ~hit
        admit = self._admitted(u_key, u_shard, u_cnt, new, u_pos, bounds) if self.sketching else new
        flag = torch.zeros(n + 1, dtype=i64, device=dev).index_fill_(0, torch.where(admit, u_pos, n), 1)
        cs = torch.cumsum(flag[:n], 0)
        victims, vbase, n_ev = self._victims(max(clock - 1, 0), wb, W)
        # per shard: admitted before it, victims, where they start, first row, zero row (one gather per id)
        tab = torch.cat([torch.stack([bounded_prefix(cs, bounds)[:-1], n_ev, vbase], 1), self.row_tab], 1)[u_shard]
        rank = cs[u_pos] - 1 - tab[:, 0]
        ok = admit & (rank < tab[:, 1])
        new_row = torch.where(ok, victims[torch.where(ok, tab[:, 2] + rank, victims.numel() - 1)], self.R)
        # 4. evicted ids leave the index (their slot: `row_slot`), admitted ids enter it; rows get their new id
        old = ok & (self.row_last[new_row] >= 0)
        self.slot_row.index_fill_(0, torch.where(old, self.row_slot[new_row].to(i64), self.S), -1)
        slot = self._insert(u_key, cand, ok, new_row)
        ins = ok & (slot >= 0)
        self.row_key.scatter_(0, new_row, u_key)
        self.row_last.scatter_(0, new_row, torch.where(ins, clock, -1))
        self.row_freq.scatter_(0, new_row, torch.where(ins, u_cnt, 0))
        self.row_slot.scatter_(0, new_row, slot.to(self.row_slot.dtype))
        both = self._sums_per_shard(u_pos, ok, bounds)(old.to(i64) + (ins.to(i64) << 32))
        self.evicted += both & 0xFFFFFFFF
        self.admitted += both >> 32
        # 5. every id's local row; the LRU order
        final = torch.where(hit, row_u, torch.where(ins, new_row, tab[:, 4])) - tab[:, 3]
        rows = torch.empty_like(final).scatter_(0, perm, final[uid])
        if self.lru:
            self._reorder(clock)
        self.tick()
        given = torch.full((n + 1,), -1, dtype=i64, device=dev)
        given.scatter_(0, torch.where(ok, u_pos, n), new_row - tab[:, 3])
        return rows, given[:n]

    def _train_triton(
        self, ids: torch.Tensor, shard_of: torch.Tensor, bounds: torch.Tensor, wb: torch.Tensor, W: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`_train` on the Triton kernels (rawids/step.py), and the compact list of positions given a row."""
        from embshard.rawids.step import train_triton

        return train_triton(self, ids, shard_of, bounds, wb, W)

    def _admitted(
        self, key: torch.Tensor, shard: torch.Tensor, cnt: torch.Tensor, new: torch.Tensor, pos: torch.Tensor,
        bounds: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The new ids admission counting lets in: their uses added to the sketch (`_count`), the ids whose
        estimate reaches their shard's min_count (per unique id: key, shard, uses, new, batch position)."""
        est = self._count(key, shard, cnt, new, self._sums_per_shard(pos, new, bounds))
        return new & (est >= self.min_count[shard])

    def _sums_per_shard(
        self, u_pos: torch.Tensor, mask: torch.Tensor, bounds: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function of per-id values (`[n]`, one per unique id) giving `[T]` the sums per shard over the ids in
        `mask`: the values scattered to the ids' batch positions (shard after shard), a cumsum, its differences."""
        n = u_pos.numel()
        pos = torch.where(mask, u_pos, n)

        def sums(values: torch.Tensor) -> torch.Tensor:
            at = torch.zeros(n + 1, dtype=values.dtype, device=values.device).scatter_(0, pos, values)
            before = bounded_prefix(torch.cumsum(at[:n], 0), bounds)
            return before[1:] - before[:-1]

        return sums

    def tick(self) -> None:
        """A training step without a lookup on this rank (empty global batch): the clock still advances (on the
        host and, in its stream, on the device)."""
        self.clock += 1
        self.clock_t.add_(1)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202  (nn.Module's: .to(), .cuda(), ...)
        self._graph = None  # the captured graphs hold the buffers' old addresses
        return super()._apply(fn, recurse)

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
        used[self.row_tab[:, 1]] = False
        self.row_last[:R] = torch.where(used, self.row_last[:R], -1)
        self.slot_key.zero_()
        self.slot_row.fill_(-1)
        keys = self.row_key[:R]
        _, cand = self._find(keys, shard)
        slot = self._insert(keys, cand, used, rows)
        self.row_slot[:R] = torch.where(used, slot, -1)
        lost = used & (slot < 0)
        self.row_last[:R] = torch.where(lost, -1, self.row_last[:R])
        self.row_freq[:R] = torch.where(self.row_last[:R] >= 0, self.row_freq[:R], 0)
        if self.lru:
            u = self._usable_rows()
            idx = torch.sort(self.row_last[u], stable=True).indices
            if self.T > 1:
                idx = idx[torch.sort(self.seg[idx], stable=True).indices]
            self.order = u[idx]
        self.clock = max(self.clock, int(self.row_last[:R].max()) + 1)
        self.clock_t.fill_(self.clock)
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
