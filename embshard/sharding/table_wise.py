"""Table-wise sharding: each table lives whole on one rank.

Data flow for one step, on every rank:
1. input dist: the local batch's ids of each table's features go to the table's rank (sparse all-to-all);
2. lookup: each rank pools its tables' rows for the global batch (one TBE per group of compatible tables);
3. output dist: pooled rows go back to the rank that owns each sample (pooled all-to-all).

`RoutedSharding` does this for any set of whole shards each read by named lookup keys, so column-wise sharding
(column blocks placed like tables) reuses it with one key per column block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embshard.lookup import LocalShard, build_lookups, group_shards
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.exchange import (
    BatchCounts,
    LocalIds,
    LookupInput,
    PooledExchangeHandle,
    SparseExchangeHandle,
    cached_tensor,
    route_matrix,
    start_pooled_exchange,
    start_sparse_exchange,
)
from embshard.tables import TableConfig, feature_columns
from embshard.tiers import LookupOptions


def group_in_lookup_order(shards: Sequence[LocalShard]) -> list[LocalShard]:
    """Shards reordered the way build_lookups groups them, so routes and lookups agree on feature order."""
    return [s for g in group_shards(shards) for s in g]


class RoutedSharding(nn.Module):
    """Whole shards placed on ranks; ids are routed to the shard's rank and pooled rows routed back.

    `shards_per_rank[d]` lists the shards on rank d (the same list on every rank); `key_source[k]` names the
    input feature whose ids lookup key k reads; `columns` is `feature_columns` of the collection's tables.
    """

    def __init__(
        self,
        shards_per_rank: Sequence[Sequence[LocalShard]],
        key_source: dict[str, str],
        columns: Mapping[str, int],
        rank: int,
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        self.rank, self.group = rank, group
        self.out_dtype = (options or LookupOptions()).output_dtype.torch_dtype
        self.world_size = len(shards_per_rank)
        ordered = [group_in_lookup_order(s) for s in shards_per_rank]
        self.route_keys = [[k for s in shards for k in s.features] for shards in ordered]
        self.route_sources = [[key_source[k] for k in keys] for keys in self.route_keys]
        self.sources = [f for srcs in self.route_sources for f in srcs]  # input feature of each route, send order
        self._routes = route_matrix(self.route_sources, columns)  # [F, W] keys of rank d reading feature f
        self._my_cols = np.array([columns[f] for f in self.route_sources[rank]], dtype=np.int64)  # my keys' sources
        self.n_features = [len(k) for k in self.route_keys]
        self.dims_per_rank = [sum(s.shard.num_cols * len(s.features) for s in shards) for shards in ordered]
        # Output keys (columns of the output tensor), rank by rank, with their widths.
        self.keys = [k for keys in self.route_keys for k in keys]
        self.key_dims = [s.shard.num_cols for shards in ordered for s in shards for _ in s.features]
        # The output dist's blocks: one per rank serving any key, with its keys and their widths.
        self.out_keys = [keys for keys, d in zip(self.route_keys, self.dims_per_rank) if d]
        self.out_dims = [[s.shard.num_cols for s in shards for _ in s.features] for shards in ordered if shards]
        self.lookups = nn.ModuleList(
            build_lookups(ordered[rank], optimizer, device, seed, options) if ordered[rank] else []
        )
        self.weighted = any(s.table.weighted for shards in ordered for s in shards)

    def local_ids(
        self,
        lengths_FB: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        feature_index: dict[str, int],
        counts: BatchCounts,
    ) -> LocalIds:
        """The local batch's ids of each rank's lookup keys, destination-major, with the ids sent to and received
        from every rank (from `counts`: no host sync). `lengths_FB` is the local batch's `[F, B]` lengths in the
        order `feature_index` gives."""
        sent = counts.ids[self.rank] @ self._routes  # [W] ids to each destination
        received = counts.ids @ self._routes[:, self.rank]  # [W] ids from each source
        perm = cached_tensor([feature_index[f] for f in self.sources], values.device, torch.int32)
        if weights is None and self.weighted:
            weights = torch.ones_like(values, dtype=torch.float32)
        send_lengths, send_values, send_weights = torch.ops.fbgemm.permute_2D_sparse_data(
            perm, lengths_FB, values, weights if self.weighted else None, int(sent.sum())
        )
        key_ids = counts.ids[:, self._my_cols].sum(0).tolist()  # per key of mine, over all sources
        return LocalIds(
            send_lengths.reshape(-1), send_values, send_weights, sent.tolist(), received.tolist(), key_ids=key_ids
        )

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> SparseExchangeHandle:
        """Send each rank the ids of its lookup keys."""
        return start_sparse_exchange(ids, self.n_features, batch_sizes, self.group, self.rank)

    def _split(self, inp: LookupInput) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(ids, offsets, weights) of each lookup: the feature-major input cut at group boundaries (where the ids
        per key are known on the host, no sync; else one)."""
        Bg = inp.global_batch
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(inp.lengths)
        if len(self.lookups) == 1:
            return [(inp.values, offsets, inp.weights)]
        f_bounds = [0]
        for lk in self.lookups:
            f_bounds.append(f_bounds[-1] + len(lk.features))
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
        if not self.lookups:
            # requires_grad: the backward of the output all-to-all must run here too, or the other ranks hang.
            return torch.zeros(inp.global_batch, 0, device=inp.values.device, dtype=self.out_dtype, requires_grad=True)
        if inp.parts is None:
            inp.parts = self._split(inp)
        outs = [lk(v, o, w) for lk, (v, o, w) in zip(self.lookups, inp.parts)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def prefetch(self, inp: LookupInput, forward_stream: torch.cuda.Stream | None = None) -> None:
        """Load this batch's rows into the UVM caches ahead of its forward (which must get the same `inp`)."""
        if self.lookups and inp.parts is None:
            inp.parts = self._split(inp)
        for lk, (v, o, _) in zip(self.lookups, inp.parts or []):
            lk.prefetch(v, o, forward_stream)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> PooledExchangeHandle:
        """Send pooled rows back to the ranks owning the samples."""
        return start_pooled_exchange(pooled, batch_sizes, self.dims_per_rank, self.group, self.rank)


def table_wise(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    rank: int,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    seed: int,
    options: LookupOptions | None = None,
) -> RoutedSharding | None:
    """The table-wise part of the collection: one shard per table on its planned rank. None if no table is
    table-wise."""
    shards_per_rank: list[list[LocalShard]] = [[] for _ in range(plan.world_size)]
    key_source: dict[str, str] = {}
    for i, cfg in enumerate(tables):
        tp = plan[cfg.name]
        if tp.sharding_type is not ShardingType.TABLE_WISE:
            continue
        (shard,) = tp.shards
        shards_per_rank[shard.rank].append(
            LocalShard(cfg, i, shard, cfg.feature_names, tp.tier, tp.cache_load_factor, tp.cache_algorithm)
        )
        key_source.update({f: f for f in cfg.feature_names})
    if not key_source:
        return None
    return RoutedSharding(
        shards_per_rank, key_source, feature_columns(tables), rank, optimizer, device, group, seed, options
    )
