"""Two-tower retrieval (model.kind two_tower): a user tower and an item tower map their groups of pooled embeddings
to vectors whose dot product scores a (user, item) pair.

The embedding side is a ShardedEmbeddingBagCollection with `output_groups={"user": [...], "item": [...]}`: its
regroup hands each tower one dense tensor. Losses: BCE of the dot product against the label, or in-batch sampled
softmax (row i's item is the positive of row i's user; the other items of the rank's local batch are negatives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.dlrm import mlp
from embshard.models.registry import ModelKind, StepOutput, bce_output, feature_widths, register


class TwoTowerDense(nn.Module):
    """The two towers. Input: user group `[B, user_width]`, item group `[B, item_width]`; output: the tower
    vectors `[B, D]` each."""

    def __init__(self, user_width: int, item_width: int, user_mlp: Sequence[int], item_mlp: Sequence[int]):
        super().__init__()
        self.user = mlp([user_width, *user_mlp], last_activation=False)
        self.item = mlp([item_width, *item_mlp], last_activation=False)

    def forward(self, user_BU: torch.Tensor, item_BI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.user(user_BU), self.item(item_BI)


def bce_scores(user_BD: torch.Tensor, item_BD: torch.Tensor) -> torch.Tensor:
    """Logit of each row's own (user, item) pair `[B]`."""
    return (user_BD * item_BD).sum(dim=1)


def in_batch_softmax_loss(
    user_BD: torch.Tensor, item_BD: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of each user against all items of the batch with its own item as the target,
    the score matrix `[B, B]`)."""
    logits_BB = user_BD @ item_BD.t() / temperature
    target_B = torch.arange(logits_BB.shape[0], device=logits_BB.device)
    return nn.functional.cross_entropy(logits_BB, target_B), logits_BB


def two_tower_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """The embeddings' output: one group of pooled vectors per tower."""
    return {"user": list(cfg.two_tower.user_features), "item": list(cfg.two_tower.item_features)}


def two_tower_dense(cfg: ModelConfig, num_dense: int) -> TwoTowerDense:
    """The towers for the config (the dense features are not used)."""
    tt, width = cfg.two_tower, feature_widths(cfg)
    return TwoTowerDense(
        sum(width[f] for f in tt.user_features),
        sum(width[f] for f in tt.item_features),
        tt.user_mlp,
        tt.item_mlp,
    )


def two_tower_step(dense: nn.Module, groups: dict[str, torch.Tensor], batch: Batch, cfg: ModelConfig) -> StepOutput:
    """The configured loss of the towers' vectors: BCE of each row's own pair against its label, or in-batch
    softmax (scores: the [B, B] matrix, labels: its diagonal)."""
    user_BD, item_BD = dense(groups["user"], groups["item"])
    if cfg.two_tower.loss == "softmax":
        loss, logits_BB = in_batch_softmax_loss(user_BD, item_BD, cfg.two_tower.temperature)
        eye = torch.eye(batch.size, device=logits_BB.device)
        return StepOutput(loss, logits_BB.flatten(), eye.flatten())
    return bce_output(bce_scores(user_BD, item_BD), batch.labels)


register("two_tower", ModelKind(two_tower_dense, two_tower_step, two_tower_groups))
