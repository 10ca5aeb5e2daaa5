"""DLRM-DCNv2 (model.kind dlrm_dcnv2): DLRM's bottom and top MLPs with a low-rank cross network (torchrec's
LowRankCrossNet) in place of the dot interaction, so tables may differ in width; scored by binary cross-entropy."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.dlrm import mlp
from embshard.models.registry import ModelKind, StepOutput, bce_output, feature_widths, register


@functools.cache
def _low_rank_cross_net() -> type[nn.Module]:
    """torchrec's LowRankCrossNet, subclassed (torchrec imported on first use; one class per process)."""
    from torchrec.modules.crossnet import LowRankCrossNet

    class LowRankCross(LowRankCrossNet):
        """torchrec's LowRankCrossNet (the same parameters and state dict, the same arithmetic
        x_{l+1} = x_0 * (W (V x_l) + b) + x_l) with fewer passes under autocast: the bias joins the second product (one
        GEMM, the bias added in its epilogue), and the running sum x_l, kept in fp32 as torchrec's is under bf16
        autocast (its fp32 bias promotes it), is updated by one fused kernel per layer on CUDA GPUs
        (embshard.kernels.cross: the fp32 sum and its bf16 copy for the next product in one pass, the backward in
        one pass; the first layer reads x_0 as it is, the last writes only the bf16 copy) or one addcmul elsewhere.
        torchrec's forward spends three fp32 passes per layer on it (add the bias, multiply, add) and a cast, and
        more in the backward."""

        fused = True  # the fused running-sum kernel where it applies (False: torch's ops, for comparisons)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            from embshard.kernels.cross import cross_sum, fused_available

            x_0 = input
            x_l = None  # the running sum in fp32 (None before the first layer: x_0 itself)
            x_in = x_0  # the products' input: the sum as autocast would cast it (x_0 itself at first)
            last = len(self.V_kernels) - 1
            for i, (V, W, b) in enumerate(zip(self.V_kernels, self.W_kernels, self.bias)):
                y = nn.functional.linear(nn.functional.linear(x_in, V), W, b)
                if self.fused and fused_available(x_l, x_0, y):
                    # x_in: the sum in x_0's dtype (what autocast would cast); the last layer's fp32 sum is not kept
                    x_l, x_in = cross_sum(x_l, x_0, y, keep_sum=i < last)
                else:
                    base = x_l if x_l is not None else x_0.to(torch.promote_types(x_0.dtype, torch.float32))
                    x_l = x_in = torch.addcmul(base, x_0, y)
            return x_in

    return LowRankCross


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
        self.bottom = mlp([num_dense, *bottom, dense_width])
        width = dense_width + sparse_width
        self.cross = _low_rank_cross_net()(width, num_layers, low_rank)
        self.top = mlp([width, *top, 1], last_activation=False)

    def forward(self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor) -> torch.Tensor:
        x_BW = torch.cat([self.bottom(dense_BN), sparse_BS], dim=1)
        return self.top(self.cross(x_BW)).squeeze(1)


def dcn_dense(cfg: ModelConfig, num_dense: int) -> DLRMDCNDense:
    """The dense part for the config: the pooled vectors of every feature side by side."""
    return DLRMDCNDense(
        num_dense,
        sum(feature_widths(cfg).values()),
        cfg.tables[0].embedding_dim,
        cfg.dlrm.bottom_mlp,
        cfg.dlrm.top_mlp,
        cfg.dcn.num_layers,
        cfg.dcn.low_rank,
    )


def dcn_sparse(model: Any, batch: Batch) -> torch.Tensor:
    """The pooled embeddings of every feature side by side `[B, sparse_width]`."""
    return model.ebc(batch.sparse).values()


def dcn_step(model: Any, batch: Batch) -> StepOutput:
    """BCE of the logits of the dense features and the pooled embeddings `[B, sparse_width]`."""
    return bce_output(model.dense(batch.dense, dcn_sparse(model, batch)), batch.labels)


register("dlrm_dcnv2", ModelKind(dcn_dense, dcn_step, sparse_input=dcn_sparse))
