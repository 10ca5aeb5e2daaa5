"""Kernels beyond FBGEMM's (docs/kernels.md), in Triton, each with a plain-torch path of the same semantics for the
CPU.

- `cross_entropy.fused_cross_entropy`: softmax cross-entropy in one pass forward, gradient in place backward.
- `small_tables.SmallTableLookup`: TBELookup's contract for small, hot fp32 tables (fused pooled forward, atomic
  backward robust to skewed ids, fused optimizer); `pool` / `dense_gradients`, the forward and dense backward
  without an optimizer. Their Triton kernels: `_pool_triton` (forward, update), `_grad_triton` (backward).
- `data_parallel.KernelDataParallelLookup`: DataParallelLookup on `pool` / `dense_gradients`.
- `_regroup_triton`: the column-gather launches of the collection's `KernelRegroup`
  (embshard/collection/regroup_kernel.py: Regroup's contract, one launch forward and one backward).
- `cross.cross_sum`: a DLRM-DCNv2 cross layer's fp32 running sum and its bf16 copy in one pass, backward in one.
- `calibrate`: the kernels' measurements; the planner's predictions of them are in embshard/planner/kernel_model.py.

Importing any module of the package runs this file first; it imports `cross_entropy` alone, which imports nothing
of embshard, so no module here closes an import cycle through the package (tests/test_imports.py checks it).
"""

from embshard.kernels.cross_entropy import LaunchConfig, fused_cross_entropy, logsumexp_rows, softmax_grad_

__all__ = ["LaunchConfig", "fused_cross_entropy", "logsumexp_rows", "softmax_grad_"]
