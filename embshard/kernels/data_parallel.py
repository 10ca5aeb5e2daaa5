"""Data-parallel tables on the small-table kernels: `DataParallelLookup` with its FBGEMM dense TBE forward and
dense backward replaced by `pool` and `dense_gradients` (the small-table lookup's backward: atomics after each bag
chunk's repeated rows are summed, no global sort), on the same flat weights.

Data flow of one step (as DataParallelLookup otherwise): forward pools the local batch from the flat replica
(`group_views`: one `[rows, D]` view per (width, data type) block), the per-sample weights multiplying the ids of
weighted tables, or every id while its `every_id_weighted` is set (a padded batch, whose filler ids weigh 0;
`all_weighted`, which the backward keeps); backward forms the flat gradient of the local batch with atomics into
a zeroed buffer (`deterministic=True`: the sorted backward), then `DataParallelLookup.apply_gradient` all-reduces
it and applies the same update on every rank. The replicas still agree bitwise across ranks (every rank updates
with the same all-reduced bits); with atomics two runs may differ in the last bits of fp32, as FBGEMM's dense
backward on CUDA may.

To use it, the data-parallel builder constructs `KernelDataParallelLookup` instead of `DataParallelLookup` (same
arguments, plus the keyword `kernel`).
"""

from __future__ import annotations

from typing import Any

import torch

from embshard.kernels.small_tables import SmallTableOptions, dense_gradients, group_views, pool, shards_layout
from embshard.lookup.replicas import DataParallelLookup
from embshard.runtime.comm import scoped_label


class _KernelReplicaBags(torch.autograd.Function):
    """Pooled sums over the replicas; backward forms the flat gradient and hands it to apply_gradient."""

    @staticmethod
    def forward(ctx, lookup, indices, offsets, psw, all_weighted, weights):  # type: ignore[override]
        ctx.lookup, ctx.inputs = lookup, (indices, offsets, psw, all_weighted)
        ctx.label = scoped_label("data_parallel gradient all-reduce (backward)")
        if offsets.numel() == 1:  # an empty local batch: no kernel, but backward still joins the all-reduce
            return weights.new_zeros(0, sum(lookup.dims))
        return lookup.pooled(indices, offsets, psw, all_weighted)

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        lookup = ctx.lookup
        indices, offsets, psw, all_weighted = ctx.inputs
        ctx.inputs = None
        grad = torch.zeros_like(lookup.tbe.weights, memory_format=torch.contiguous_format).detach()
        if offsets.numel() > 1:
            views = group_views(grad, lookup.kernel_layout)
            layout = lookup.kernel_layout
            dense_gradients(layout, views, grad_BD, indices, offsets, psw, lookup.kernel, all_weighted=all_weighted)
        lookup.apply_gradient(grad, indices, offsets, label=ctx.label)
        return (None,) * 6


class KernelDataParallelLookup(DataParallelLookup):
    """DataParallelLookup whose lookup and dense gradient run on the small-table kernels."""

    def __init__(self, *args: Any, kernel: SmallTableOptions | None = None, **kwargs: Any) -> None:
        """DataParallelLookup's arguments (shards, optimizer, device, group, seed, options), and the kernels'
        options `kernel` (keyword only; default SmallTableOptions())."""
        super().__init__(*args, **kwargs)
        self.kernel = kernel or SmallTableOptions()
        self.pads_free = False  # set by a scheme whose padded batches give this lookup no fillers
        self.kernel_layout, _ = shards_layout(self.shards, by_dtype=True)
        group_views(self.tbe.weights.detach(), self.kernel_layout)  # the flat weights hold exactly these blocks

    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None, all_weighted: bool = False
    ) -> torch.Tensor:
        """Forward without autograd (fp32; `all_weighted`: `psw` weighs every feature's ids, as `pool`)."""
        views = group_views(self.tbe.weights.detach(), self.kernel_layout)
        return pool(self.kernel_layout, views, indices, offsets, psw, torch.float32, self.kernel, all_weighted)

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` (same contract as TBELookup); the update happens in backward."""
        # A padded batch gives these features no fillers (the kernels read ids through the offsets alone:
        # DataParallelSharding.pads_free), so the weights weigh the weighted tables' ids only, as in any batch;
        # `every_id_weighted` still applies to a lookup called directly with every id weighted.
        forced = self.every_id_weighted and not self.pads_free
        psw = weights.float() if weights is not None and (self._weighted != "none" or forced) else None
        if torch.is_grad_enabled():
            pooled = _KernelReplicaBags.apply(self, indices, offsets, psw, forced, self.tbe.weights)
        elif offsets.numel() == 1:  # an empty local batch
            pooled = self.tbe.weights.new_zeros(0, sum(self.dims))
        else:
            pooled = self.pooled(indices, offsets, psw, forced)
        return pooled.to(self._out_dtype)
