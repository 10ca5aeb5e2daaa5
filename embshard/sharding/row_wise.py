"""Row-wise sharding: a table's rows cut into contiguous blocks of one size `bs` (the last may be shorter),
block i on its planned rank. Every rank that holds a block of a table serves all of that table's features.

Data flow for one step, on every rank:
1. input dist: the local batch's ids of the scheme's features are bucketed by block (`id // bs`) and rebased to
   the block (`id % bs`) by FBGEMM's `block_bucketize_sparse_features`, which lays them out bucket-major
   (block b: features x samples); per-sample weights follow their ids. A row permutation turns (block, feature)
   into (destination rank, feature) order, which is the sparse all-to-all's destination-major send layout.
2. lookup: each rank pools its blocks' rows for the global batch: partial sums `[B_global, D_me]`.
3. output dist: the partial sums go back to the ranks owning the samples (pooled all-to-all) and each rank adds
   up, per feature, the partials from every rank holding a block (a reduce-scatter, written as all-to-all + sum
   so that it works with uneven batches, on gloo and NCCL alike). The sum runs rank by rank, so it is
   deterministic on every device.
Mean pooling divides by the whole bag's length afterwards (ShardedEmbeddingBagCollection does it).

`RowBlockSharding` only needs each table's blocks and their ranks, so table-row-wise sharding (blocks over the
ranks of one host) is the same class fed with other tables (see table_row_wise.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from embshard.lookup import LocalShard
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan, ShardingType, TablePlan
from embshard.sharding.exchange import BatchCounts, LocalIds, PooledExchangeHandle, cached_tensor, segment_sums
from embshard.sharding.table_wise import RoutedSharding
from embshard.tables import TableConfig, feature_columns
from embshard.tiers import LookupOptions


class SummedPooledHandle:
    """Partial pooled sums in flight; `wait()` returns their per-feature sum `[B_local, sum of feature dims]` (a
    one-block list, like every output dist)."""

    def __init__(self, handle: PooledExchangeHandle, cols_per_rank: list, width: int):
        self._handle = handle
        self._cols = [c for c in cols_per_rank if c.numel()]  # the blocks wait() returns: ranks with a block
        self._width = width

    def wait(self) -> list[torch.Tensor]:
        """Wait for every rank's partials, then add each rank's block into its features' columns."""
        blocks = self._handle.wait()
        B, dtype = blocks[0].shape[0], blocks[0].dtype
        out = blocks[0].new_zeros(B, self._width, dtype=torch.float32)  # sum in fp32
        for block, cols in zip(blocks, self._cols):
            out = out.index_add(1, cols, block.float())  # cols unique within a rank: deterministic
        return [out.to(dtype)]


