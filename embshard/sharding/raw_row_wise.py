"""Row-wise sharding of raw-id tables (`TableConfig(ids="raw")`): the row-block engine (row_blocks.py) with ids
routed by hash instead of by value.

Data flow for one step, on every rank:
1. input dist: every raw id gets its virtual row `route_rows(id, rows)` (embshard/rawids/hashing.py), and FBGEMM's
   `block_bucketize_sparse_features` buckets the VIRTUAL rows by block exactly as it buckets a static table's ids
   (so blocks own ids in proportion to their rows); with `sequence=True` it also returns where each input id went
   (`unbucketize_permute`), which puts the RAW ids in bucket order (one scatter). The route permute and the
   counts exchange follow as for static tables; the counts also carry the ids per destination key, so the
   receiver knows on the host how many ids each of its shards gets (`LookupInput.key_ids`, no extra sync).
2. lookup: each rank maps the raw ids of its blocks to local rows with the blocks' `IdMap`s (routed.py), then
   pools them like any row-wise shard: partial sums `[B_global, D_me]`.
3. output dist: partial sums added up on the samples' ranks (row_blocks.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embshard.rawids.hashing import route_rows
from embshard.runtime.ops import cached_tensor, feature_of_ids, permute_2d, segment_sums, weights_or_ones
from embshard.sharding.base import ShardingContext, planned_as
from embshard.sharding.exchange import LocalBatch, LocalIds, SparseExchangeHandle
from embshard.sharding.row_blocks import RowBlockSharding
from embshard.spec.plan import ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import TableConfig


class RawRowBlockSharding(RowBlockSharding):
    """Raw-id tables cut into uniform row blocks; ids routed to the block holding their virtual row."""

    def __init__(
        self, entries: Sequence[tuple[int, TableConfig, TablePlan]], ctx: ShardingContext, name: str = "row_wise_raw"
    ) -> None:
        super().__init__(entries, ctx, name)
        rows = {f: cfg.num_embeddings for _, cfg, _ in entries for f in cfg.feature_names}
        self._rows_F = [rows[f] for f in self.in_features]
        W, k = self.world_size, max(self.n_features)
        self._width = 1 + k  # counts per destination: total, then per key (padded to k)
        self._pack_total = [d * self._width for d in range(W)]
        self._pack_keys = [d * self._width + 1 + j for d in range(W) for j in range(self.n_features[d])]

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """Bucket the local batch's raw ids by the block of their virtual row, destination-major; the counts per
        destination and per destination key are known only on the device (`exchange_counts` swaps them)."""
        lengths_FB, values = batch.lengths_FB, batch.values
        weights = weights_or_ones(values, batch.weights, self.weighted or self.every_id_weighted)
        B, W, F = lengths_FB.shape[1], self.world_size, len(self.in_features)
        dev = values.device
        n = int(batch.counts.ids[self.rank, self._cols].sum())
        if n == 0:  # nothing to bucket: FBGEMM's kernels need some ids
            send_lengths = lengths_FB.new_zeros(sum(self.n_features) * B)
            w = weights[:0] if weights is not None else None
            counts = torch.zeros(W, self._width, dtype=torch.int64, device=dev)
            return LocalIds(send_lengths, values[:0].to(torch.int64), w, None, None, counts)
        select, block_sizes, route = self._tensors(batch.feature_index, values.new_zeros(0, dtype=torch.int64))
        lengths_sel, values_sel, weights_sel = permute_2d(select, lengths_FB, values, weights, n)
        values_sel = values_sel.to(torch.int64)
        rows = cached_tensor(self._rows_F, dev)[feature_of_ids(lengths_sel.sum(1), n)]
        b_lengths, _, b_weights, _, unbucketize = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths_sel.reshape(-1), route_rows(values_sel, rows), False, True, block_sizes, W, weights_sel
        )
        b_values = torch.empty_like(values_sel).scatter_(0, unbucketize, values_sel)  # raw ids, bucket order
        send_lengths, send_values, send_weights = permute_2d(route, b_lengths.view(W * F, B), b_values, b_weights, n)
        send_lengths = send_lengths.reshape(-1)
        packed = torch.zeros(W * self._width, dtype=torch.int64, device=dev)
        packed[cached_tensor(self._pack_total, dev)] = segment_sums(send_lengths, [f * B for f in self.n_features])
        packed[cached_tensor(self._pack_keys, dev)] = segment_sums(send_lengths, [B] * sum(self.n_features))
        return LocalIds(send_lengths, send_values, send_weights, None, None, packed.view(W, self._width))

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> SparseExchangeHandle:
        """Send each rank the raw ids of its blocks, with the ids per key it receives (`exchange_counts`)."""
        if ids.key_ids is not None:
            ids.key_ids = ids.key_ids[: self.n_features[self.rank]]
        return super().start_input_dist(ids, batch_sizes)


def raw_row_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RawRowBlockSharding | None:
    """The row-wise raw-id part of the collection. None if no raw-id table is row-wise."""
    entries = [e for e in planned_as(tables, plan, ShardingType.ROW_WISE) if e[1].raw_ids]
    return RawRowBlockSharding(entries, ctx) if entries else None
