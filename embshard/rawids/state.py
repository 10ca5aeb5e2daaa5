"""The tensors of an `IdMap` (idmap.py) and the parts of its training step that every way of running it shares (the
eager step in idmap.py, the Triton step in step.py, the graphed step in graph.py): they name a map as a `MapState`,
and `IdMap` builds on it. The layout of the buffers is in the package docstring (embshard/rawids/__init__.py), the
map's sizes in embshard/spec/id_map.py.

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
from embshard.rawids.eviction import EvictionOps, bounded_prefix
from embshard.rawids.hashing import BUCKET_SALTS, SKETCH_SALTS
from embshard.rawids.index import IndexOps
from embshard.rawids.reset import ResetOps
from embshard.spec.geometry import offsets
from embshard.spec.id_map import SKETCH_DEPTH, P, index_bytes, map_buckets
from embshard.spec.tables import ConfigError, Eviction

KERNELS_ENV = "EMBSHARD_RAWID_KERNELS"


def kernel_choice() -> str:
    """Where the map's steps run: EMBSHARD_RAWID_KERNELS, 'auto' (the default: Triton kernels on CUDA, torch ops
    elsewhere), 'torch' (torch ops everywhere: a fallback to compare with) or 'triton'."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{KERNELS_ENV}={choice!r} is invalid: choose auto (the default), torch or triton")
    return choice


def _index_dtype(rows: int, slots: int) -> torch.dtype:
    """The dtype of slot -> row and row -> slot: int32 while both fit (`index_bytes`)."""
    return torch.int32 if index_bytes(rows, slots) == 4 else torch.int64


def sketch_width(usable: int) -> int:
    """The admission sketch's counters per row of depth for a shard of `usable` rows."""
    return max(usable, 16)


class MapState(IndexOps, EvictionOps, ResetOps, nn.Module):
    """The id -> row maps of the raw-id shards `shards` of one lookup group (one per shard), on `device`: their
    buffers and host sizes, the clock, and the step's shared parts (admission, sums per shard, the clock's tick)."""

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
        buckets = [map_buckets(u) for u in usable]
        widths = [sketch_width(u) for u in usable]
        T = len(rows)
        self.T, self.R, self.Ord = T, sum(rows), sum(usable)
        self.NB, self.S, self.W = sum(buckets), sum(buckets) * P, sum(widths)
        self.rows_host, self.row_base_host, self.usable_host = rows, offsets(rows), usable
        self.bucket_base_host, self.ord_base_host = offsets(buckets), offsets(usable)
        self.sketch_base_host, self.sketch_width_host = offsets(widths), widths
        self.lru = any(s.table.eviction is Eviction.LRU for s in self.shards)
        self.lfu = any(s.table.eviction is Eviction.LFU for s in self.shards)
        self.sketching = any(s.table.admit_min_count > 1 for s in self.shards)
        self.clock = 0
        """The map's clock (steps so far, a host int); `clock_t` holds the same on the device (the Triton kernels
        read it), equal at every step boundary: the Triton step advances it on the device, in its stream."""

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
