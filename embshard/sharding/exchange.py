"""The two exchanges every model-parallel scheme uses.

Input: each rank sends, to each destination rank, the ids of the lookup features that rank serves for its own
local batch (`lengths` + `values` + optional `weights`); the destination receives them for the global batch.
Output: each rank sends the pooled rows of every source rank's samples back to it.

Layouts. A send buffer is destination-major: for destination d, `n_features[d]` features x B local samples of
lengths, followed by the next destination. The received batch is feature-major over the global batch: for each
of the rank's lookup features, the bags of rank 0's samples, then rank 1's, ... (`lengths_FBg`).

Host syncs. Every scheme first lays out its ids on the device (`LocalIds`) with buffers sized for the whole local
batch, so nothing waits for the host; `exchange_counts` then moves every scheme's per-destination counts (and the
out-of-range id count of the check) in one small all-to-all and reads them with one sync; the id all-to-alls then
start with known sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.distributed as dist

from embshard.comm import AllToAllHandle, start_all_to_all


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

    @property
    def global_batch(self) -> int:
        """Samples in the global batch."""
        return sum(self.batch_sizes)


class IdsOutOfRange(ValueError):
    """Some rank's local batch has ids outside their tables; raised on every rank at the same point."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(
            f"ranks {ranks} have ids outside their tables in their local batch (each of those ranks raises an "
            "error naming the feature, the table and the value); every rank stops here so none waits forever"
        )
        self.ranks = ranks


_DEVICE_CACHE: dict[tuple, torch.Tensor] = {}


def cached_tensor(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A device copy of a small constant list, made once per (values, device, dtype): no per-step copy."""
    key = (tuple(values), str(device), dtype)
    t = _DEVICE_CACHE.get(key)
    if t is None:
        if len(_DEVICE_CACHE) > 4096:
            _DEVICE_CACHE.clear()
        t = _DEVICE_CACHE[key] = torch.tensor(list(values), device=device, dtype=dtype)
    return t


def segment_sums(lengths: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Sums of consecutive segments of `lengths` with the given sizes (on the same device, no sync)."""
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    bounds = cached_tensor(ends, lengths.device)
    csum = torch.cat([lengths.new_zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])
    return csum[bounds[1:]] - csum[bounds[:-1]]


@dataclass
class LocalIds:
    """One scheme's ids of the local batch laid out for sending, before their sizes are known on the host.

    Routed schemes: destination-major (module docstring); local (data-parallel) schemes: feature-major."""

    lengths: torch.Tensor
    """`[sum(n_features) * B]` bag lengths (exact size)."""
    values: torch.Tensor
    """The ids in that order. May be longer than the real ids (allocated for the whole batch, so that no host sync
    is needed to size it); the real ones are the first `sum(counts)`, cut once the counts are on the host."""
    weights: torch.Tensor | None
    """Per-id weights (same layout and length as `values`), or None."""
    counts: torch.Tensor
    """`[W]` ids per destination rank (routed schemes) or `[1]` ids in total (local schemes), int64, on device."""


@dataclass
class Counts:
    """What every rank sends this step, known on the host after `exchange_counts` (the step's one host sync)."""

    batch_sizes: list[int]
    """Local batch size of every source rank."""
    sent: list[list[int]]
    """Per scheme: ids this rank sends to each destination (local schemes: their total, repeated)."""
    received: list[list[int]]
    """Per scheme: ids this rank receives from each source rank."""
    bad_ranks: list[int]
    """Ranks that found out-of-range ids in their local batch."""


def exchange_counts(
    counts: Sequence[torch.Tensor],
    batch_size: int,
    bad: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    world_size: int,
) -> Counts:
    """One small all-to-all of every scheme's per-destination id counts, the local batch size and the count of
    out-of-range ids, then one host sync for all of them (the step's only one when every scheme's sizes can be
    bounded without the host). `counts[k]` is scheme k's `[W]` or `[1]` counts (LocalIds.counts)."""
    W = world_size
    device = counts[0].device
    cols = [torch.full((W,), batch_size, dtype=torch.int64, device=device)]
    cols.append(bad.to(torch.int64).reshape(-1).expand(W) if bad is not None else cols[0].new_zeros(W))
    cols += [c.to(torch.int64).reshape(-1).expand(W) for c in counts]
    table = torch.stack(cols, dim=1)  # [W destinations, 2 + schemes]
    recv = start_all_to_all(table, [1] * W, [1] * W, group).wait() if W > 1 else table
    both = torch.cat([recv, table]).tolist()  # the host sync
    recv_rows, sent_rows = both[:W], both[W:]
    K = len(counts)
    return Counts(
        batch_sizes=[int(r[0]) for r in recv_rows],
        sent=[[int(r[2 + k]) for r in sent_rows] for k in range(K)],
        received=[[int(r[2 + k]) for r in recv_rows] for k in range(K)],
        bad_ranks=[s for s, r in enumerate(recv_rows) if r[1]],
    )


class SparseExchangeHandle:
    """Ids in flight to the ranks that look them up; `wait()` returns the rank's `LookupInput`."""

    def __init__(
        self,
        lengths: AllToAllHandle,
        values: AllToAllHandle,
        weights: AllToAllHandle | None,
        n_local_features: int,
        batch_sizes: list[int],
    ) -> None:
        self._lengths, self._values, self._weights = lengths, values, weights
        self._F = n_local_features
        self._batch_sizes = batch_sizes

    def wait(self) -> LookupInput:
        """Wait for lengths, ids and weights, and reorder them from source-major to feature-major."""
        lengths = self._lengths.wait()
        values = self._values.wait()
        weights = self._weights.wait() if self._weights is not None else None
        W, F = len(self._batch_sizes), self._F
        if W > 1 and F > 1:
            # Received segments are (source s, feature f) of B_s bags each; reorder them to (f, s).
            perm = cached_tensor([s * F + f for f in range(F) for s in range(W)], lengths.device, torch.int32)
            if len(set(self._batch_sizes)) == 1:  # a [W*F, B] grid: FBGEMM's 2-D permute (fast, one row a block)
                lengths_2d, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                    perm, lengths.view(W * F, self._batch_sizes[0]), values, weights, values.numel()
                )
                lengths = lengths_2d.reshape(-1)
            else:
                bags = [b for b in self._batch_sizes for _ in range(F)]
                seg_bags = cached_tensor(bags, lengths.device)
                seg_ids = segment_sums(lengths, bags)
                _, lengths, _ = torch.ops.fbgemm.permute_1D_sparse_data(perm, seg_bags, lengths, None, lengths.numel())
                _, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
                    perm, seg_ids, values, weights, values.numel()
                )  # the output size is known: no sync
        return LookupInput(lengths, values, weights, self._batch_sizes)


