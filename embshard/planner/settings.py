"""Planner settings: the workload-side numbers and policies that are neither hardware (Topology) nor per-table
(ParameterConstraints)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from embshard.spec.plan import MemoryTier, ShardingType
from embshard.spec.tables import ConfigError, check_known_keys


@dataclass(frozen=True)
class PlannerSettings:
    """How the planner budgets memory, fills in missing hints and how hard it searches."""

    hbm_reserve_fraction: float = 0.10
    """Share of each GPU's memory kept free of embeddings (CUDA context, dense model, activations, allocator)."""
    hbm_reserve_gib: float | None = None
    """GPU memory kept free of embeddings per rank (GiB); when set it replaces hbm_reserve_fraction."""
    ddr_reserve_fraction: float = 0.15
    """Share of each rank's host memory kept free of embeddings (process, data loading, pinned buffers)."""
    cache_load_factor: float = 0.2
    """UVM-caching default: HBM cache rows as a fraction of the shard's rows (tables may override)."""
    zipf_alpha: float = 0.0
    """Default access skew for the cache hit-rate model: 0 = uniform ids (synthetic data), ~1 = click logs."""
    sharding_types: tuple[ShardingType, ...] = ()
    """Sharding types the planner may use for any table; empty: all."""
    tiers: tuple[MemoryTier, ...] = ()
    """Memory tiers the planner may use for any table; empty: all the compute device supports."""
    dp_kernels_per_table: float = 0.0
    """Extra kernel launches per data-parallel table per step (0: one batched kernel for all, as FBGEMM's)."""
    column_wise_exact: bool = True
    """Column-wise tables under rowwise_adagrad use the exact update (LookupOptions.column_wise_exact, the
    runtime's default): its backward passes and swap of row norms are counted."""
    small_table_kernel: bool = True
    """Let the planner give small, hot fp32 tables in GPU memory embshard's small-table kernel where it predicts a
    win (false: FBGEMM's TBE for every table)."""
    sequence_dedup: bool = False
    """Sequence tables (pooling none) deduplicate their ids before the exchange (ShardedEmbeddingCollection's
    dedup): their id and row exchanges are priced for the expected unique ids each rank sends a shard."""
    max_moves: int = 400
    """Local-search budget: at most this many candidate moves are evaluated after the greedy placement."""
    exact_limit: int = 20000
    """Search every assignment exactly when there are at most this many (small models); 0 turns it off."""
    memory_fill: float = 0.97
    """Tier assignment fills at most this share of the summed budgets (placement needs some slack)."""
    pooled_bytes: int | None = None
    """Bytes per pooled embedding element (the lookups' output, its exchange and its gradient): 4 for fp32, 2 for
    fp16/bf16 pooled rows; unset: a training job's lookup.output_dtype, else 4."""
    table_row_wise_exchange: Literal["auto", "flat", "hierarchical"] = "auto"
    """Output exchange of table-row-wise tables on several hosts: flat (one all-to-all over every rank),
    hierarchical (reduce inside each host, then one all-to-all between hosts), or auto (the one predicted faster)."""
    batch_counts: Literal["host", "device"] | None = None
    """Where each step's batch counts come from: host (counted on the CPU by the training pipeline: no device sync)
    or device (gathered on the GPUs: the topology's host_sync_s, 0.63 ms a step, charged); unset: as the training
    job runs (host unless training.pipeline is none, lookup.bounds_check drop or a retrieval catalog), else host."""
    whole_step_graph: bool | Literal["auto"] | None = None
    """Look first for a plan whose whole training step can be one CUDA graph (table-wise, column-wise and
    data-parallel tables, no UVM caching); if none fits, plan without those limits (the log says why); auto (GPUs):
    plan both ways, price the graph's plan as one replay and the other as an eager step, and keep the faster (the
    report's `graph_choice`); unset: as the training job runs (training.cuda_graph true: true; auto with
    training.precision bf16, with graph_scope step on CUDA GPUs: auto), else false."""

    split_hot_tables: bool = True
    """Hot tables, whose whole-table lookups (world size x ids per sample) exceed a balanced rank's (the ids per
    sample of every table), may only be row-wise (or table-row-wise on one host, or data-parallel): as one block
    their rank's lookups would grow with the world size (docs/planner.md, "Hot tables and 2D sharding"). false:
    every option, as for the other tables."""

    def __post_init__(self) -> None:
        def bad(fld: str, rule: str) -> ConfigError:
            return ConfigError(f"planner settings: {fld}={getattr(self, fld)!r} is invalid: {rule}")

        if not 0 <= self.hbm_reserve_fraction < 1:
            raise bad("hbm_reserve_fraction", "it must be in [0, 1)")
        if self.hbm_reserve_gib is not None and self.hbm_reserve_gib < 0:
            raise bad("hbm_reserve_gib", "it must be >= 0")
        if not 0 <= self.ddr_reserve_fraction < 1:
            raise bad("ddr_reserve_fraction", "it must be in [0, 1)")
        if not 0 < self.cache_load_factor <= 1:
            raise bad("cache_load_factor", "it must be in (0, 1]")
        if not 0 <= self.zipf_alpha <= 5:
            raise bad("zipf_alpha", "it must be in [0, 5]")
        if self.dp_kernels_per_table < 0:
            raise bad("dp_kernels_per_table", "it must be >= 0")
        if not isinstance(self.split_hot_tables, bool):
            raise bad("split_hot_tables", "it must be true or false")
        if not isinstance(self.small_table_kernel, bool):
            raise bad("small_table_kernel", "it must be true or false")
        if self.pooled_bytes not in (None, 2, 4):
            raise bad("pooled_bytes", "it must be 4 (fp32 pooled rows) or 2 (fp16/bf16)")
        if self.max_moves < 0:
            raise bad("max_moves", "it must be >= 0")
        if self.exact_limit < 0:
            raise bad("exact_limit", "it must be >= 0")
        if not 0.5 <= self.memory_fill <= 1:
            raise bad("memory_fill", "it must be in [0.5, 1]")
        value = getattr(self.table_row_wise_exchange, "value", self.table_row_wise_exchange)
        if value not in ("auto", "flat", "hierarchical"):
            raise bad("table_row_wise_exchange", "choose one of auto, flat, hierarchical")
        object.__setattr__(self, "table_row_wise_exchange", value)
        if self.batch_counts not in (None, "host", "device"):
            raise bad("batch_counts", "choose host (the training pipeline's) or device (one device sync a step)")
        if self.whole_step_graph not in (None, True, False, "auto"):
            raise bad(
                "whole_step_graph",
                "it must be true, false or auto (plan both ways, keep the faster; or unset: as the training job runs)",
            )
        object.__setattr__(self, "sharding_types", tuple(ShardingType(s) for s in self.sharding_types))
        object.__setattr__(self, "tiers", tuple(MemoryTier(t) for t in self.tiers))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "planner settings") -> PlannerSettings:
        """From plain data; unknown keys are an error naming `where` and the key."""
        check_known_keys(cls, data, where)
        try:
            return cls(**dict(data))
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
