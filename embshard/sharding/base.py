"""The seam between `ShardedEmbeddingBagCollection` and its sharding schemes.

`ShardingContext`: what every scheme and lookup of a collection is built with (one frozen value instead of eight
arguments). `Scheme`: what the collection calls on each scheme, every step, on every rank, in this order:

    ids  = scheme.local_ids(LocalBatch(lengths_FB, values, weights, feature_index, counts))  # lay out its ids
    h    = scheme.start_input_dist(ids, batch_sizes);  inp = h.wait()            # ids to the ranks that look up
    pooled = scheme.lookup(inp)                                                  # pooled sums, this rank's keys
    h    = scheme.start_output_dist(pooled, batch_sizes);  blocks = h.wait()     # back to the samples' ranks

and, optionally, `prefetch(inp)` (UVM caches) ahead of the lookup. A rank holding no shard of a scheme still
calls every step of it: the exchanges are collectives, and a rank that skipped one would leave the others waiting.

Output keys. A scheme's output columns are named by keys: a feature name, or for a column-wise table one key per
(feature, column block), `column_key(feature, col_offset)`; `key_feature` reads a key back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from embshard.sharding.exchange import LocalBatch, LocalIds, LookupInput
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions
from embshard.spec.plan import ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import TableConfig

COLUMN_SEPARATOR = "#c"


def column_key(feature: str, col_offset: int) -> str:
    """Output key of the column block starting at `col_offset` of `feature`'s table (column-wise sharding)."""
    return f"{feature}{COLUMN_SEPARATOR}{col_offset}"


def key_feature(key: str) -> tuple[str, int]:
    """(feature, first column) of an output key: `column_key`'s inverse, (key, 0) for a whole-feature key."""
    feature, _, col = key.partition(COLUMN_SEPARATOR)
    return feature, int(col or 0)


def planned_as(
    tables: Sequence[TableConfig], plan: ShardingPlan, sharding_type: ShardingType
) -> list[tuple[int, TableConfig, TablePlan]]:
    """(table index, table, plan) of the tables planned with `sharding_type`, in collection order."""
    return [(i, cfg, plan[cfg.name]) for i, cfg in enumerate(tables) if plan[cfg.name].sharding_type is sharding_type]


@dataclass(frozen=True)
class ShardingContext:
    """Everything a scheme and its lookups are built with, besides the tables and the plan."""

    rank: int
    """This process's rank in `group`."""
    world_size: int
    """Ranks in `group`."""
    device: torch.device
    """Compute device of this rank."""
    group: dist.ProcessGroup | None
    """Process group of the collection (None: the default group)."""
    optimizer: FusedOptimizerConfig
    """The sparse optimizer fused into every lookup's backward."""
    options: LookupOptions
    """Lookup numerics and runtime options."""
    seed: int | None
    """Seed of the deterministic initial weights (None: drawn on the device, not reproducible)."""
    columns: Mapping[str, int] = field(default_factory=dict)
    """Feature -> its column in `BatchCounts.ids` (the collection's canonical feature order)."""
    data_parallel_group: dist.ProcessGroup | None = None
    """The group data-parallel tables sum their gradients over (None: `group`); periodic 2D: the whole world."""


@dataclass(frozen=True)
class OutputLayout:
    """A scheme's output columns: keys with their widths, and the blocks its output dist returns."""

    keys: list[str]
    """Output keys, in the order of the scheme's columns."""
    key_dims: list[int]
    """Width of each key."""
    out_keys: list[list[str]]
    """Keys of each block `start_output_dist(...).wait()` returns, in order."""
    out_dims: list[list[int]]
    """Widths of those keys."""


class Ready:
    """A result that needs no communication, behind the same `.wait()` as the exchanges."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self):
        """Return the value."""
        return self._value


class Scheme(nn.Module):
    """One sharding scheme of a collection (the call order is in the module docstring). Subclasses set `layout`
    and `lookups` and implement the four steps; `prefetch` and the cache statistics have working defaults."""

    layout: OutputLayout
    lookups: nn.ModuleList
    local_output = False  # True where start_output_dist sends nothing (the pooled rows are already home)
    every_id_weighted = False  # every id sent and pooled with its weight (a padded batch): `weigh_every_id`

    def weigh_every_id(self, on: bool) -> None:
        """Send every id with its weight (the batch's, or 1 for a batch without weights) and have every lookup
        pool with the weights, also for tables without weights (`on`), or only the weighted tables' ids (not
        `on`, the default): a padded batch's filler ids weigh 0 (embshard/collection/padding.py)."""
        self.every_id_weighted = bool(on)
        for lk in self.lookups:
            lk.every_id_weighted = bool(on)

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """Lay out the local batch's ids for this scheme's input dist. `batch.lengths_FB` is the local batch's
        `[F, B]` bag lengths, rows in the order `batch.feature_index` gives; `batch.counts` every rank's sizes (no
        host sync needed)."""
        raise NotImplementedError

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]):
        """Start sending the ids to the ranks that look them up; the handle's `wait()` gives a `LookupInput`."""
        raise NotImplementedError

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums of this rank's keys for the batch `inp` covers (a tensor that requires grad on every rank,
        also with no lookup here, so that every rank runs the output dist's backward)."""
        raise NotImplementedError

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]):
        """Start sending the pooled rows back to the ranks owning the samples; the handle's `wait()` gives the
        blocks of `layout.out_keys`, each `[B_local, sum of its widths]`."""
        raise NotImplementedError

    def prefetch(self, inp: LookupInput, forward_stream: torch.cuda.Stream | None = None) -> None:
        """Load this batch's rows into the UVM caches ahead of its lookup (default: nothing to load)."""

    def cache_stats(self) -> dict[str, dict]:
        """UVM-cache statistics of this rank's tables of the scheme (lookup/stats.py)."""
        return {k: v for lk in self.lookups for k, v in lk.cache_stats().items()}

    def reset_cache_stats(self) -> None:
        """Zero the UVM-cache statistics of this rank's tables of the scheme."""
        for lk in self.lookups:
            lk.reset_cache_stats()
