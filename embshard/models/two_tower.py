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

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.kernels import fused_cross_entropy
from embshard.models.dlrm import mlp
from embshard.models.registry import ModelKind, StepOutput, bce_output, feature_widths, register
from embshard.retrieval.gather import gather_rows, gather_sizes
from embshard.runtime.comm import world_and_rank


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


def two_tower_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """The embeddings' output: one group of pooled vectors per tower (catalog mode: the user side only)."""
    tt = cfg.two_tower
    if tt.catalog_mode:
        return {"user": list(tt.user_features)}
    return {"user": list(tt.user_features), "item": list(tt.item_features)}


def two_tower_dense(cfg: ModelConfig, num_dense: int) -> TwoTowerDense:
    """The towers for the config (the dense features are not used)."""
    tt, width = cfg.two_tower, feature_widths(cfg)
    return TwoTowerDense(
        sum(width[f] for f in tt.user_features), sum(width[f] for f in tt.item_features), tt.user_mlp, tt.item_mlp
    )


def two_tower_catalog(cfg: ModelConfig, plan, sparse_optimizer, device: torch.device, seed: int):
    """Catalog mode (item_mlp: []): the item table as a row-sharded retrieval catalog in a collection of its own."""
    tt = cfg.two_tower
    if not tt.catalog_mode:
        return None
    from embshard.retrieval import Catalog

    table = next(t for t in cfg.tables if tt.item_features[0] in t.feature_names)
    sampled = tt.sampled_softmax
    extra = {}
    if sampled:
        extra = {"sampler": sampled.sampler, "num_negatives": sampled.num_negatives, "smoothing": sampled.smoothing}
    return Catalog(table, plan, sparse_optimizer, device, seed=seed, chunk_mib=tt.chunk_mib, **extra)


def two_tower_step(model, batch: Batch) -> StepOutput:
    """The configured loss of the towers' vectors: BCE of each row's own pair against its label, or in-batch
    softmax (scores: the score matrix, labels: 1 at each user's own item); catalog mode: `catalog_step`."""
    if model.catalog is not None:
        return catalog_step(model, batch)
    tt = model.cfg.two_tower
    groups = model.ebc(batch.sparse)
    user_BD, item_BD = model.dense(groups["user"], groups["item"])
    if tt.loss == "in_batch":
        loss, logits, target = in_batch_softmax_loss(user_BD, item_BD, tt.temperature, tt.in_batch.global_negatives)
        return StepOutput(loss, logits.flatten(), _one_hot(logits, target).flatten())
    return bce_output(bce_scores(user_BD, item_BD), batch.labels)


def catalog_step(model, batch: Batch) -> StepOutput:
    """Two-tower in catalog mode: the item feature's ids are the targets, the other features the user side; the
    loss scores the catalog's rows (full or sampled softmax over the catalog, or in-batch / bce over the rows of
    the batch's items). Evaluation adds recall@K over the whole catalog."""
    tt, catalog = model.cfg.two_tower, model.catalog
    kjt = batch.sparse
    keys = list(kjt.keys())
    ids_B = kjt[catalog.feature].values()
    if ids_B.numel() != batch.size:
        raise ValueError(
            f"feature {catalog.feature!r} is the catalog's item id: it must hold exactly one id per sample, but "
            f"the batch has {ids_B.numel()} ids for {batch.size} samples; make it a single-valued feature"
        )
    user_kjt = kjt.permute([i for i, k in enumerate(keys) if k != catalog.feature])
    user_BD, _ = model.dense(model.ebc(user_kjt)["user"])
    hits = catalog.recall(user_BD, ids_B, tt.recall_at) if not model.training and tt.recall_at else {}
    if tt.loss == "bce":
        out = bce_output(bce_scores(user_BD, catalog.vectors(ids_B)), batch.labels)
        return StepOutput(out.loss, out.scores, out.labels, hits)
    if tt.loss == "in_batch":
        ib = tt.in_batch
        items = catalog.vectors(ids_B)
        loss, logits, target = in_batch_softmax_loss(
            user_BD, items, tt.temperature, ib.global_negatives, ids_B if ib.remove_duplicates else None
        )
        return StepOutput(loss, logits.flatten(), _one_hot(logits, target).flatten(), hits)
    query_BD = user_BD / tt.temperature
    if tt.loss == "sampled_softmax" and model.training:
        return StepOutput(catalog.sampled_softmax_loss(query_BD, ids_B).mean(), None, None, hits)
    # full_softmax; also the held-out loss of sampled_softmax (the exact loss the samples estimate)
    return StepOutput(catalog.full_softmax_loss(query_BD, ids_B).mean(), None, None, hits)


def _one_hot(logits: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """0/1 labels of an in-batch score matrix: 1 at each user's own item."""
    labels = torch.zeros_like(logits)
    labels[torch.arange(logits.shape[0], device=logits.device), target_B] = 1.0
    return labels


register("two_tower", ModelKind(two_tower_dense, two_tower_step, two_tower_groups, two_tower_catalog))
