"""Two-tower retrieval: a user tower and an item tower map their groups of pooled embeddings to vectors whose dot
product scores a (user, item) pair.

The embedding side is a ShardedEmbeddingBagCollection with `output_groups={"user": [...], "item": [...]}`: its
regroup hands each tower one dense tensor. In catalog mode (no item tower) the item vectors are the rows of the
catalog table (embshard.retrieval.Catalog) and the collection serves the user side only. Losses here: BCE of
the dot product against the label, and in-batch softmax (row i's item is the positive of row i's user; the other
items of the batch are negatives: the rank's own, or every rank's, all-gathered). The catalog's full and sampled
softmax are in embshard/retrieval.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from embshard.comm import world_and_rank
from embshard.kernels import fused_cross_entropy
from embshard.models.dlrm import mlp
from embshard.retrieval.gather import gather_rows, gather_sizes


class TwoTowerDense(nn.Module):
    """The two towers. Input: user group `[B, user_width]`, item group `[B, item_width]`; output: the tower
    vectors `[B, D]` each. Without item_mlp (catalog mode) there is no item tower: `item_BI` passes through (or is
    None)."""

    def __init__(self, user_width: int, item_width: int, user_mlp: Sequence[int], item_mlp: Sequence[int]):
        super().__init__()
        self.user = mlp([user_width, *user_mlp], last_activation=False)
        self.item = mlp([item_width, *item_mlp], last_activation=False) if item_mlp else None

    def forward(
        self, user_BU: torch.Tensor, item_BI: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        item_BD = self.item(item_BI) if self.item is not None and item_BI is not None else item_BI
        return self.user(user_BU), item_BD


def bce_scores(user_BD: torch.Tensor, item_BD: torch.Tensor) -> torch.Tensor:
    """Logit of each row's own (user, item) pair `[B]`."""
    return (user_BD * item_BD).sum(dim=1)


def in_batch_softmax_loss(
    user_BD: torch.Tensor,
    item_BD: torch.Tensor,
    temperature: float,
    global_negatives: bool = False,
    item_ids_B: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of each local user against the batch's items with its own item as the target, the
    score matrix `[B, B_items]`, each user's target column `[B]`).

    global_negatives: the items are every rank's batch, all-gathered `[B_global, D]` (collective; the items'
    gradients return to their ranks), else this rank's `[B, D]`. item_ids_B: the items' ids; an item equal to a
    user's own item at another position of the batch is then left out of that user's negatives (a duplicate is
    not a negative)."""
    B = user_BD.shape[0]
    offset = 0
    if global_negatives:
        sizes = gather_sizes(B, user_BD.device, group)
        offset = sum(sizes[: world_and_rank(group)[1]])
        item_BD = gather_rows(item_BD, sizes, group)
        item_ids_B = gather_rows(item_ids_B, sizes, group) if item_ids_B is not None else None
    logits = user_BD @ item_BD.t() / temperature
    target_B = torch.arange(offset, offset + B, device=logits.device)
    if item_ids_B is not None:
        dup = item_ids_B.unsqueeze(0) == item_ids_B[target_B].unsqueeze(1)
        dup[torch.arange(B, device=dup.device), target_B] = False
        logits = logits.masked_fill(dup, float("-inf"))
    return fused_cross_entropy(logits, target_B), logits, target_B
