"""Local lookups: the shards a rank holds, grouped into kernels with the sparse optimizer fused in.

Every lookup module has one contract: `forward(indices, offsets, weights) -> [B, sum of key widths]` pooled sums
for ids laid out feature-major (offsets of length F*B+1); `shard_weights()` / `shard_optimizer_states()` per shard;
`prefetch`, `drop_cache`, `cache_stats`, `reset_cache_stats` (no-ops without a cache: `NoCache`).

- `TBELookup` (tbe.py): one FBGEMM TBE per group of compatible shards (settings.py), any tier.
- `HostLookup` (host.py): CPU lookups FBGEMM's CPU TBE cannot do (Adam, weight decay).
- `DataParallelLookup` (replicas.py): full replicas, gradient all-reduced, the same update on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard.lookup.host import HostLookup
from embshard.lookup.shards import INIT_CHUNK_ROWS, LocalShard, group_shards, init_rows
from embshard.lookup.tbe import TBELookup
from embshard.optim import FusedOptimizerConfig, OptimizerKind
from embshard.options import LookupOptions

__all__ = ["INIT_CHUNK_ROWS", "HostLookup", "LocalShard", "TBELookup", "build_lookups", "group_shards", "init_rows"]


def build_lookups(
    shards: Sequence[LocalShard],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    seed: int,
    options: LookupOptions | None = None,
) -> list[nn.Module]:
    """Group shards by settings, one lookup module per group (first-seen group order, shard order kept)."""
    use_host = device.type == "cpu" and (optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0)
    cls = HostLookup if use_host else TBELookup
    return [cls(g, optimizer, device, seed, options) for g in group_shards(shards)]
