"""Kernels beyond FBGEMM's: the small-table lookup (fused pooled forward, atomic backward, fused optimizer) and
the regroup at memory speed, in Triton, each with a plain-torch path of the same semantics for the CPU.

- `small_tables.SmallTableLookup`: TBELookup's contract for small, hot fp32 tables; `pool` / `dense_gradients`
  for the data-parallel scheme's forward and dense backward.
- `regroup.KernelRegroup`: Regroup's contract, one column-gather launch forward and backward.
- `cost`: pure functions the planner can use to predict both kernels (docs/kernels.md).
"""
