"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section; what differs between model kinds (the feature
groups, the dense part, the loss) comes from the kind's file (registry.py)."""

from __future__ import annotations

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.registry import StepOutput, model_kind
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan

__all__ = ["RecModel", "StepOutput"]


class RecModel(nn.Module):
    """`ebc`: ShardedEmbeddingBagCollection (its optimizer is fused into backward); `dense`: the dense part,
    wrapped in DistributedDataParallel when world_size > 1 (optimize `dense_parameters()` with torch.optim)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_dense: int,
        plan: ShardingPlan,
        sparse_optimizer: FusedOptimizerConfig,
        device: torch.device,
        world_size: int,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from embshard.sharded import ShardedEmbeddingBagCollection

        self.cfg = cfg
        self.kind = model_kind(cfg.kind)
        groups = self.kind.output_groups(cfg) if self.kind.output_groups else None
        self.ebc = ShardedEmbeddingBagCollection(
            list(cfg.tables), plan, sparse_optimizer, output_groups=groups, device=device, seed=seed
        )
        torch.manual_seed(seed)  # identical dense initialisation on every rank
        dense = self.kind.build_dense(cfg, num_dense).to(device)
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            dense = DistributedDataParallel(dense, device_ids=[device.index] if device.type == "cuda" else None)
        self.dense = dense

    def dense_module(self) -> nn.Module:
        """The dense part without its DistributedDataParallel wrapper (for checkpoints)."""
        return getattr(self.dense, "module", self.dense)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense.parameters())

    def step(self, batch: Batch, check_finite: bool = False) -> StepOutput:
        """Forward and loss on this rank's batch. `check_finite`: raise `guard.NonFiniteError` on every rank
        (collective) if the loss or a pooled embedding is NaN or Inf, before any update (runtime.nan_check)."""
        step = self.ebc.step
        pooled = self.ebc(batch.sparse)
        out = self.kind.step(self.dense, pooled, batch, self.cfg)
        if check_finite:
            from embshard.guard import check_finite as check

            check(step, out.loss, self.ebc, pooled)
        return out
