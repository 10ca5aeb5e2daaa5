"""DLRM (model.kind dlrm): a dense MLP for continuous features, sharded embeddings for categorical ones, pairwise
dot interaction, and a top MLP producing one logit per sample, scored by binary cross-entropy.

The dense part (`DLRMDense`) is an ordinary module: wrap it in DistributedDataParallel so its gradients are
averaged over ranks; the sparse part is the ShardedEmbeddingBagCollection with its fused optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.registry import ModelKind, StepOutput, bce_output, register


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last one if `last_activation`)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMDense(nn.Module):
    """Bottom MLP, dot interaction and top MLP. Input: dense features `[B, num_dense]` and pooled embeddings
    `[B, F, D]`; output: logits `[B]`."""

    def __init__(self, num_dense: int, num_sparse: int, embedding_dim: int, bottom: Sequence[int], top: Sequence[int]):
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, embedding_dim])
        n = num_sparse + 1
        self._tri = torch.triu_indices(n, n, offset=1)
        self.top = mlp([embedding_dim + n * (n - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense_BN: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        x_BD = self.bottom(dense_BN)
        all_BnD = torch.cat([x_BD.unsqueeze(1), sparse_BFD], dim=1)
        dots_Bnn = torch.bmm(all_BnD, all_BnD.transpose(1, 2))
        pairs_BP = dots_Bnn[:, self._tri[0], self._tri[1]]
        return self.top(torch.cat([x_BD, pairs_BP], dim=1)).squeeze(1)


def dlrm_dense(cfg: ModelConfig, num_dense: int) -> DLRMDense:
    """DLRM's dense part for the config: one pooled vector per feature, all of the first table's width."""
    return DLRMDense(num_dense, len(cfg.features), cfg.tables[0].embedding_dim, cfg.dlrm.bottom_mlp, cfg.dlrm.top_mlp)


def dlrm_sparse(model: Any, batch: Batch) -> torch.Tensor:
    """The pooled embeddings `[B, F, D]`."""
    cfg = model.cfg
    return model.ebc(batch.sparse).values().view(batch.size, len(cfg.features), cfg.tables[0].embedding_dim)


def dlrm_step(model: Any, batch: Batch) -> StepOutput:
    """BCE of the logits of the dense features and the pooled embeddings `[B, F, D]`."""
    return bce_output(model.dense(batch.dense, dlrm_sparse(model, batch)), batch.labels)


register("dlrm", ModelKind(dlrm_dense, dlrm_step, sparse_input=dlrm_sparse))
