"""The shards a rank holds (`LocalShard`), how they are grouped into kernels, and their deterministic initial rows.

A `LocalShard` is one block of a table (embshard.plan.Shard) on this rank plus the lookup keys that read it. Shards
with equal `group_key` share one kernel (one FBGEMM TBE: one tier, weight type, weighted-ness and cache policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embshard.plan import CacheAlgorithm, LookupKernel, MemoryTier, Shard, TablePlan
from embshard.tables import TableConfig

INIT_CHUNK_ROWS = 65536  # rows drawn per generator seed, so any row block initialises identically


def init_rows(
    cfg: TableConfig,
    table_index: int,
    row_offset: int,
    num_rows: int,
    col_offset: int,
    num_cols: int,
    seed: int | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Deterministic initial weights of rows [row_offset, +num_rows) x columns [col_offset, +num_cols).

    The same (seed, table_index) gives the same full table whichever block is asked for, so a sharded table
    starts identical to its unsharded twin. Values are uniform in [-cfg.init_bound, cfg.init_bound].
    `seed=None` draws on the device instead (fast for huge tables, not reproducible across shardings).
    """
    if seed is None:
        return torch.empty(num_rows, num_cols, device=device).uniform_(-cfg.init_bound, cfg.init_bound)
    out = torch.empty(num_rows, num_cols, dtype=torch.float32)
    gen = torch.Generator()  # always the CPU generator: the same numbers whatever device the shard lives on
    first, last = row_offset // INIT_CHUNK_ROWS, (row_offset + num_rows - 1) // INIT_CHUNK_ROWS
    for chunk in range(first, last + 1):
        c0 = chunk * INIT_CHUNK_ROWS
        c1 = min(c0 + INIT_CHUNK_ROWS, cfg.num_embeddings)
        gen.manual_seed(hash((seed, table_index, chunk)) & 0x7FFF_FFFF_FFFF)
        block = torch.empty(c1 - c0, cfg.embedding_dim).uniform_(-cfg.init_bound, cfg.init_bound, generator=gen)
        lo, hi = max(c0, row_offset), min(c1, row_offset + num_rows)
        out[lo - row_offset : hi - row_offset] = block[lo - c0 : hi - c0, col_offset : col_offset + num_cols]
    out = out.to(device)
    return out


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank holds, and the lookup features (in order) that read it."""

    table: TableConfig
    """The table the shard belongs to."""
    table_index: int
    """Index of the table in the collection (for deterministic initialisation)."""
    shard: Shard
    """The block of the table."""
    features: tuple[str, ...]
    """Lookup keys that read this shard, in lookup order."""
    tier: MemoryTier
    """Memory tier."""
    cache_load_factor: float = 0.2
    """UVM-caching cache size as a fraction of the shard's rows."""
    cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """UVM-caching replacement policy."""
    kernel: LookupKernel = LookupKernel.FBGEMM
    """Lookup kernel: FBGEMM's TBE or embshard's small-table kernel."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", MemoryTier(self.tier))
        object.__setattr__(self, "cache_algorithm", CacheAlgorithm(self.cache_algorithm))
        object.__setattr__(self, "kernel", LookupKernel(self.kernel))

    @classmethod
    def planned(
        cls, table: TableConfig, index: int, shard: Shard, features: Sequence[str], tp: TablePlan
    ) -> LocalShard:
        """The shard `shard` of `table` (collection index `index`), read by `features`, with its table plan's
        tier, cache settings and kernel."""
        return cls(table, index, shard, tuple(features), tp.tier, tp.cache_load_factor, tp.cache_algorithm, tp.kernel)

    @property
    def group_key(self) -> tuple:
        """Shards with equal keys share one kernel: one TBE has one tier, weight type, weighted-ness and
        (UVM-caching) one cache policy; cache sizes may differ (lookup/settings.py: the group's cache holds the sum)."""
        policy = self.cache_algorithm if self.tier is MemoryTier.UVM_CACHING else None
        return (self.tier, self.table.data_type, self.table.weighted, policy, self.kernel)


def group_shards(shards: Sequence[LocalShard]) -> list[list[LocalShard]]:
    """Shards grouped into TBEs by `group_key`: groups in first-seen order, shards in their order within."""
    groups: dict[tuple, list[LocalShard]] = {}
    for s in shards:
        groups.setdefault(s.group_key, []).append(s)
    return list(groups.values())
