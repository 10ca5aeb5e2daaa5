"""Lookup options: the numerics and runtime choices of a collection's embedding lookups (the same for every table).

Given as `ShardedEmbeddingBagCollection(options=...)`; they travel inside `ShardingContext` (sharding/base.py) to
every scheme and lookup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from embshard.spec.tables import ConfigError, set_enum_field

if TYPE_CHECKING:
    import torch


class OutputDtype(str, enum.Enum):
    """Dtype of the pooled embeddings."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    AUTO = "auto"  # bf16 where a training job's dense part runs in bf16 on CUDA GPUs, else fp32 (`resolved`)

    @property
    def concrete(self) -> OutputDtype:
        """The dtype itself; auto where nothing resolved it (`LookupOptions.resolved`): fp32."""
        return OutputDtype.FP32 if self is OutputDtype.AUTO else self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching torch dtype (auto: fp32, as `concrete`)."""
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.concrete.value]


class BoundsCheck(str, enum.Enum):
    """What to do with an id outside its table (negative, or not below the table's row count)."""

    ERROR = "error"  # raise, naming the feature, the table and the value
    DROP = "drop"  # remove the id from its bag, warn once per feature, count in ebc.dropped_ids()


class UnusedFeatures(str, enum.Enum):
    """What to do with a batch feature that no table looks up."""

    ERROR = "error"  # raise, naming the features
    IGNORE = "ignore"  # leave them out of the lookup (as TorchRec's EmbeddingBagCollection does)


@dataclass(frozen=True)
class LookupOptions:
    """Numerics and runtime options of the embedding lookups (the same for every table of a collection)."""

    output_dtype: OutputDtype = OutputDtype.AUTO
    """Dtype of the pooled embeddings the module returns: fp32, fp16 or bf16; auto: bf16 where `embshard train` runs
    the dense part in bf16 (training.precision bf16) on CUDA GPUs, else fp32 (and fp32 outside a training job)."""
    stochastic_rounding: bool = True
    """fp16 weights: round each updated weight stochastically (unbiased) rather than to the nearest fp16 value."""
    bounds_check: BoundsCheck = BoundsCheck.ERROR
    """Out-of-range ids: 'error' raises; 'drop' removes them from their bags, warns once per feature, counts them."""
    prefetch_pipeline: bool = False
    """UVM-caching: ebc.prefetch(next batch) also loads its rows into the caches, before the current backward (the
    training pipeline does this); LRU only; rows in use stay locked until their backward."""
    cache_stats: bool = False
    """Collect UVM-cache statistics for ebc.cache_stats() (a few device syncs per step per cached TBE)."""
    regroup: str = "auto"
    """Kernel of the feature-group regroup: fbgemm (permute_multi_embedding), triton (embshard/collection/regroup_kernel.py),
    or auto (triton on CUDA, fbgemm on the CPU)."""
    column_wise_exact: bool = True
    """Column-wise tables under rowwise_adagrad keep one state value per full row (the sum of g^2 over every column
    block, one small all-to-all among the blocks' ranks), so they train exactly like the unsharded table; false:
    one state value per row of each block, as TorchRec does (sharding/column_wise.py)."""
    unused_features: UnusedFeatures = UnusedFeatures.ERROR
    """Batch features that no table looks up: 'error' raises, naming them; 'ignore' leaves them out of the lookup,
    as TorchRec's EmbeddingBagCollection does (every feature a table names must still be in the batch)."""

    def __post_init__(self) -> None:
        set_enum_field(self, "output_dtype", OutputDtype, "lookup option ")
        set_enum_field(self, "bounds_check", BoundsCheck, "lookup option ")
        set_enum_field(self, "unused_features", UnusedFeatures, "lookup option ")
        if self.regroup not in ("auto", "fbgemm", "triton"):
            raise ConfigError(f"lookup option regroup={self.regroup!r} is invalid: choose one of auto, fbgemm, triton")
        for name in ("stochastic_rounding", "prefetch_pipeline", "cache_stats", "column_wise_exact"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"lookup option {name}={getattr(self, name)!r} is invalid: it must be true or false")

    def resolved(self, bf16: bool) -> LookupOptions:
        """These options with output_dtype auto made concrete: bf16 if `bf16` (the job's dense part runs in bf16 on
        CUDA GPUs), else fp32; other values unchanged."""
        if self.output_dtype is not OutputDtype.AUTO:
            return self
        return replace(self, output_dtype=OutputDtype.BF16 if bf16 else OutputDtype.FP32)


def counts_on_host(pipeline: str, bounds_check: BoundsCheck | str, catalog: bool) -> bool:
    """Whether a training job's steps take their batch counts from the host (embshard/training/pipeline.py: each batch
    counted on the CPU and the rows gathered over a CPU group, so the step has no device sync): under a pipeline
    that runs the input exchange ahead (training.pipeline sparse_dist or semi_sync), without a retrieval catalog
    (its model runs its own exchange in the forward) and with bounds_check error (drop removes ids on the device,
    which the host's counts would miss). Otherwise the forward gathers the counts on the device and syncs once
    (`sharding.exchange.gather_batch_counts`). The planner prices the step the same way (PlannerSettings.
    batch_counts)."""
    return pipeline != "none" and not catalog and BoundsCheck(bounds_check) is not BoundsCheck.DROP
