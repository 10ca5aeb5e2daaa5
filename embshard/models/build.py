"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section; what differs between model kinds (the feature
groups, a retrieval catalog, the dense part, the loss) comes from the kind's file (registry.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.registry import StepOutput, model_kind
from embshard.runtime.guard import check_finite as check_all_finite
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import BoundsCheck, LookupOptions
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import ConfigError, TableConfig

if TYPE_CHECKING:
    from embshard.collection.sequence import SequenceOutput

__all__ = ["RecModel", "StepOutput"]


class RecModel(nn.Module):
    """`ebc`: ShardedEmbeddingBagCollection (its optimizer is fused into backward; `options`: its LookupOptions);
    `catalog`: a retrieval catalog serving one table in a collection of its own, or None; `dense`: the dense part,
    wrapped in DistributedDataParallel when world_size > 1 (optimize `dense_parameters()` with torch.optim). Pass
    `dense` to use a dense module built elsewhere (e.g. a TorchRec model's, embshard.interop) instead of the kind's
    `build_dense`.

    Sequence tables (`pooling: none`) other than a catalog's are served by `ec`, a ShardedEmbeddingCollection under
    the same plan (its tables' entries), trained with the same fused optimizer; None without any. A kind's step
    reads them with `sequences(kjt)` (a SequenceOutput of the batch's sequence features) and hands `ebc` the
    pooled features only (`pooled(kjt)`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_dense: int,
        plan: ShardingPlan,
        sparse_optimizer: FusedOptimizerConfig,
        device: torch.device,
        world_size: int,
        seed: int = 0,
        options: LookupOptions | None = None,
        dense: nn.Module | None = None,
    ) -> None:
        super().__init__()
        from embshard.collection.sequence import ShardedEmbeddingCollection
        from embshard.collection.sharded import ShardedEmbeddingBagCollection

        self.cfg = cfg
        self.num_dense = num_dense
        self.kind = model_kind(cfg.kind)
        tables = list(cfg.tables)
        build_catalog = self.kind.build_catalog
        self.catalog = build_catalog(cfg, plan, sparse_optimizer, device, seed) if build_catalog else None
        if self.catalog is not None:
            tables = [t for t in tables if t.name != self.catalog.table.name]
        unplanned = sorted({t.table for t in plan.tables} - {t.name for t in cfg.tables})
        if unplanned:
            raise ConfigError(
                f"the plan has tables {unplanned} that model.tables does not list: plan again for the model's tables"
            )
        sequence = [t for t in tables if t.sequence]
        tables = [t for t in tables if not t.sequence]
        if sequence and not tables:
            raise ConfigError(
                f"model.tables: every table {[t.name for t in sequence]} is a sequence table (pooling: none); the "
                "model needs at least one pooled table (pooling: sum or mean) for its embedding-bag collection"
            )
        self.ec = None
        if sequence:
            seq_options = replace(options or LookupOptions(), bounds_check=BoundsCheck.ERROR)
            self.ec = ShardedEmbeddingCollection(
                sequence, _plan_of(plan, sequence), sparse_optimizer, device=device, seed=seed, options=seq_options
            )
        self.sequence_features = [f for t in sequence for f in t.feature_names]
        """The features served by `ec`, in table order (empty without sequence tables)."""
        self.pooled_features = [f for t in tables for f in t.feature_names]
        """The features served by `ebc`, in table order."""
        groups = self.kind.output_groups(cfg) if self.kind.output_groups else None
        self.ebc = ShardedEmbeddingBagCollection(
            tables,
            _plan_of(plan, tables),
            sparse_optimizer,
            output_groups=groups,
            device=device,
            seed=seed,
            options=options,
        )
        torch.manual_seed(seed)  # identical dense initialisation on every rank
        dense = (dense if dense is not None else self.kind.build_dense(cfg, num_dense)).to(device)
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets (no copy back after each
            # all-reduce, and no second copy of the gradients' memory)
            ids = [device.index] if device.type == "cuda" else None
            dense = DistributedDataParallel(dense, device_ids=ids, gradient_as_bucket_view=True)
        self.dense = dense

    def dense_module(self) -> nn.Module:
        """The dense part without its DistributedDataParallel wrapper (for checkpoints)."""
        return getattr(self.dense, "module", self.dense)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense.parameters())

    def collections(self) -> list[nn.Module]:
        """The sharded embedding collections (then the sequence collection, then the catalog's), for checkpoints."""
        ec = [self.ec] if self.ec is not None else []
        return [self.ebc, *ec] + ([self.catalog.ebc] if self.catalog is not None else [])

    def pooled(self, kjt):
        """`kjt`'s pooled features (those `ebc` looks up), in table order: `kjt` itself when it has no others."""
        keys = list(kjt.keys())
        if keys == self.pooled_features:
            return kjt
        return kjt.permute([keys.index(f) for f in self.pooled_features])

    def sequences(self, kjt) -> SequenceOutput | None:
        """The sequence collection's output for `kjt`'s sequence features ({feature: JaggedTensor}; collective, on
        every rank, empty batches included), or None when the model has no sequence tables."""
        if self.ec is None:
            return None
        keys = list(kjt.keys())
        return self.ec(kjt.permute([keys.index(f) for f in self.sequence_features]))

    def step(self, batch: Batch, check_finite: bool = False) -> StepOutput:
        """Forward and loss on this rank's batch. `check_finite`: raise `guard.NonFiniteError` on every rank
        (collective) if the loss or a pooled embedding is NaN or Inf, before any update (runtime.nan_check). The
        CUDA graphs of the training step are the training loop's (embshard/training/model_graphs.py)."""
        if not check_finite:
            return self.kind.step(self, batch)
        step, seen = self.ebc.step, []
        hook = self.ebc.register_forward_hook(lambda _m, _i, out: seen.append(out))
        try:
            out = self.kind.step(self, batch)
        finally:
            hook.remove()
        check_all_finite(step, out.loss, self.ebc, seen[-1])
        return out


def _plan_of(plan: ShardingPlan, tables: list[TableConfig]) -> ShardingPlan:
    """`plan` cut to `tables`' entries (each collection checks the plan of its own tables); `plan` itself when it has
    exactly those."""
    if {t.table for t in plan.tables} == {t.name for t in tables}:
        return plan
    return replace(plan, tables=tuple(plan[t.name] for t in tables))
