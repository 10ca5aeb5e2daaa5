"""The two exchanges every model-parallel scheme uses.

Input: each rank sends, to each destination rank, the ids of the lookup features that rank serves for its own
local batch (`lengths` + `values` + optional `weights`); the destination receives them for the global batch.
Output: each rank sends the pooled rows of every source rank's samples back to it.

Layouts. A send buffer is destination-major: for destination d, `n_features[d]` features x B local samples of
lengths, followed by the next destination. The received batch is feature-major over the global batch: for each
of the rank's lookup features, the bags of rank 0's samples, then rank 1's, ... (`lengths_FBg`; a scheme may ask
for the sources in another order: the hierarchical table-row-wise exchange groups them by local rank).

Host syncs. One all-gather of every rank's batch size, ids per feature and out-of-range id count
(`gather_batch_counts`) and one host sync size every buffer and every id all-to-all of the step (a training
pipeline gathers the same counts on the host, from the CPU batch, over a CPU group: no device sync). Row-wise schemes
learn their per-destination counts only after bucketing the ids on the device: `exchange_counts` moves those in
one more small all-to-all and sync (only when the plan has row-wise tables).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import numpy as np
import torch
import torch.distributed as dist

from embshard.runtime.comm import AllToAllHandle, start_all_gather, start_all_to_all
from embshard.runtime.ops import cached_tensor, permute_1d, permute_2d, segment_sums


@dataclass
class LookupInput:
    """Ids for a rank's lookup features over the global batch, feature-major."""

    lengths: torch.Tensor
    """`[F * B_global]` bag lengths (int)."""
    values: torch.Tensor
    """Ids, concatenated in bag order (int64)."""
    weights: torch.Tensor | None
    """Per-id weights, or None."""
    batch_sizes: list[int]
    """Local batch size of every source rank; B_global is their sum."""
    parts: list | None = None
    """Per-lookup (ids, offsets, weights), cut once by the scheme so prefetch and lookup see the same tensors."""
    key_ids: list[int] | None = None
    """Ids per lookup feature over the global batch, when the host knows them (cuts `values` without a sync)."""

    @property
    def global_batch(self) -> int:
        """Samples in the global batch."""
        return sum(self.batch_sizes)


class RanksOutOfStep(RuntimeError):
    """The ranks called the collection at different steps; raised on every rank at the same point."""

    def __init__(self, steps: list[int]) -> None:
        super().__init__(
            f"the ranks are at different steps of the embedding collection (rank: step) "
            f"{dict(enumerate(steps))}: every rank must call forward once per step, with an empty local batch "
            "(0 samples) if it has no data, and the same number of evaluation batches"
        )
        self.steps = steps


class IdsOutOfRange(ValueError):
    """Some rank's local batch has ids outside their tables; raised on every rank at the same point."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(
            f"ranks {ranks} have ids outside their tables in their local batch (each of those ranks raises an "
            "error naming the feature, the table and the value); every rank stops here so none waits forever"
        )
        self.ranks = ranks


@dataclass
class BatchCounts:
    """Every rank's local batch size and ids per feature this step, on the host (`gather_batch_counts`)."""

    batch_sizes: list[int]
    """Local batch size of every rank."""
    ids: np.ndarray
    """`[W, F]` ids of each rank's local batch per feature, features in the canonical order (`feature_columns`)."""
    bad_ranks: list[int]
    """Ranks that found out-of-range ids in their local batch."""


def counts_row(ids_F: torch.Tensor, batch_size: int, bad: torch.Tensor | None, step: int) -> torch.Tensor:
    """This rank's row of the step's counts table: `[batch size, out-of-range ids, step, ids per feature...]` (int64,
    on `ids_F`'s device; `ids_F` in the canonical feature order)."""
    head = cached_tensor([batch_size, 0], ids_F.device)  # constant per batch size: made once, no per-step copy
    step_1 = torch.full((1,), step, dtype=torch.int64, device=ids_F.device)  # a fill: no host-to-device copy
    row = torch.cat([head, step_1, ids_F.to(torch.int64)])  # a new tensor
    if bad is not None:
        row[1:2] = bad.reshape(1)
    return row


def parse_counts(table: np.ndarray) -> BatchCounts:
    """Every rank's `counts_row`, stacked `[W, 3 + F]` (on the host), as BatchCounts; raises `RanksOutOfStep` on
    every rank when the ranks' steps differ."""
    steps = [int(s) for s in table[:, 2]]
    if len(set(steps)) > 1:
        raise RanksOutOfStep(steps)
    return BatchCounts(
        batch_sizes=[int(b) for b in table[:, 0]],
        ids=table[:, 3:],
        bad_ranks=[r for r in range(table.shape[0]) if table[r, 1]],
    )


