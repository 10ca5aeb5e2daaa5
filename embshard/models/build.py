"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.dlrm import DLRMDCNDense, DLRMDense
from embshard.models.two_tower import TwoTowerDense, bce_scores, in_batch_softmax_loss
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan


@dataclass
class StepOutput:
    """A step's mean loss, and the scores and 0/1 labels that the AUC is computed on."""

    loss: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor


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
        tables = list(cfg.tables)
        groups = None
        if cfg.kind == "two_tower":
            groups = {"user": list(cfg.two_tower.user_features), "item": list(cfg.two_tower.item_features)}
        self.ebc = ShardedEmbeddingBagCollection(
            tables, plan, sparse_optimizer, output_groups=groups, device=device, seed=seed
        )
        width = {f: t.embedding_dim for t in tables for f in t.feature_names}
        torch.manual_seed(seed)  # identical dense initialisation on every rank
        if cfg.kind == "dlrm":
            dense = DLRMDense(num_dense, len(width), tables[0].embedding_dim, cfg.dlrm.bottom_mlp, cfg.dlrm.top_mlp)
        elif cfg.kind == "dlrm_dcnv2":
            dense = DLRMDCNDense(
                num_dense,
                sum(width.values()),
                tables[0].embedding_dim,
                cfg.dlrm.bottom_mlp,
                cfg.dlrm.top_mlp,
                cfg.dcn.num_layers,
                cfg.dcn.low_rank,
            )
        else:
            tt = cfg.two_tower
            dense = TwoTowerDense(
                sum(width[f] for f in tt.user_features),
                sum(width[f] for f in tt.item_features),
                tt.user_mlp,
                tt.item_mlp,
            )
        dense = dense.to(device)
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            dense = DistributedDataParallel(dense, device_ids=[device.index] if device.type == "cuda" else None)
        self.dense = dense
        self.num_features = len(width)
        self.embedding_dim = tables[0].embedding_dim

    def dense_module(self) -> nn.Module:
        """The dense part without its DistributedDataParallel wrapper (for checkpoints)."""
        return getattr(self.dense, "module", self.dense)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense.parameters())

    def step(self, batch: Batch) -> StepOutput:
        """Forward and loss on this rank's batch."""
        bce = nn.functional.binary_cross_entropy_with_logits
        B = batch.size
        if self.cfg.kind == "two_tower":
            groups = self.ebc(batch.sparse)
            user_BD, item_BD = self.dense(groups["user"], groups["item"])
            if self.cfg.two_tower.loss == "softmax":
                loss, logits_BB = in_batch_softmax_loss(user_BD, item_BD, self.cfg.two_tower.temperature)
                eye = torch.eye(B, device=logits_BB.device)
                return StepOutput(loss, logits_BB.flatten(), eye.flatten())
            logits_B = bce_scores(user_BD, item_BD)
            return StepOutput(bce(logits_B, batch.labels), logits_B, batch.labels)
        pooled = self.ebc(batch.sparse).values()
        if self.cfg.kind == "dlrm":
            pooled = pooled.view(B, self.num_features, self.embedding_dim)
        logits_B = self.dense(batch.dense, pooled)
        return StepOutput(bce(logits_B, batch.labels), logits_B, batch.labels)
