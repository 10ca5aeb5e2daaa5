"""The row-block engine: tables cut into contiguous row blocks of one size `bs` (the last may be shorter), block i
on its planned rank. Row-wise (blocks over all ranks) and table-row-wise (blocks over one host's ranks) sharding
are this engine with different plans. Every rank that holds a block of a table serves all of that table's features.

Data flow for one step, on every rank:
1. input dist: the local batch's ids of the scheme's features are bucketed by block (`id // bs`) and rebased to
   the block (`id % bs`) by FBGEMM's `block_bucketize_sparse_features`, which lays them out bucket-major
   (block b: features x samples); per-sample weights follow their ids. A row permutation turns (block, feature)
   into (destination rank, feature) order, the sparse all-to-all's destination-major send layout. How many ids go
   to each rank is known only on the device: `exchange_counts` swaps those counts first (one small all-to-all).
2. lookup: each rank pools its blocks' rows for the global batch: partial sums `[B_global, D_me]` (routed.py).
3. output dist: the partial sums go back to the ranks owning the samples (pooled all-to-all) and each rank adds
   up, per feature, the partials from every rank holding a block (a reduce-scatter, written as all-to-all + sum
   so that it works with uneven batches, on gloo and NCCL alike). The sum runs rank by rank, so it is
   deterministic on every device.
Mean pooling divides by the whole bag's length afterwards (ShardedEmbeddingBagCollection does it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from embshard.lookup import LocalShard
from embshard.runtime.ops import cached_tensor, permute_2d, segment_sums, weights_or_ones
from embshard.sharding.base import OutputLayout, ShardingContext
from embshard.sharding.exchange import LocalBatch, LocalIds, PooledExchangeHandle
from embshard.sharding.routed import RoutedSharding
from embshard.spec.plan import TablePlan
from embshard.spec.tables import TableConfig


class SummedPooledHandle:
    """Partial pooled sums in flight; `wait()` returns their per-feature sum `[B_local, sum of feature dims]` (a
    one-block list, like every output dist)."""

    def __init__(self, handle: PooledExchangeHandle, cols_per_rank: list[torch.Tensor], width: int):
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

    `entries` lists (table index, table, its plan) for the tables of this scheme, in collection order.
    """

    def __init__(
        self, entries: Sequence[tuple[int, TableConfig, TablePlan]], ctx: ShardingContext, name: str = "row_wise"
    ) -> None:
        W = ctx.world_size
        shards_per_rank: list[list[LocalShard]] = [[] for _ in range(W)]
        features: list[str] = []
        block_size: dict[str, int] = {}
        block_of: dict[tuple[int, str], int] = {}  # (rank, feature) -> index of the block that rank holds
        dims: dict[str, int] = {}
        for i, cfg, tp in entries:
            blocks = sorted(tp.shards, key=lambda s: s.row_offset)
            for b, shard in enumerate(blocks):
                shards_per_rank[shard.rank].append(LocalShard.planned(cfg, i, shard, cfg.feature_names, tp))
                block_of.update({(shard.rank, f): b for f in cfg.feature_names})
            features += cfg.feature_names
            block_size.update({f: blocks[0].num_rows for f in cfg.feature_names})
            dims.update({f: cfg.embedding_dim for f in cfg.feature_names})
        # Output: one key per feature, summed over the ranks holding its blocks (one output block).
        key_dims = [dims[f] for f in features]
        layout = OutputLayout(list(features), key_dims, [list(features)], [key_dims])
        super().__init__(shards_per_rank, {f: f for f in features}, ctx, layout, name)
        self.in_features = features
        self._block_sizes = [block_size[f] for f in features]
        self._cols = np.array([ctx.columns[f] for f in features], dtype=np.int64)  # in BatchCounts.ids
        F = len(features)
        pos = {f: j for j, f in enumerate(features)}
        # Bucketize output row (block b, feature f) is b * F + f; the send order is (rank d, its route keys).
        self._route_rows = [block_of[(d, k)] * F + pos[k] for d in range(W) for k in self.route_keys[d]]
        col0 = dict(zip(features, np.cumsum([0] + key_dims[:-1]).tolist()))
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

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """Bucket the local batch's ids by row block, destination-major. How many go to each rank is known only
        on the device (`LocalIds.counts`): `exchange_counts` fills in `sent` / `received`."""
        lengths_FB, values = batch.lengths_FB, batch.values
        select, block_sizes, route = self._tensors(batch.feature_index, values)
        weights = weights_or_ones(values, batch.weights, self.weighted or self.every_id_weighted)
        B = lengths_FB.shape[1]
        W, F = self.world_size, len(self.in_features)
        n = int(batch.counts.ids[self.rank, self._cols].sum())
        if n == 0:  # no ids to bucket (an empty local batch, or empty bags only): FBGEMM's kernels need some
            send_lengths = lengths_FB.new_zeros(sum(self.n_features) * B)
            w = weights[:0] if weights is not None else None
            return LocalIds(send_lengths, values[:0], w, None, None, values.new_zeros(W, dtype=torch.int64))
        lengths_sel, values_sel, weights_sel = permute_2d(select, lengths_FB, values, weights, n)
        b_lengths, b_values, b_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths_sel.reshape(-1), values_sel, False, False, block_sizes, W, weights_sel
        )
        send_lengths, send_values, send_weights = permute_2d(route, b_lengths.view(W * F, B), b_values, b_weights, n)
        send_lengths = send_lengths.reshape(-1)
        device_counts = segment_sums(send_lengths, [f * B for f in self.n_features])
        return LocalIds(send_lengths, send_values, send_weights, None, None, device_counts)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> SummedPooledHandle:
        """Send partial sums back to the ranks owning the samples; `.wait()` adds them up per feature."""
        handle = super().start_output_dist(pooled, batch_sizes)
        if self._cols_per_rank[0].device != pooled.device:
            self._cols_per_rank = [c.to(pooled.device) for c in self._cols_per_rank]
        return SummedPooledHandle(handle, self._cols_per_rank, sum(self.layout.key_dims))
