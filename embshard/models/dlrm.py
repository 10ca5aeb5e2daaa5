"""DLRM: a dense MLP for continuous features, sharded embeddings for categorical ones, pairwise dot interaction,
and a top MLP producing one logit per sample.

The dense part (`DLRMDense`) is an ordinary module: wrap it in DistributedDataParallel so its gradients are
averaged over ranks; the sparse part is the ShardedEmbeddingBagCollection with its fused optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


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


class DLRMDCNDense(nn.Module):
    """DLRM-DCNv2's dense part: bottom MLP, a low-rank cross network (torchrec's LowRankCrossNet) over the
    concatenated dense and sparse vector, and the top MLP. Input: dense features `[B, num_dense]` and pooled
    embeddings concatenated `[B, sparse_width]` (tables may differ in width); output: logits `[B]`."""

    def __init__(
        self,
        num_dense: int,
        sparse_width: int,
        dense_width: int,
        bottom: Sequence[int],
        top: Sequence[int],
        num_layers: int,
        low_rank: int,
    ):
        super().__init__()
        from torchrec.modules.crossnet import LowRankCrossNet

        self.bottom = mlp([num_dense, *bottom, dense_width])
        width = dense_width + sparse_width
        self.cross = LowRankCrossNet(width, num_layers, low_rank)
        self.top = mlp([width, *top, 1], last_activation=False)

    def forward(self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor) -> torch.Tensor:
        x_BW = torch.cat([self.bottom(dense_BN), sparse_BS], dim=1)
        return self.top(self.cross(x_BW)).squeeze(1)
