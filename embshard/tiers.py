"""Memory tiers: which FBGEMM TBE settings a group of shards gets, lookup options, and UVM-cache statistics.

A rank's shards are grouped into TBEs by `LocalShard.group_key` (tier, weight type, weighted-ness and, for
UVM-caching, the cache algorithm: one TBE has one cache and one replacement policy). `tbe_settings` derives one
group's settings as plain data (a pure function: testable without a GPU); `TBESettings.fbgemm_kwargs` turns them
into SplitTableBatchedEmbeddingBagsCodegen arguments.

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

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embshard.plan import MemoryTier
from embshard.tables import ConfigError, DataType

if TYPE_CHECKING:
    import torch

    from embshard.lookup import LocalShard
    from embshard.sharding.exchange import LookupInput


class OutputDtype(str, enum.Enum):
    """Dtype of the pooled embeddings."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching torch dtype."""
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]


class BoundsCheck(str, enum.Enum):
    """What to do with an id outside its table (negative, or not below the table's row count)."""

    ERROR = "error"  # raise, naming the feature, the table and the value
    DROP = "drop"  # remove the id from its bag, warn once per feature, count in ebc.dropped_ids()


@dataclass(frozen=True)
class LookupOptions:
    """Numerics and runtime options of the embedding lookups (the same for every table of a collection)."""

    output_dtype: OutputDtype = OutputDtype.FP32
    """Dtype of the pooled embeddings the module returns: fp32, fp16 or bf16."""
    stochastic_rounding: bool = True
    """fp16 weights: round each updated weight stochastically (unbiased) rather than to the nearest fp16 value."""
    bounds_check: BoundsCheck = BoundsCheck.ERROR
    """Out-of-range ids: 'error' raises; 'drop' removes them from their bags, warns once per feature, counts them."""
    prefetch_pipeline: bool = False
    """Allow ebc.prefetch(next batch) before the current backward (UVM-caching, LRU only; locks rows in use)."""
    cache_stats: bool = False
    """Collect UVM-cache statistics for ebc.cache_stats() (a few device syncs per step per cached TBE)."""

    def __post_init__(self) -> None:
        for name, enum_type in (("output_dtype", OutputDtype), ("bounds_check", BoundsCheck)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum_type(value))
            except ValueError:
                raise ConfigError(
                    f"lookup option {name}={value!r} is invalid: choose one of {[e.value for e in enum_type]}"
                ) from None
        for name in ("stochastic_rounding", "prefetch_pipeline", "cache_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"lookup option {name}={getattr(self, name)!r} is invalid: it must be true or false")


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
    """FBGEMM BoundsCheckMode: FATAL on CUDA (the module already checks ids), NONE on CPU."""
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
    out = options.output_dtype.value
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
        bounds_check_mode="NONE" if device_type == "cpu" else "FATAL",
        cache_algorithm=first.cache_algorithm.value.upper() if caching else None,
        cache_rows=sum(math.ceil(s.shard.num_rows * s.cache_load_factor) for s in shards) if caching else 0,
        prefetch_pipeline=caching and options.prefetch_pipeline,
        cache_stats=caching and options.cache_stats,
    )


# ---- UVM-cache statistics -------------------------------------------------------------------------------------
def summarize_cache_stats(
    settings: TBESettings,
    requested_F: Sequence[int],
    misses_F: Sequence[int],
    tbe_counters: Sequence[int],
    cached_rows_T: Sequence[int],
    occupied_base: int,
    cache_slots: int,
) -> dict[str, dict[str, Any]]:
    """Per-table statistics of one UVM-caching TBE, from counters accumulated since the last reset.

    `requested_F` / `misses_F`: ids looked up and unique cache misses (rows fetched from UVM) per feature;
    `tbe_counters`: FBGEMM's six TBE-wide counters (calls, requested, unique, unique misses, conflict unique
    misses, conflict misses); `cached_rows_T`: each shard's rows now in the cache; `occupied_base`: slots
    occupied at the last reset; `cache_slots`: rows the cache holds. Evictions are TBE-wide (the cache is
    shared): rows inserted minus slots newly filled, exact for LRU, None for LFU (FBGEMM counts no insertions).
    """
    T = len(settings.tables)
    req_T, miss_T = [0] * T, [0] * T
    for f, t in enumerate(settings.feature_table_map):
        req_T[t] += int(requested_F[f])
        miss_T[t] += int(misses_F[f])
    lru = settings.cache_algorithm == "LRU"
    inserted = int(tbe_counters[3]) - int(tbe_counters[4]) if lru else None
    occupied = sum(int(c) for c in cached_rows_T)
    evictions = inserted - (occupied - occupied_base) if inserted is not None else None
    out: dict[str, dict[str, Any]] = {}
    for t, name in enumerate(settings.tables):
        out[name] = {
            "requested": req_T[t],
            "unique_misses": miss_T[t],
            "hit_rate": 1.0 - miss_T[t] / req_T[t] if req_T[t] else None,
            "cached_rows": int(cached_rows_T[t]),
            "rows": settings.rows[t],
            "cache_group": list(settings.tables),
            "group_cache_slots": cache_slots,
            "group_evictions": evictions,
        }
    return out


def format_cache_stats(stats: dict[str, dict[str, Any]]) -> str:
    """One line per table, for logs."""
    lines = []
    for name, s in stats.items():
        hit = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        ev = "n/a" if s["group_evictions"] is None else str(s["group_evictions"])
        lines.append(
            f"cache {name}: hit {hit} ({s['unique_misses']} misses / {s['requested']} ids), "
            f"{s['cached_rows']} of {s['rows']} rows cached, group evictions {ev}"
        )
    return "\n".join(lines)


@dataclass
class PrefetchHandle:
    """The next batch, already sent to the ranks that look it up and (UVM-caching) loaded into the caches.
    Pass it to `ebc(kjt, prefetched=handle)` with the same kjt, once."""

    kjt: Any
    """The batch it was made for (checked by identity)."""
    lengths_FB: torch.Tensor
    """`[F, B]` bag lengths after the bounds check (mean pooling divides by these)."""
    feature_index: dict[str, int]
    """Feature -> row of lengths_FB."""
    inputs: list[LookupInput]
    """Each scheme's received ids."""
    stream: Any = None
    """The CUDA stream the prefetch ran on, or None (the current stream)."""
    used: bool = False
    """Set once forward consumed it."""