def gather_batch_counts(
    ids_F: torch.Tensor,
    batch_size: int,
    bad: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    step: int = 0,
) -> BatchCounts:
    """One all-gather of every rank's (batch size, out-of-range id count, step, ids per feature), then one host
    sync: every id exchange of the step can be sized from these on the host (row-wise bucketing aside). `ids_F` is
    this rank's `[F]` ids per feature in the canonical order; `step` the collection's step, which every rank must
    agree on (`RanksOutOfStep` on every rank otherwise). A training pipeline computes the rows on the host from the
    CPU batch and gathers them over a CPU group instead (`ShardedEmbeddingBagCollection.host_counts`): no device
    sync at all."""
    row = counts_row(ids_F, batch_size, bad, step)
    table = start_all_gather(row, group, "batch counts all-gather").wait(host=True).cpu().numpy()  # the host sync
    return parse_counts(table)


@dataclass(frozen=True)
class LocalBatch:
    """This rank's local batch as every scheme's `local_ids` reads it (one value instead of five arguments)."""

    lengths_FB: torch.Tensor
    """`[F, B]` bag lengths of the local batch, rows in the order `feature_index` gives."""
    values: torch.Tensor
    """Ids, concatenated in bag order (int64)."""
    weights: torch.Tensor | None
    """Per-id weights (same layout as `values`), or None."""
    feature_index: dict[str, int]
    """Feature -> its row of `lengths_FB` (the batch's key order)."""
    counts: BatchCounts
    """Every rank's batch size and ids per feature this step, on the host (no host sync needed)."""


def route_matrix(sources_per_rank: Sequence[Sequence[str]], column: Mapping[str, int]) -> np.ndarray:
    """`[F, W]`: how many of rank d's lookup keys read feature f (the ids of f go to d that many times)."""
    m = np.zeros((len(column), len(sources_per_rank)), dtype=np.int64)
    for d, sources in enumerate(sources_per_rank):
        for f in sources:
            m[column[f], d] += 1
    return m


@dataclass
class LocalIds:
    """One scheme's ids of the local batch laid out for sending (routed schemes: destination-major; local
    schemes: feature-major), with how many go to, and come from, each rank."""

    lengths: torch.Tensor
    """`[sum(n_features) * B]` bag lengths."""
    values: torch.Tensor
    """The ids in that order."""
    weights: torch.Tensor | None
    """Per-id weights (same layout as `values`), or None."""
    sent: list[int] | None
    """Ids sent to each rank (local schemes: `[total]`); None until `exchange_counts` fills it in from `counts`."""
    received: list[int] | None
    """Ids received from each rank; None until `exchange_counts` fills it in."""
    counts: torch.Tensor | None = None
    """`[W]` ids per destination on the device, when the host cannot know them (row-wise bucketing); `[W, 1 + k]`
    with the ids per lookup key of each destination too (raw-id row-wise: the receiver cuts its ids per shard)."""
    key_ids: list[int] | None = None
    """Ids this rank receives per lookup feature (summed over sources), when the host knows them."""


def exchange_counts(parts: Sequence[LocalIds], group: dist.ProcessGroup | None, world_size: int) -> None:
    """Fill in `sent` / `received` of the parts whose counts only the device knows: one small all-to-all of all
    their counts and one host sync. A part's `counts` is `[W]` ids per destination, or `[W, 1 + k]`: the ids per
    destination, then per lookup key of the destination (padded to k); those also fill in `key_ids` (ids this
    rank receives per key of its own, summed over sources, padded to k)."""
    W = world_size
    cols = [p.counts.to(torch.int64).reshape(W, -1) for p in parts]  # [W destinations, width]
    table = torch.cat(cols, dim=1)
    recv = (
        start_all_to_all(table, [1] * W, [1] * W, group, "row-block id counts all-to-all").wait(host=True)
        if W > 1
        else table
    )
    both = torch.cat([recv, table], dim=1).t().tolist()  # the host sync
    K, c0 = table.shape[1], 0
    for p, c in zip(parts, cols):
        p.received, p.sent = [int(x) for x in both[c0]], [int(x) for x in both[K + c0]]
        if c.shape[1] > 1:
            p.key_ids = [int(sum(both[c0 + j])) for j in range(1, c.shape[1])]
        c0 += c.shape[1]


