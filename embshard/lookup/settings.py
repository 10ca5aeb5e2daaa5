"""Which FBGEMM TBE settings a group of shards gets, as plain data (testable without a GPU).

A rank's shards are grouped into TBEs by `LocalShard.group_key` (tier, weight type, weighted-ness and, for
UVM-caching, the cache algorithm: one TBE has one cache and one replacement policy). `tbe_settings` derives one
group's settings (a pure function); `TBESettings.fbgemm_kwargs` turns them into SplitTableBatchedEmbeddingBagsCodegen
arguments.

Tier -> FBGEMM EmbeddingLocation: hbm -> DEVICE, uvm -> MANAGED, uvm_caching -> MANAGED_CACHING (CUDA compute),
host -> HOST (CPU compute). Optimizer state follows FBGEMM's placement rule: with the table for hbm and host;
for uvm and uvm_caching, per-element state (adagrad, adam moments) lives in UVM next to the weights and is never
cached, while row-wise state (rowwise_adagrad: 4 bytes a row) lives in HBM.

Cache size: FBGEMM sizes a TBE's cache as a fraction of the TBE's total rows. Tables grouped into one TBE may ask
for different fractions (TablePlan.cache_load_factor), so the group's cache holds the sum of the rows each table
asks for, rounded up to whole cache sets (32 rows a set on CUDA). The cache is shared: a hot table may hold more
than its share. Every slot is as wide as the widest table of the group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from embshard.lookup.shards import LocalShard
from embshard.spec.options import LookupOptions
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError, DataType

_LOCATION = {
    MemoryTier.HBM: "DEVICE",
    MemoryTier.UVM: "MANAGED",
    MemoryTier.UVM_CACHING: "MANAGED_CACHING",
    MemoryTier.HOST: "HOST",
}


@dataclass(frozen=True)
class TBESettings:
    """Everything that decides how one TBE is built, as plain data (names of FBGEMM enum members)."""

    tables: tuple[str, ...]
    """Table of each shard, in shard order."""
    rows: tuple[int, ...]
    """Rows of each shard."""
    dims: tuple[int, ...]
    """Columns of each shard."""
    feature_table_map: tuple[int, ...]
    """For each lookup feature, the index of the shard it reads."""
    location: str
    """FBGEMM EmbeddingLocation of every shard: DEVICE, MANAGED, MANAGED_CACHING or HOST."""
    compute_device: str
    """FBGEMM ComputeDevice: CUDA or CPU."""
    weights_precision: str
    """Weight storage type: fp32 or fp16 (the cache stores the same type)."""
    output_dtype: str
    """Dtype the TBE kernel produces: fp32, fp16 or bf16."""
    cast_output_to: str | None
    """Dtype the lookup casts the kernel's output to (CPU kernels have no bf16 output), or None."""
    stochastic_rounding: bool
    """Stochastic rounding of fp16 weight updates and cache write-backs."""
    bounds_check_mode: str
    """FBGEMM BoundsCheckMode: NONE. Every id is checked once before any exchange, on the rank that owns the batch
    (embshard/collection/bounds.py: on the host in the training pipeline, on the device otherwise), so the error names the
    feature; a second check inside the TBE would cost a kernel per lookup and find nothing."""
    cache_algorithm: str | None
    """UVM-caching: LRU or LFU; None otherwise."""
    cache_rows: int
    """UVM-caching: rows the cache should hold, the sum over shards of ceil(rows x cache_load_factor); else 0."""
    prefetch_pipeline: bool
    """UVM-caching: build for explicit prefetch before the previous backward (lock cached rows in use)."""
    cache_stats: bool
    """UVM-caching: gather cache statistics (TBE-wide counters and per-feature misses)."""

    @property
    def caching(self) -> bool:
        """Whether this TBE has an HBM cache."""
        return self.location == "MANAGED_CACHING"

    def cache_sets(self, assoc: int = 32) -> int:
        """Cache sets of `assoc` rows holding at least `cache_rows` rows (0 without a cache)."""
        return math.ceil(self.cache_rows / assoc) if self.caching else 0

    def cache_bytes(self, assoc: int = 32) -> int:
        """HBM taken by the cache's rows (each slot as wide as the widest shard)."""
        elem = DataType(self.weights_precision).bytes
        return self.cache_sets(assoc) * assoc * max(self.dims) * elem

    def fbgemm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for SplitTableBatchedEmbeddingBagsCodegen (without optimizer and device)."""
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            CacheAlgorithm,
            EmbeddingLocation,
            PoolingMode,
            RecordCacheMetrics,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import DEFAULT_ASSOC, ComputeDevice

        sparse = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "bf16": SparseType.BF16}
        loc, compute = EmbeddingLocation[self.location], ComputeDevice[self.compute_device]
        kwargs: dict[str, Any] = {
            "embedding_specs": [(r, d, loc, compute) for r, d in zip(self.rows, self.dims)],
            "feature_table_map": list(self.feature_table_map),
            "pooling_mode": PoolingMode.SUM,
            "weights_precision": sparse[self.weights_precision],
            "output_dtype": sparse[self.output_dtype],
            "stochastic_rounding": self.stochastic_rounding,
            "bounds_check_mode": BoundsCheckMode[self.bounds_check_mode],
            "table_names": list(self.tables),
        }
        if self.caching:
            kwargs.update(
                cache_algorithm=CacheAlgorithm[self.cache_algorithm],
                cache_sets=self.cache_sets(DEFAULT_ASSOC),
                prefetch_pipeline=self.prefetch_pipeline,
                gather_uvm_cache_stats=self.cache_stats,
                record_cache_metrics=RecordCacheMetrics(False, self.cache_stats),
            )
        return kwargs


def tbe_settings(shards: Sequence[LocalShard], options: LookupOptions, device_type: str) -> TBESettings:
    """The settings of the TBE holding `shards` (one group key) on a `device_type` ('cuda' or 'cpu') device."""
    keys = {s.group_key for s in shards}
    if len(keys) != 1:
        raise ValueError(f"one TBE holds shards of one group key, got {sorted(map(str, keys))}")
    first = shards[0]
    tier = first.tier
    names = [s.table.name for s in shards]
    if device_type == "cpu" and tier is not MemoryTier.HOST:
        raise ConfigError(
            f"tables {names}: memory tier {tier.value!r} needs a GPU, but this process computes on the CPU: plan "
            "with tier 'host' for CPU training, or run on GPUs"
        )
    if device_type != "cpu" and tier is MemoryTier.HOST:
        raise ConfigError(
            f"tables {names}: memory tier 'host' is for CPU training, but this process computes on {device_type}: "
            "plan with tier hbm, uvm or uvm_caching"
        )
    for s in shards:
        if s.shard.num_cols % 4:
            raise ConfigError(
                f"table {s.table.name!r}: a shard is {s.shard.num_cols} columns wide; FBGEMM's TBE needs a "
                "multiple of 4: change embedding_dim or the column split"
            )
    caching = tier is MemoryTier.UVM_CACHING
    if caching and options.prefetch_pipeline and first.cache_algorithm.value != "lru":
        raise ConfigError(
            f"tables {names} use cache_algorithm 'lfu', but prefetch_pipeline needs 'lru' (FBGEMM locks cached rows "
            "only for LRU): plan them with cache_algorithm 'lru' or turn prefetch_pipeline off"
        )
    out = options.output_dtype.concrete.value
    cast = None
    if device_type == "cpu" and out == "bf16":
        out, cast = "fp32", "bf16"  # FBGEMM's CPU kernel has no bf16 output
    return TBESettings(
        tables=tuple(names),
        rows=tuple(s.shard.num_rows for s in shards),
        dims=tuple(s.shard.num_cols for s in shards),
        feature_table_map=tuple(i for i, s in enumerate(shards) for _ in s.features),
        location=_LOCATION[tier],
        compute_device="CPU" if device_type == "cpu" else "CUDA",
        weights_precision=first.table.data_type.value,
        output_dtype=out,
        cast_output_to=cast,
        stochastic_rounding=options.stochastic_rounding,
        bounds_check_mode="NONE",
        cache_algorithm=first.cache_algorithm.value.upper() if caching else None,
        cache_rows=sum(math.ceil(s.shard.num_rows * s.cache_load_factor) for s in shards) if caching else 0,
        prefetch_pipeline=caching and options.prefetch_pipeline,
        cache_stats=caching and options.cache_stats,
    )
