"""The routed engine: whole shards placed on ranks, ids routed to each shard's rank, pooled rows routed back.

Table-wise (whole tables) and column-wise (column blocks) sharding are this engine with different shards and keys;
row-wise builds on it (row_blocks.py). Data flow for one step, on every rank:
1. input dist: the local batch's ids of every lookup key go to the rank holding the key's shard (sparse
   all-to-all, destination-major: exchange.py), sized from the step's `BatchCounts` on the host (no sync);
2. lookup: each rank pools its shards' rows for the global batch (one lookup module per group of compatible
   shards, `embshard.lookup`), `[B_global, D_me]`;
3. output dist: pooled rows go back to the rank owning each sample (pooled all-to-all); one block per rank that
   serves any key.
Raw-id tables (embshard/rawids): before step 2 each raw-id lookup's ids go through its `IdMap` (ids -> local rows,
admitting new ids when training, resetting the rows it gives away).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from embshard.lookup import LocalShard, group_shards
from embshard.rawids.idmap import IdMap
from embshard.runtime.ops import cached_tensor, complete_cumsum, permute_2d, weights_or_ones
from embshard.sharding.base import OutputLayout, Scheme, ShardingContext
from embshard.sharding.exchange import (
    LocalBatch,
    LocalIds,
    LookupInput,
    PooledExchangeHandle,
    SparseExchangeHandle,
    route_matrix,
    start_pooled_exchange,
    start_sparse_exchange,
)
from embshard.sharding.lookups import build_lookups


def _raw(lookup: nn.Module) -> bool:
    return bool(lookup.shards) and lookup.shards[0].table.raw_ids


def group_in_lookup_order(shards: Sequence[LocalShard]) -> list[LocalShard]:
    """Shards reordered the way build_lookups groups them, so routes and lookups agree on key order."""
    return [s for g in group_shards(shards) for s in g]


def per_key_layout(shards_per_rank: Sequence[Sequence[LocalShard]]) -> OutputLayout:
    """One output column block per key, rank by rank; one output block per rank serving any key."""
    route_keys = [[k for s in shards for k in s.features] for shards in shards_per_rank]
    dims = [[s.shard.num_cols for s in shards for _ in s.features] for shards in shards_per_rank]
    return OutputLayout(
        keys=[k for keys in route_keys for k in keys],
        key_dims=[d for ds in dims for d in ds],
        out_keys=[keys for keys in route_keys if keys],
        out_dims=[ds for ds in dims if ds],
    )


class RoutedSharding(Scheme):
    """Whole shards on ranks; ids routed to the shard's rank and pooled rows routed back.

    `shards_per_rank[d]` lists the shards on rank d (the same list on every rank); `key_source[k]` names the input
    feature whose ids lookup key k reads. `layout`: the output columns (default: one per key, `per_key_layout`).
    """

    def __init__(
        self,
        shards_per_rank: Sequence[Sequence[LocalShard]],
        key_source: dict[str, str],
        ctx: ShardingContext,
        layout: OutputLayout | None = None,
        name: str = "table_wise",
    ) -> None:
        super().__init__()
        self.name = name
        self.rank, self.group = ctx.rank, ctx.group
        self.out_dtype = ctx.options.output_dtype.torch_dtype
        self.world_size = len(shards_per_rank)
        ordered = [group_in_lookup_order(s) for s in shards_per_rank]
        self.route_keys = [[k for s in shards for k in s.features] for shards in ordered]
        self.route_sources = [[key_source[k] for k in keys] for keys in self.route_keys]
        self.sources = [f for srcs in self.route_sources for f in srcs]  # input feature of each route, send order
        self._routes = route_matrix(self.route_sources, ctx.columns)  # [F, W] keys of rank d reading feature f
        self._my_cols = np.array([ctx.columns[f] for f in self.route_sources[ctx.rank]], dtype=np.int64)
        self.n_features = [len(k) for k in self.route_keys]
        self.dims_per_rank = [sum(s.shard.num_cols * len(s.features) for s in shards) for shards in ordered]
        self.layout = layout if layout is not None else per_key_layout(ordered)
        mine = ordered[ctx.rank]
        self.lookups = nn.ModuleList(build_lookups(mine, ctx.optimizer, ctx.device, ctx.seed, ctx.options))
        # Raw-id lookups (grouped apart: LocalShard.group_key) map their ids to rows first (embshard/rawids).
        self.idmaps = nn.ModuleDict(
            {str(i): IdMap(lk.shards, ctx.device, ctx.seed) for i, lk in enumerate(self.lookups) if _raw(lk)}
        )
        self.weighted = any(s.table.weighted for shards in ordered for s in shards)
        self._f_bounds = [0]  # where each lookup's features start in this rank's lookup keys (and the end)
        for lk in self.lookups:
            self._f_bounds.append(self._f_bounds[-1] + len(lk.features))

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """The local batch's ids of each rank's lookup keys, destination-major, with the ids sent to and received
        from every rank (from `batch.counts`: no host sync)."""
        ids = batch.counts.ids
        sent = ids[self.rank] @ self._routes  # [W] ids to each destination
        received = ids @ self._routes[:, self.rank]  # [W] ids from each source
        perm = cached_tensor([batch.feature_index[f] for f in self.sources], batch.values.device, torch.int32)
        weights = weights_or_ones(batch.values, batch.weights, self.weighted or self.every_id_weighted)
        send_lengths, send_values, send_weights = permute_2d(
            perm, batch.lengths_FB, batch.values, weights, int(sent.sum())
        )
        key_ids = ids[:, self._my_cols].sum(0).tolist()  # per key of mine, over all sources
        return LocalIds(
            send_lengths.reshape(-1), send_values, send_weights, sent.tolist(), received.tolist(), key_ids=key_ids
        )

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> SparseExchangeHandle:
        """Send each rank the ids of its lookup keys."""
        return start_sparse_exchange(ids, self.n_features, batch_sizes, self.group, self.rank, f"{self.name} ids")

    def _shard_ids(self, inp: LookupInput, i: int) -> list[int]:
        """Ids of each shard of lookup i in the global batch (host values: `inp.key_ids`)."""
        if inp.key_ids is None:
            raise RuntimeError(f"{self.name}: raw-id lookups need the ids per key on the host (LookupInput.key_ids)")
        counts = inp.key_ids[self._f_bounds[i] :]
        out, k = [], 0
        for s in self.lookups[i].shards:
            out.append(int(sum(counts[k : k + len(s.features)])))
            k += len(s.features)
        return out

    def _split(self, inp: LookupInput) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(ids, offsets, weights) of each lookup: the feature-major input cut at group boundaries (where the ids
        per key are known on the host, no sync; else one)."""
        Bg = inp.global_batch
        offsets = complete_cumsum(inp.lengths)
        if len(self.lookups) == 1:
            return [(inp.values, offsets, inp.weights)]
        f_bounds = self._f_bounds
        if inp.key_ids is not None:
            ends = np.concatenate([[0], np.cumsum(inp.key_ids)])
            v_bounds = [int(ends[f]) for f in f_bounds]
        else:
            v_bounds = offsets[torch.tensor([f * Bg for f in f_bounds], device=offsets.device)].tolist()  # sync
        parts = []
        for i in range(len(self.lookups)):
            f0, f1, v0, v1 = f_bounds[i], f_bounds[i + 1], v_bounds[i], v_bounds[i + 1]
            w = inp.weights[v0:v1] if inp.weights is not None else None
            parts.append((inp.values[v0:v1], offsets[f0 * Bg : f1 * Bg + 1] - v0, w))
        return parts

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums `[B_global, dims_per_rank[rank]]` for this rank's keys."""
        if not self.lookups or inp.global_batch == 0:
            if self.lookups and torch.is_grad_enabled():  # an empty global batch is still a training step
                for lk in self.lookups:
                    lk.optimizer_step += 1
                for idmap in self.idmaps.values():
                    idmap.tick()
            # requires_grad: the backward of the output all-to-all must run here too, or the other ranks hang.
            width = self.dims_per_rank[self.rank]
            return torch.zeros(inp.global_batch, width, device=inp.values.device, dtype=self.out_dtype).requires_grad_()
        if inp.parts is None:
            inp.parts = self._split(inp)
        outs = []
        for i, (lk, (v, o, w)) in enumerate(zip(self.lookups, inp.parts)):
            if str(i) in self.idmaps:  # raw ids -> rows (admitting new ids when training), rows reset
                v = self.idmaps[str(i)](v, self._shard_ids(inp, i), lk)
            outs.append(lk(v, o, w))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def prefetch(self, inp: LookupInput, forward_stream: torch.cuda.Stream | None = None) -> None:
        """Load this batch's rows into the UVM caches ahead of its forward (which must get the same `inp`)."""
        if not self.lookups or inp.global_batch == 0:
            return
        if inp.parts is None:
            inp.parts = self._split(inp)
        for lk, (v, o, _) in zip(self.lookups, inp.parts):
            lk.prefetch(v, o, forward_stream)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> PooledExchangeHandle:
        """Send pooled rows back to the ranks owning the samples."""
        label = f"{self.name} pooled"
        return start_pooled_exchange(pooled, batch_sizes, self.dims_per_rank, self.group, self.rank, label)
