"""`IdMap`: the id -> row maps of one lookup group's raw-id shards, and the step that remaps their ids (the design
and the algorithm are in the package docstring, embshard/rawids/__init__.py). The map's tensors, their conventions
and the parts of the step every way of running it shares are in state.py (`MapState`), the index in index.py,
eviction and admission in eviction.py, the rows' reset in reset.py. The step runs on torch ops (`_train`), on its
Triton kernels (step.py) or, for a training step on CUDA, as a CUDA graph (graph.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard.lookup.shards import LocalShard
from embshard.rawids import graph
from embshard.rawids.eviction import bounded_prefix
from embshard.rawids.reset import Resets
from embshard.rawids.state import MapState
from embshard.runtime.ops import small_to_device
from embshard.spec.geometry import offsets
from embshard.spec.id_map import P, map_bytes_per_row
from embshard.spec.tables import ConfigError

__all__ = ["P", "IdMap", "Resets", "map_bytes_per_row"]


class IdMap(MapState):
    """The id -> row maps of the raw-id shards `shards` of one lookup group (one per shard), on `device`.

    `remap(ids, counts)` maps a step's ids (shard after shard, `counts[s]` ids of shard s) to the shards' local
    rows; `reset(lookup, resets)` then re-initialises the rows given to new ids and zeroes the zero rows in the
    lookup's weights and optimizer state. `forward` does both."""

    def __init__(self, shards: Sequence[LocalShard], device: torch.device, seed: int | None) -> None:
        super().__init__(shards, device, seed)
        self.graphed = graph.graph_choice()
        """Training steps replay a CUDA graph where `graph.graph_refusal` allows (EMBSHARD_RAWID_GRAPH)."""
        self._graph: graph.MapGraph | None = None  # made at the first graphed step
        self._staged: list[dict[str, torch.Tensor] | None] = [None] * self.T  # `stage_exact_state`

    # ---- the step ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, counts: Sequence[int], lookup: nn.Module) -> torch.Tensor:
        """Local rows of `ids` (`counts[s]` ids of shard s, shard after shard), after admitting new ids when
        training (grad enabled); resets the rows given to new ids and the zero rows in `lookup`. A training step
        on CUDA replays the map's CUDA graph where `graph.graph_refusal` allows (embshard/rawids/graph.py)."""
        if self.graphed and ids.numel() and torch.is_grad_enabled() and graph.graph_refusal(self, ids) is None:
            if self._graph is None:
                self._graph = graph.MapGraph(self)
            if self._graph.refused is None:  # its capture worked (or comes now)
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
        from embshard.rawids.step import train_triton  # here: it imports triton, which a CPU run never needs

        return train_triton(self, ids, shard_of, bounds, wb, W)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202  (nn.Module's: .to(), .cuda(), ...)
        self._graph = None  # the captured graphs hold the buffers' old addresses
        return super()._apply(fn, recurse)

    # ---- state -------------------------------------------------------------------------------------------
    def shard_state(self, s: int) -> dict[str, torch.Tensor]:
        """Live views of shard s's rows: 'ids' (the id of each row), 'id_last' (clock at its last use, -1: no id),
        'id_count' (uses). Write into them, then call `rebuild()`."""
        r0, r1 = self.row_base_host[s], self.row_base_host[s] + self.rows_host[s]
        return {"ids": self.row_key[r0:r1], "id_last": self.row_last[r0:r1], "id_count": self.row_freq[r0:r1]}

    def exact_state(self, s: int) -> dict[str, torch.Tensor]:
        """What besides `shard_state(s)` makes shard s's map go on exactly as it would have (new tensors, for a
        checkpoint): 'id_slot' `[rows]` each row's index slot within the shard's slots (-1: none), 'id_order'
        `[rows]` each usable row's position in the shard's LRU order (-1: the zero row, or no LRU order),
        'id_clock' `[1]` the map's clock, and for a table with admit_min_count > 1 its admission sketch,
        'id_sketch' `[depth, width]` and 'id_sketch_adds' `[1]`. `stage_exact_state` takes them back."""
        r0, n = self.row_base_host[s], self.rows_host[s]
        dev, i64 = self.row_key.device, torch.int64
        slot = self.row_slot[r0 : r0 + n].to(i64)
        out = {"id_slot": torch.where(slot >= 0, slot - self.bucket_base_host[s] * P, -1)}
        order = torch.full((n,), -1, dtype=i64, device=dev)
        if self.lru:
            o0, u = self.ord_base_host[s], self.usable_host[s]
            order[self.order[o0 : o0 + u] - r0] = torch.arange(u, device=dev)
        out["id_order"] = order
        out["id_clock"] = torch.tensor([self.clock], dtype=i64, device=dev)
        if self.shards[s].table.admit_min_count > 1:
            c0, w = self.sketch_base_host[s], self.sketch_width_host[s]
            out["id_sketch"] = self.sketch[:, c0 : c0 + w].clone()
            out["id_sketch_adds"] = self.sketch_adds[s : s + 1].clone()
        return out

    def stage_exact_state(self, s: int, state: dict[str, torch.Tensor] | None) -> None:
        """Hand shard s's `exact_state` (being loaded into these tensors) to the next `rebuild`, which restores
        the index slots, the LRU order, the clock and the sketch from it (where its 'id_clock' is >= 0); None: no
        such state (`rebuild` then rebuilds them from the rows alone)."""
        self._staged[s] = state

    def rebuild(self) -> int:
        """Rebuild the index and the LRU order from the rows' ids and last uses (after a load); the clock goes
        past every last use. Shards given their `exact_state` (`stage_exact_state`) get their slots, order, clock
        and sketch back as saved, so training goes on exactly as it would have. A shard holding an id twice, or
        whose saved slots or order do not fit its rows, is a ConfigError naming the table. Returns how many rows
        lost their id because no index slot was free (normally 0). Not part of a step: it may sync."""
        dev = self.row_key.device
        R = self.R
        staged = [st if st is not None and int(st["id_clock"].min()) >= 0 else None for st in self._staged]
        self._staged = [None] * self.T
        rows = torch.arange(R, device=dev)
        shard = torch.repeat_interleave(torch.arange(self.T, device=dev), torch.tensor(self.rows_host, device=dev))
        used = self.row_last[:R] >= 0
        used[self.row_tab[:, 1]] = False
        self.row_last[:R] = torch.where(used, self.row_last[:R], -1)
        keys = self.row_key[:R]
        self._check_unique(keys, shard, used)
        self.slot_key.zero_()
        self.slot_row.fill_(-1)
        _, cand = self._find(keys, shard)
        fixed = torch.full((R,), -1, dtype=torch.int64, device=dev)  # saved slots, group-wide
        for s, st in enumerate(staged):
            if st is not None:
                r0, n = self.row_base_host[s], self.rows_host[s]
                fixed[r0 : r0 + n] = self._saved_slots(s, st["id_slot"].to(dev), cand[r0 : r0 + n], used[r0 : r0 + n])
        placed = fixed >= 0
        self.slot_key.scatter_(0, torch.where(placed, fixed, self.S), keys)
        self.slot_row.scatter_(0, torch.where(placed, fixed, self.S), rows.to(self.slot_row.dtype))
        slot = torch.where(placed, fixed, self._insert(keys, cand, used & ~placed, rows))
        self.row_slot[:R] = torch.where(used, slot, -1).to(self.row_slot.dtype)
        lost = used & (slot < 0)
        self.row_last[:R] = torch.where(lost, -1, self.row_last[:R])
        self.row_freq[:R] = torch.where(self.row_last[:R] >= 0, self.row_freq[:R], 0)
        if self.lru:
            self._rebuild_order(staged)
        clock = max([int(st["id_clock"].max()) for st in staged if st is not None], default=self.clock)
        self.clock = max(clock, int(self.row_last[:R].max()) + 1)
        self.clock_t.fill_(self.clock)
        for s, st in enumerate(staged):
            if st is not None and "id_sketch" in st and self.sketching:
                c0, w = self.sketch_base_host[s], self.sketch_width_host[s]
                self.sketch[:, c0 : c0 + w] = st["id_sketch"].to(dev)
                self.sketch_adds[s] = st["id_sketch_adds"].to(dev)[0]
        return int(lost.sum())

    def _check_unique(self, keys: torch.Tensor, shard: torch.Tensor, used: torch.Tensor) -> None:
        """ConfigError naming the table unless every shard holds each of its ids in one row at most."""
        k = torch.where(used, keys, 0)
        order = torch.sort(k, stable=True).indices
        order = order[torch.sort(shard[order], stable=True).indices]
        k, sh, u = k[order], shard[order], used[order]
        twice = u[1:] & u[:-1] & (k[1:] == k[:-1]) & (sh[1:] == sh[:-1])
        if bool(twice.any()):
            i = int(torch.argmax(twice.to(torch.int8)))
            s = int(sh[i])
            raise ConfigError(
                f"table {self.shards[s].table.name!r} (ids: raw): its map's block at row "
                f"{self.shards[s].shard.row_offset} holds id {int(k[i])} in two rows ({int(order[i]) - self.row_base_host[s]} "
                f"and {int(order[i + 1]) - self.row_base_host[s]}): the loaded map is inconsistent (a damaged "
                "checkpoint?); load another checkpoint"
            )

    def _saved_slots(self, s: int, local: torch.Tensor, cand: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        """Shard s's saved index slots as group slots (-1: none), checked: every used row's slot in one of its
        key's candidate buckets and no slot twice; else a ConfigError naming the table."""
        slot = torch.where(used & (local >= 0), local + self.bucket_base_host[s] * P, -1)
        ok = (slot < 0) | (slot // P == cand[:, 0]) | (slot // P == cand[:, 1])
        taken = slot[slot >= 0]
        if not bool(ok.all()) or taken.numel() != torch.unique(taken).numel():
            raise ConfigError(
                f"table {self.shards[s].table.name!r} (ids: raw): the saved index slots of its map's block at row "
                f"{self.shards[s].shard.row_offset} do not fit its ids: the loaded map is inconsistent; load "
                "another checkpoint"
            )
        return slot

    def _rebuild_order(self, staged: list[dict[str, torch.Tensor] | None]) -> None:
        """The LRU order: a staged shard's as saved (checked to be a permutation of its usable rows), the others'
        by last use (least recent first, ties by row)."""
        u = self._usable_rows()
        idx = torch.sort(self.row_last[u], stable=True).indices
        if self.T > 1:
            idx = idx[torch.sort(self.seg[idx], stable=True).indices]
        order = u[idx]
        for s, st in enumerate(staged):
            if st is None:
                continue
            o0, n_u, r0 = self.ord_base_host[s], self.usable_host[s], self.row_base_host[s]
            pos = st["id_order"].to(order.device)[:n_u]
            if not torch.equal(torch.sort(pos).values, torch.arange(n_u, device=pos.device)):
                raise ConfigError(
                    f"table {self.shards[s].table.name!r} (ids: raw): the saved LRU order of its map's block at row "
                    f"{self.shards[s].shard.row_offset} is not an order of its {n_u} rows: the loaded map is "
                    "inconsistent; load another checkpoint"
                )
            order[o0 : o0 + n_u] = r0 + torch.argsort(pos)
        self.order = order

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