def start_sparse_exchange(
    ids: LocalIds,
    n_features: Sequence[int],
    batch_sizes: Sequence[int],
    sent: Sequence[int],
    received: Sequence[int],
    group: dist.ProcessGroup | None,
    rank: int,
) -> SparseExchangeHandle:
    """Send each destination its ids (`n_features[d]` lookup features go to rank d; send layout in the module
    docstring), with the sizes `exchange_counts` made known; returns without waiting."""
    B = batch_sizes[rank]
    n = sum(sent)
    values = ids.values[:n]  # a prefix view: the real ids (no copy)
    weights = ids.weights[:n] if ids.weights is not None else None
    F_me = n_features[rank]
    lengths_h = start_all_to_all(ids.lengths, [f * B for f in n_features], [F_me * b for b in batch_sizes], group)
    values_h = start_all_to_all(values, sent, received, group)
    weights_h = start_all_to_all(weights, sent, received, group) if weights is not None else None
    return SparseExchangeHandle(lengths_h, values_h, weights_h, F_me, list(batch_sizes))


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
) -> PooledExchangeHandle:
    """Send rows of `pooled` `[B_global, D_me]` (source-rank order) back to their ranks; D_d is rank d's width."""
    D_me = dims_per_rank[rank]
    B_me = batch_sizes[rank]
    handle = start_all_to_all(
        pooled.reshape(-1), [b * D_me for b in batch_sizes], [B_me * d for d in dims_per_rank], group
    )
    return PooledExchangeHandle(handle, B_me, dims_per_rank)
