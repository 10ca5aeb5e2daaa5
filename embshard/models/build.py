"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section.

Two-tower in catalog mode (item_mlp: []): the item table is its own row-sharded collection, the catalog
(embshard.retrieval.Catalog); the batch's item ids are split off the KeyedJaggedTensor as the targets, the other
features go to the user side's collection and tower, and the loss scores the catalog's rows (full or sampled
softmax over the catalog, or in-batch / bce over the rows of the batch's items). Evaluation adds recall@K over
the whole catalog."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """A step's mean loss, the scores and 0/1 labels that the AUC is computed on (None: no AUC), and in evaluation
    in catalog mode {K: local samples whose item is among the catalog's K best-scored items}."""

    loss: torch.Tensor
    scores: torch.Tensor | None
    labels: torch.Tensor | None
    hits: dict[int, torch.Tensor] = field(default_factory=dict)


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
        width = {f: t.embedding_dim for t in tables for f in t.feature_names}
        groups = None
        self.catalog = None
        if cfg.kind == "two_tower":
            groups = {"user": list(cfg.two_tower.user_features), "item": list(cfg.two_tower.item_features)}
        if cfg.kind == "two_tower" and cfg.two_tower.catalog_mode:
            from embshard.retrieval import Catalog

            tt = cfg.two_tower
            catalog = next(t for t in tables if tt.item_features[0] in t.feature_names)
            sampled = tt.sampled_softmax
            self.catalog = Catalog(
                catalog,
                plan,
                sparse_optimizer,
                device,
                seed=seed,
                chunk_mib=tt.chunk_mib,
                **(
                    {"sampler": sampled.sampler, "num_negatives": sampled.num_negatives, "smoothing": sampled.smoothing}
                    if sampled
                    else {}
                ),
            )
            tables = [t for t in tables if t is not catalog]
            plan = ShardingPlan(plan.world_size, plan.local_world_size, tuple(plan[t.name] for t in tables))
            groups = {"user": list(tt.user_features)}
        self.ebc = ShardedEmbeddingBagCollection(
            tables, plan, sparse_optimizer, output_groups=groups, device=device, seed=seed
        )
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

    def collections(self) -> list[nn.Module]:
        """The sharded embedding collections (the catalog's last, in catalog mode), for checkpoints."""
        return [self.ebc] + ([self.catalog.ebc] if self.catalog is not None else [])

    def step(self, batch: Batch) -> StepOutput:
        """Forward and loss on this rank's batch."""
        bce = nn.functional.binary_cross_entropy_with_logits
        B = batch.size
        if self.cfg.kind == "two_tower" and self.catalog is not None:
            return self._catalog_step(batch)
        if self.cfg.kind == "two_tower":
            tt = self.cfg.two_tower
            groups = self.ebc(batch.sparse)
            user_BD, item_BD = self.dense(groups["user"], groups["item"])
            if tt.loss == "in_batch":
                loss, logits, target = in_batch_softmax_loss(
                    user_BD, item_BD, tt.temperature, tt.in_batch.global_negatives
                )
                return StepOutput(loss, logits.flatten(), _one_hot(logits, target).flatten())
            logits_B = bce_scores(user_BD, item_BD)
            return StepOutput(bce(logits_B, batch.labels), logits_B, batch.labels)
        pooled = self.ebc(batch.sparse).values()
        if self.cfg.kind == "dlrm":
            pooled = pooled.view(B, self.num_features, self.embedding_dim)
        logits_B = self.dense(batch.dense, pooled)
        return StepOutput(bce(logits_B, batch.labels), logits_B, batch.labels)

    def _catalog_step(self, batch: Batch) -> StepOutput:
        """Two-tower in catalog mode: the item feature's ids are the targets, the other features the user side."""
        tt, catalog = self.cfg.two_tower, self.catalog
        kjt = batch.sparse
        keys = list(kjt.keys())
        ids_B = kjt[catalog.feature].values()
        if ids_B.numel() != batch.size:
            raise ValueError(
                f"feature {catalog.feature!r} is the catalog's item id: it must hold exactly one id per sample, but "
                f"the batch has {ids_B.numel()} ids for {batch.size} samples; make it a single-valued feature"
            )
        user_kjt = kjt.permute([i for i, k in enumerate(keys) if k != catalog.feature])
        user_BD, _ = self.dense(self.ebc(user_kjt)["user"])
        hits = catalog.recall(user_BD, ids_B, tt.recall_at) if not self.training and tt.recall_at else {}
        if tt.loss == "bce":
            logits_B = bce_scores(user_BD, catalog.vectors(ids_B))
            bce = nn.functional.binary_cross_entropy_with_logits
            return StepOutput(bce(logits_B, batch.labels), logits_B, batch.labels, hits)
        if tt.loss == "in_batch":
            ib = tt.in_batch
            loss, logits, target = in_batch_softmax_loss(
                user_BD,
                catalog.vectors(ids_B),
                tt.temperature,
                ib.global_negatives,
                ids_B if ib.remove_duplicates else None,
            )
            return StepOutput(loss, logits.flatten(), _one_hot(logits, target).flatten(), hits)
        query_BD = user_BD / tt.temperature
        if tt.loss == "sampled_softmax" and self.training:
            return StepOutput(catalog.sampled_softmax_loss(query_BD, ids_B).mean(), None, None, hits)
        # full_softmax; also the held-out loss of sampled_softmax (the exact loss the samples estimate)
        return StepOutput(catalog.full_softmax_loss(query_BD, ids_B).mean(), None, None, hits)


def _one_hot(logits: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """0/1 labels of an in-batch score matrix: 1 at each user's own item."""
    labels = torch.zeros_like(logits)
    labels[torch.arange(logits.shape[0], device=logits.device), target_B] = 1.0
    return labels