class SparseExchangeHandle:
    """Ids in flight to the ranks that look them up; `wait()` returns the rank's `LookupInput`."""

    def __init__(
        self,
        lengths: AllToAllHandle,
        values: AllToAllHandle,
        weights: AllToAllHandle | None,
        n_local_features: int,
        batch_sizes: list[int],
        key_ids: list[int] | None = None,
        source_order: Sequence[int] | None = None,
    ) -> None:
        self._lengths, self._values, self._weights = lengths, values, weights
        self._F = n_local_features
        self._batch_sizes = batch_sizes
        self._key_ids = key_ids
        order = list(source_order) if source_order is not None else list(range(len(batch_sizes)))
        self._order = order if order != list(range(len(batch_sizes))) else None

    def wait(self) -> LookupInput:
        """Wait for lengths, ids and weights, and reorder them from source-major to feature-major (sources in rank
        order, or in `source_order`)."""
        lengths = self._lengths.wait()
        values = self._values.wait()
        weights = self._weights.wait() if self._weights is not None else None
        W, F = len(self._batch_sizes), self._F
        if W > 1 and F > 0 and (F > 1 or self._order is not None):
            # Received segments are (source s, feature f) of B_s bags each; reorder them to (f, s).
            order = self._order or range(W)
            perm = cached_tensor([s * F + f for f in range(F) for s in order], lengths.device, torch.int32)
            if len(set(self._batch_sizes)) == 1:  # a [W*F, B] grid: FBGEMM's 2-D permute (fast, one row a block)
                lengths_2d, values, weights = permute_2d(
                    perm, lengths.view(W * F, self._batch_sizes[0]), values, weights, values.numel()
                )
                lengths = lengths_2d.reshape(-1)
            else:
                bags = [b for b in self._batch_sizes for _ in range(F)]
                seg_ids = segment_sums(lengths, bags)
                lengths, _ = permute_1d(perm, cached_tensor(bags, lengths.device), lengths)
                values, weights = permute_1d(perm, seg_ids, values, weights)  # output sizes known: no sync
        return LookupInput(lengths, values, weights, self._batch_sizes, key_ids=self._key_ids)


def start_sparse_exchange(
    ids: LocalIds,
    n_features: Sequence[int],
    batch_sizes: Sequence[int],
    group: dist.ProcessGroup | None,
    rank: int,
    label: str = "ids",
    source_order: Sequence[int] | None = None,
) -> SparseExchangeHandle:
    """Send each destination its ids (`n_features[d]` lookup features go to rank d; send layout in the module
    docstring), with the sizes in `ids.sent` / `ids.received`; returns without waiting. `source_order`: the order
    of the source ranks' samples in each received feature (default: rank order)."""
    B = batch_sizes[rank]
    F_me = n_features[rank]
    splits = ([f * B for f in n_features], [F_me * b for b in batch_sizes])
    lengths_h = start_all_to_all(ids.lengths, *splits, group, f"{label} lengths all-to-all")
    values_h = start_all_to_all(ids.values, ids.sent, ids.received, group, f"{label} all-to-all")
    weights_h = None
    if ids.weights is not None:
        weights_h = start_all_to_all(ids.weights, ids.sent, ids.received, group, f"{label} weights all-to-all")
    return SparseExchangeHandle(lengths_h, values_h, weights_h, F_me, list(batch_sizes), ids.key_ids, source_order)


class PooledExchangeHandle:
    """Pooled embeddings in flight back to the ranks that own the samples; `wait()` returns one `[B_local, D_d]`
    block per source rank d with D_d > 0, in rank order (views of the received buffer: no copy)."""

    def __init__(self, handle: AllToAllHandle, local_batch: int, dims_per_rank: Sequence[int]) -> None:
        self._handle = handle
        self._B = local_batch
        self._dims = list(dims_per_rank)

    def wait(self) -> list[torch.Tensor]:
        """Wait, then view the received buffer as the blocks of each source rank, in rank order."""
        flat = self._handle.wait()
        blocks = flat.split([self._B * d for d in self._dims])
        return [b.view(self._B, d) for b, d in zip(blocks, self._dims) if d]


def start_pooled_exchange(
    pooled: torch.Tensor,
    batch_sizes: Sequence[int],
    dims_per_rank: Sequence[int],
    group: dist.ProcessGroup | None,
    rank: int,
    label: str = "pooled",
) -> PooledExchangeHandle:
    """Send rows of `pooled` `[B_global, D_me]` (source-rank order) back to their ranks; D_d is rank d's width."""
    D_me = dims_per_rank[rank]
    B_me = batch_sizes[rank]
    splits = ([b * D_me for b in batch_sizes], [B_me * d for d in dims_per_rank])
    handle = start_all_to_all(pooled.reshape(-1), *splits, group, f"{label} all-to-all")
    return PooledExchangeHandle(handle, B_me, dims_per_rank)
