"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section; what differs between model kinds (the feature
groups, a retrieval catalog, the dense part, the loss) comes from the kind's file (registry.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.registry import StepOutput, model_kind
from embshard.runtime.guard import check_finite as check_all_finite
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions
from embshard.spec.plan import ShardingPlan

__all__ = ["RecModel", "StepOutput"]


class RecModel(nn.Module):
    """`ebc`: ShardedEmbeddingBagCollection (its optimizer is fused into backward; `options`: its LookupOptions);
    `catalog`: a retrieval catalog serving one table in a collection of its own, or None; `dense`: the dense part,
    wrapped in DistributedDataParallel when world_size > 1 (optimize `dense_parameters()` with torch.optim). Pass
    `dense` to use a dense module built elsewhere (e.g. a TorchRec model's, embshard.interop) instead of the kind's
    `build_dense`."""

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
        from embshard.collection.sharded import ShardedEmbeddingBagCollection

        self.cfg = cfg
        self.num_dense = num_dense
        self.kind = model_kind(cfg.kind)
        tables = list(cfg.tables)
        build_catalog = self.kind.build_catalog
        self.catalog = build_catalog(cfg, plan, sparse_optimizer, device, seed) if build_catalog else None
        if self.catalog is not None:
            tables = [t for t in tables if t.name != self.catalog.table.name]
            plan = replace(plan, tables=tuple(plan[t.name] for t in tables))
        groups = self.kind.output_groups(cfg) if self.kind.output_groups else None
        self.ebc = ShardedEmbeddingBagCollection(
            tables, plan, sparse_optimizer, output_groups=groups, device=device, seed=seed, options=options
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
        """The sharded embedding collections (the catalog's last, in catalog mode), for checkpoints."""
        return [self.ebc] + ([self.catalog.ebc] if self.catalog is not None else [])

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