class RowBlockSharding(RoutedSharding):
    """Tables cut into uniform row blocks; ids bucketed by block, partial sums added up after the output dist.

    `entries` lists (table index, table, its plan) for the tables of this scheme, in collection order; `columns`
    is `feature_columns` of the collection's tables.
    """

    def __init__(
        self,
        entries: Sequence[tuple[int, TableConfig, TablePlan]],
        columns: Mapping[str, int],
        world_size: int,
        rank: int,
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int | None,
        options: LookupOptions | None = None,
    ) -> None:
        shards_per_rank: list[list[LocalShard]] = [[] for _ in range(world_size)]
        features: list[str] = []
        block_size: dict[str, int] = {}
        block_of: dict[tuple[int, str], int] = {}  # (rank, feature) -> index of the block that rank holds
        dims: dict[str, int] = {}
        for i, cfg, tp in entries:
            blocks = sorted(tp.shards, key=lambda s: s.row_offset)
            for b, shard in enumerate(blocks):
                shards_per_rank[shard.rank].append(
                    LocalShard(cfg, i, shard, cfg.feature_names, tp.tier, tp.cache_load_factor, tp.cache_algorithm)
                )
                block_of.update({(shard.rank, f): b for f in cfg.feature_names})
            features += cfg.feature_names
            block_size.update({f: blocks[0].num_rows for f in cfg.feature_names})
            dims.update({f: cfg.embedding_dim for f in cfg.feature_names})
        super().__init__(
            shards_per_rank, {f: f for f in features}, columns, rank, optimizer, device, group, seed, options
        )
        # Output: one key per feature, summed over the ranks holding its blocks.
        self.in_features = features
        self.keys = list(features)
        self.key_dims = [dims[f] for f in features]
        self._block_sizes = [block_size[f] for f in features]
        self.out_keys, self.out_dims = [self.keys], [self.key_dims]  # one block: the partial sums added up
        self._cols = np.array([columns[f] for f in features], dtype=np.int64)  # in BatchCounts.ids
        F = len(features)
        pos = {f: j for j, f in enumerate(features)}
        # Bucketize output row (block b, feature f) is b * F + f; the send order is (rank d, its route keys).
        self._route_rows = [block_of[(d, k)] * F + pos[k] for d in range(world_size) for k in self.route_keys[d]]
        col0 = dict(zip(features, [sum(self.key_dims[:j]) for j in range(F)]))
        self._cols_per_rank = [
            torch.tensor([c for k in keys for c in range(col0[k], col0[k] + dims[k])], dtype=torch.int64)
            for keys in self.route_keys
        ]

    def _tensors(self, feature_index: dict[str, int], values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Feature selection permute, block sizes (the ids' dtype, as FBGEMM needs) and route permute."""
        dev = values.device
        return (
            cached_tensor([feature_index[f] for f in self.in_features], dev, torch.int32),
            cached_tensor(self._block_sizes, dev, values.dtype),
            cached_tensor(self._route_rows, dev, torch.int32),
        )

    def local_ids(
        self,
        lengths_FB: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        feature_index: dict[str, int],
        counts: BatchCounts,
    ) -> LocalIds:
        """Bucket the local batch's ids by row block, destination-major. How many go to each rank is known only
        on the device (`LocalIds.counts`): `exchange_counts` fills in `sent` / `received`."""
        select, block_sizes, route = self._tensors(feature_index, values)
        if weights is None and self.weighted:
            weights = torch.ones_like(values, dtype=torch.float32)
        weights = weights if self.weighted else None
        B = lengths_FB.shape[1]
        n = int(counts.ids[self.rank, self._cols].sum())
        lengths_sel, values_sel, weights_sel = torch.ops.fbgemm.permute_2D_sparse_data(
            select, lengths_FB, values, weights, n
        )
        b_lengths, b_values, b_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths_sel.reshape(-1), values_sel, False, False, block_sizes, self.world_size, weights_sel
        )
        send_lengths, send_values, send_weights = torch.ops.fbgemm.permute_2D_sparse_data(
            route, b_lengths.view(self.world_size * len(self.in_features), B), b_values, b_weights, n
        )
        send_lengths = send_lengths.reshape(-1)
        device_counts = segment_sums(send_lengths, [f * B for f in self.n_features])
        return LocalIds(send_lengths, send_values, send_weights, None, None, device_counts)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> SummedPooledHandle:
        """Send partial sums back to the ranks owning the samples; `.wait()` adds them up per feature."""
        handle = super().start_output_dist(pooled, batch_sizes)
        if self._cols_per_rank[0].device != pooled.device:
            self._cols_per_rank = [c.to(pooled.device) for c in self._cols_per_rank]
        return SummedPooledHandle(handle, self._cols_per_rank, sum(self.key_dims))


def row_block_entries(
    tables: Sequence[TableConfig], plan: ShardingPlan, sharding_type: ShardingType
) -> list[tuple[int, TableConfig, TablePlan]]:
    """(table index, table, plan) of the tables planned with `sharding_type`, in collection order."""
    return [(i, cfg, plan[cfg.name]) for i, cfg in enumerate(tables) if plan[cfg.name].sharding_type is sharding_type]


def row_wise(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    rank: int,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    seed: int | None,
    options: LookupOptions | None = None,
) -> RowBlockSharding | None:
    """The row-wise part of the collection: row blocks over all ranks. None if no table is row-wise."""
    entries = row_block_entries(tables, plan, ShardingType.ROW_WISE)
    if not entries:
        return None
    return RowBlockSharding(
        entries, feature_columns(tables), plan.world_size, rank, optimizer, device, group, seed, options
    )
