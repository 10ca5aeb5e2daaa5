"""Resetting the rows an `IdMap` (idmap.py) gave to new ids, and its shards' zero rows, in a lookup's weights and
optimizer state.

A step's reset list (`Resets`) has one entry per id of the group (shard after shard): the local row given to a
new id at that position, else -1. Work goes per storage, not per shard: a TBE keeps all its shards' weights in one
tensor and each optimizer state in one (other lookups: one storage per shard tensor). Per storage and step: one
`index_fill_` zeroes the shards' zero rows; on CUDA one Triton launch writes the listed rows
(embshard/kernels/_reset_triton.py: a program returns at once when its entries list no row); elsewhere (the CPU,
or fp16 values in fp32 storage) torch ops write them, the CPU picking the listed entries out first. The values are
`init_rows`' for the row (seed given), bit for bit; with seed None, a stream drawn per step. Writes go through
tensors aliasing the storages (`.data` semantics): an autograd graph still waiting for its backward is not
invalidated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from embshard.lookup.shards import LocalShard, _signed, _uniform_of_index_, fp32, table_key
from embshard.rawids.index import triton_for
from embshard.runtime.ops import small_to_device
from embshard.spec.geometry import offsets
from embshard.spec.tables import DataType

RESET_BLOCK_ELEMENTS = 1 << 20
"""Torch path: elements whose initial values are drawn per pass (int64 temporaries of 8 MiB)."""


class Resets(NamedTuple):
    """A step's reset list: `rows` `[n]` the local row given to a new id at each position, else -1 (None: no row
    was given: evaluation); `shard` `[n]` the shard of each position; `counts` the ids per shard (host); `listed`
    (the Triton step's): the positions given a row `[n]` (the first `count` entries, in any order) and `count`
    `[1]` on the device, which the reset kernels walk instead of the whole list."""

    rows: torch.Tensor | None
    shard: torch.Tensor
    counts: list[int]
    listed: tuple[torch.Tensor, torch.Tensor] | None = None


class _Storage:
    """The tensors of shards `ids` (one each, views of one storage): the storage as a 1-d tensor and, per shard
    (`ints` `[4, k]` on the device): where its rows start, their stride, their width, its zero row; for weights
    also `init` `[4, k]` (table row offset, table dim, column offset, fp16 values) and `scale` `[2, k]` fp32 (the
    factor 2 x bound / 2^24 and the bound); the elements of the zero rows."""

    def __init__(self, views: Sequence[torch.Tensor], ids: Sequence[int], shards: Sequence[LocalShard]) -> None:
        self.ids = list(ids)
        v0 = views[0]
        dev = v0.device
        self.flat = torch.empty(0, dtype=v0.dtype, device=dev).set_(v0.untyped_storage())  # own version counter
        start = [v.storage_offset() for v in views]
        stride = [v.stride(0) for v in views]
        self.width = [v.shape[1] if v.dim() > 1 else 1 for v in views]
        zero = [v.shape[0] - 1 for v in views]
        self.ints = small_to_device([start, stride, self.width, zero], dev)
        self.grids = []  # (rows `[N, width]` over the storage, per shard its first row there or -1, a zero row)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for k, (a, b, w) in enumerate(zip(start, stride, self.width)):
            groups.setdefault((b, w, a % b), []).append(k)
        for (b, w, _), ks in groups.items():
            base = min(start[k] for k in ks)
            n = max(start[k] + views[k].shape[0] * b for k in ks) - base
            grid = self.flat.as_strided((-(-n // b), w), (b, 1), base)
            row0 = [(start[k] - base) // b if k in ks else -1 for k in range(len(views))]
            self.grids.append((grid, small_to_device([row0], dev)[0], row0[ks[0]] + zero[ks[0]]))
        self.zero_elems = torch.cat(
            [
                torch.arange(w) * (v.stride(1) if v.dim() > 1 else 1) + a + z * b
                for v, a, b, w, z in zip(views, start, stride, self.width, zero)
            ]  # fmt: skip
        ).to(dev)
        sh = [shards[i] for i in ids]
        fp16 = [int(s.table.data_type is DataType.FP16 and v.dtype != torch.float16) for s, v in zip(sh, views)]
        self.round_fp16 = any(fp16)  # fp16 tables' values rounded to fp16 in wider storage
        self.init = small_to_device([[s.shard.row_offset for s in sh], [s.table.embedding_dim for s in sh],
                            [s.shard.col_offset for s in sh], fp16], dev)  # fmt: skip
        bounds = [s.table.init_bound for s in sh]
        scale = [[fp32(2.0 * b / (1 << 24)) for b in bounds], [fp32(b) for b in bounds]]
        self.scale = torch.tensor(scale, dtype=torch.float32).to(dev)
        # the weights kernel's per-shard table: start, stride, row offset, dim, column offset, width
        self.kernel_ints = torch.cat([self.ints[:2], self.init[:3], self.ints[2:3]])

    def span(self, resets: Resets) -> tuple[int, int] | None:
        """[start, end) of the reset list's entries of this storage's one shard, where the list holds several
        shards' entries one after another; None where all of the list's entries are this storage's."""
        if len(self.ids) == 1 and len(resets.counts) > 1:
            b = offsets(resets.counts)[self.ids[0]]
            return b, b + resets.counts[self.ids[0]]
        return None

    def entries(self, resets: Resets, compact: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(local rows, shard index within `ids`) of the reset list's entries of this storage's shards; `compact`:
        only the listed rows (a host sync on CUDA: the CPU only)."""
        rows, shard = resets.rows, resets.shard
        span = self.span(resets)
        if span is not None:
            rows = rows[span[0] : span[1]]
            shard = torch.zeros_like(rows)
        if compact:
            keep = (rows >= 0).nonzero().squeeze(1)
            rows, shard = rows[keep], shard[keep]
        return rows, shard

    def write(self, rows: torch.Tensor, shard: torch.Tensor, values: torch.Tensor | None) -> None:
        """Write `values` `[k, width]` (None: zeros) into the rows (-1: the shard's zero row, with zeros), through
        row grids over the storage: one per group of shards with one row stride, width and alignment (one in a
        TBE whose tables have one width)."""
        zero = self.ints[3][shard]
        for grid, row0, first in self.grids:
            r = torch.where(rows >= 0, rows, zero) + row0[shard]
            v = values[:, : grid.shape[1]].to(grid.dtype) if values is not None else None
            if len(self.grids) > 1:  # the entries of this group's shards
                mine = row0[shard] >= 0
                if rows.device.type == "cpu":
                    r, v = r[mine], (v[mine] if v is not None else None)
                else:
                    r = torch.where(mine, r, first)
                    v = torch.where(mine.unsqueeze(1), v, 0) if v is not None else None
            if v is None:
                grid.index_fill_(0, r, 0)
            else:
                grid.index_copy_(0, r, v)


def _storages(views: Sequence[torch.Tensor], shards: Sequence[LocalShard]) -> list[_Storage]:
    """One `_Storage` for all shards where their tensors are views of one storage with contiguous rows (a TBE's),
    else one per shard."""
    if len({v.untyped_storage().data_ptr() for v in views}) == 1 and all(v.dim() == 1 or v.stride(1) == 1
                                                                          for v in views):  # fmt: skip
        return [_Storage(views, range(len(views)), shards)]
    return [_Storage([v], [i], shards) for i, v in enumerate(views)]


class ResetOps:
    """The reset of a step's rows, mixed into `IdMap`."""

    shards: list[LocalShard]
    seed: int | None
    reset_kernel: str = "auto"
    """'auto': the Triton kernels on CUDA, torch ops elsewhere; 'triton' or 'torch' (tests)."""

    def storages(self, lookup: nn.Module) -> tuple[list[_Storage], list[_Storage]]:
        """(weights, optimizer states) of `lookup` as storages. Its shard tensors are taken once (updated in place,
        never replaced)."""
        if getattr(self, "_stores_of", None) != id(lookup):
            weights = [w.data for w in lookup.shard_weights()]
            states = [{k: v.data for k, v in st.items()} for st in lookup.shard_optimizer_states()]
            names = states[0] if states else {}
            self._stores = (
                _storages(weights, self.shards),
                [s for k in names for s in _storages([st[k] for st in states], self.shards)],
            )
            self._stores_of, self._keys_seed = id(lookup), None
        return self._stores

    def stream_keys(self, seed: int | None) -> list[int]:
        """The shards' stream keys (signed int64) of the rows' initial values: of `seed`, or (None: not
        reproducible) of a seed drawn on the host (no device sync), a fresh one per call."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        return [_signed(table_key(seed, s.table_index)) for s in self.shards]

    def reset(self, lookup: nn.Module, resets: Resets) -> None:
        """Re-initialise the rows of the reset list in `lookup`'s weights and zero their optimizer state; zero every
        shard's zero row. The lookup's shard tensors are taken once (updated in place, never replaced)."""
        w_stores, st_stores = self.storages(lookup)
        with torch.no_grad():
            for st in (*w_stores, *st_stores):
                st.flat.index_fill_(0, st.zero_elems, 0)
            if resets.rows is None:
                return
            dev = resets.rows.device
            if self.seed is None or self.seed != self._keys_seed:  # seed None: a fresh stream per step
                self._keys = small_to_device([self.stream_keys(self.seed)], dev)[0]
                self._keys_seed = self.seed
            triton = triton_for(self.reset_kernel, dev) and not any(st.round_fp16 for st in w_stores)
            if triton and resets.listed is not None:  # the Triton map step's compact list
                self._reset_listed(w_stores, st_stores, resets, self._keys)
                return
            compact = not triton and dev.type == "cpu"
            for st in w_stores:
                keys = self._keys[st.ids[0] : st.ids[-1] + 1]
                rows, shard = st.entries(resets, compact)
                if triton:
                    from embshard.kernels._reset_triton import reset_weights_batched_

                    reset_weights_batched_(st.flat, rows, shard, st.kernel_ints, st.scale, keys, max(st.width))
                else:  # in blocks of rows, their temporaries small enough to stay in cache
                    step = max(1, RESET_BLOCK_ELEMENTS // max(st.width))
                    for i in range(0, rows.numel(), step):
                        r, sh = rows[i : i + step], shard[i : i + step]
                        st.write(r, sh, _init_values(st, r, sh, keys))
            for st in st_stores:
                rows, shard = st.entries(resets, compact)
                if triton:
                    from embshard.kernels._reset_triton import zero_rows_batched_

                    zero_rows_batched_(st.flat, rows, shard, st.ints[:3], max(st.width))
                else:
                    st.write(rows, shard, None)

    def _reset_listed(
        self, w_stores: list[_Storage], st_stores: list[_Storage], resets: Resets, stream_keys: torch.Tensor
    ) -> None:
        """The reset on the Triton kernels that walk the list of positions given a row (`Resets.listed`): one
        launch per storage, whose programs return at once when the step gave no row. A storage's entries are those
        of its shards (read from `resets.shard` on the device: no host count, so a padded step's graph can replay
        it); `stream_keys` `[T]` the shards' stream keys."""
        from embshard.kernels._reset_triton import reset_listed_

        n = resets.rows.numel()
        for st in (*w_stores, *st_stores):
            span = (0, n, st.ids[0], len(st.ids))
            if st in w_stores:
                keys = stream_keys[st.ids[0] : st.ids[-1] + 1]
                ints, floats = st.kernel_ints, st.scale
            else:
                keys, ints, floats = None, st.ints[:3], None
            reset_listed_(st.flat, resets.listed, resets.rows, resets.shard, span, ints, floats, keys, max(st.width))


def _init_values(st: _Storage, rows: torch.Tensor, shard: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`[k, width]` fp32: the initial values `init_rows` gives the rows (`embshard.lookup.shards`: splitmix64 of the
    element's table index keyed by the table's key, its top 24 bits as u, then u x scale - bound in fp32), rows
    listed -1 zeros."""
    init, scale = st.init[:, shard], st.scale[:, shard]
    c = torch.arange(max(st.width), device=rows.device)
    z = ((rows + init[0]) * init[1] + init[2]).unsqueeze(1) + c  # the element's index in the table
    v = _uniform_of_index_(
        z, torch.empty_like(z), keys[shard].unsqueeze(1), scale[1].unsqueeze(1), scale[0].unsqueeze(1)
    )
    if st.round_fp16:
        v = torch.where(init[3].unsqueeze(1) > 0, v.half().float(), v)
    return torch.where((rows >= 0).unsqueeze(1), v, 0.0)
