"""Kernels beyond FBGEMM's (docs/kernels.md): the small-table lookup (fused pooled forward, atomic backward, fused
optimizer) and the regroup at memory speed, in Triton, each with a plain-torch path of the same semantics for the
CPU.

- `small_tables.SmallTableLookup`: TBELookup's contract for small, hot fp32 tables; `pool` / `dense_gradients`,
  the forward and dense backward without an optimizer.
- `data_parallel.KernelDataParallelLookup`: DataParallelLookup on `pool` / `dense_gradients`.
- `regroup.KernelRegroup`: Regroup's contract, one column-gather launch forward and one backward.
- `cost`: pure functions the planner can use to predict both kernels; `calibrate`: their measurements.
"""
