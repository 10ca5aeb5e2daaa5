"""Local lookups: the shards a rank holds, grouped into kernels with the sparse optimizer fused in.

Every lookup module has one contract: `forward(indices, offsets, weights) -> [B, sum of key widths]` pooled sums
for ids laid out feature-major (offsets of length F*B+1); `shard_weights()` / `shard_optimizer_states()` per shard;
`prefetch`, `drop_cache`, `cache_stats`, `reset_cache_stats` (no-ops without a cache: `NoCache`).

- `TBELookup` (tbe.py): one FBGEMM TBE per group of compatible shards (settings.py), any tier.
- `HostLookup` (host.py): CPU lookups FBGEMM's CPU TBE cannot do (Adam, weight decay).
- `DataParallelLookup` (replicas.py): full replicas, gradient all-reduced, the same update on every rank.
"""

from __future__ import annotations

from embshard.lookup.host import HostLookup
from embshard.lookup.shards import INIT_CHUNK_ROWS, LocalShard, group_shards, init_rows
from embshard.lookup.tbe import TBELookup

__all__ = ["INIT_CHUNK_ROWS", "HostLookup", "LocalShard", "TBELookup", "group_shards", "init_rows"]
