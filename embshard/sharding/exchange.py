"""The two exchanges every model-parallel scheme uses.

Input: each rank sends, to each destination rank, the ids of the lookup features that rank serves for its own
local batch (`lengths` + `values` + optional `weights`); the destination receives them for the global batch.
Output: each rank sends the pooled rows of every source rank's samples back to it.

Layouts. A send buffer is destination-major: for destination d, `n_features[d]` features x B local samples of
lengths, followed by the next destination. The received batch is feature-major over the global batch: for each
of the rank's lookup features, the bags of rank 0's samples, then rank 1's, ... (`lengths_FBg`).
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
            bags = [b for b in self._batch_sizes for _ in range(F)]
            seg_bags = cached_tensor(bags, lengths.device)
            perm = cached_tensor([s * F + f for f in range(F) for s in range(W)], lengths.device, torch.int32)
            seg_ids = segment_sums(lengths, bags)
            _, lengths, _ = torch.ops.fbgemm.permute_1D_sparse_data(perm, seg_bags, lengths, None, lengths.numel())
            _, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
                perm, seg_ids, values, weights, values.numel()
            )  # the output size is known: no sync
        return LookupInput(lengths, values, weights, self._batch_sizes)


def start_sparse_exchange(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    n_features: Sequence[int],
    batch_size: int,
    group: dist.ProcessGroup | None,
    rank: int,
    bad_ids: torch.Tensor | None = None,
) -> SparseExchangeHandle:
    """Send each destination its ids. `n_features[d]` lookup features go to rank d (send layout in the module
    docstring). Exchanges the per-destination counts first (one small all-to-all and one host sync), then starts
    the lengths, ids and weights all-to-alls and returns without waiting for them.

    `bad_ids` (a device scalar: this rank's count of out-of-range ids) rides along with the counts, so the id check
    costs no sync of its own; if any rank reports some, every rank raises IdsOutOfRange before sending ids."""
    W = len(n_features)
    send_bags = [n * batch_size for n in n_features]
    send_ids = segment_sums(lengths, send_bags)
    flag = bad_ids.to(send_ids.dtype).expand_as(send_ids) if bad_ids is not None else torch.zeros_like(send_ids)
    # [W, 3] per destination: (local batch, ids sent, out-of-range ids of the sender)
    counts = torch.stack([torch.full_like(send_ids, batch_size), send_ids, flag], dim=1)
    recv_h = start_all_to_all(counts, [1] * W, [1] * W, group)
    both = torch.cat([recv_h.wait(), counts]).tolist()  # the one host sync: sizes for the next step
    recv, sent = both[:W], both[W:]
    bad_ranks = [r for r, row in enumerate(recv) if row[2]]
    if bad_ranks:
        raise IdsOutOfRange(bad_ranks)
    batch_sizes = [int(row[0]) for row in recv]
    recv_ids = [int(row[1]) for row in recv]
    F_me = n_features[rank]
    lengths_h = start_all_to_all(lengths, send_bags, [F_me * b for b in batch_sizes], group)
    send_ids_l = [int(row[1]) for row in sent]
    values_h = start_all_to_all(values, send_ids_l, recv_ids, group)
    weights_h = start_all_to_all(weights, send_ids_l, recv_ids, group) if weights is not None else None
    return SparseExchangeHandle(lengths_h, values_h, weights_h, F_me, batch_sizes)


class PooledExchangeHandle:
    """Pooled embeddings in flight back to the ranks that own the samples; `wait()` returns `[B_local, D]`."""

    def __init__(self, handle: AllToAllHandle, local_batch: int, dims_per_rank: Sequence[int]) -> None:
        self._handle = handle
        self._B = local_batch
        self._dims = list(dims_per_rank)

    def wait(self) -> torch.Tensor:
        """Wait, then lay the blocks from each rank side by side: columns of rank 0's features first."""
        flat = self._handle.wait()
        blocks = flat.split([self._B * d for d in self._dims])
        return torch.cat([b.view(self._B, d) for b, d in zip(blocks, self._dims)], dim=1)


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
