"""The small-table kernel's and the Triton regroup's terms of the cost model: embshard/planner/kernel_model.py's formulas
applied to the planner's shard volumes (cost.py's notation: n ids, b bags, u distinct rows of a shard of r rows x
c columns, fp32 rows rb = 4c, state sb bytes per row, Zipf skew a). `CostModel.work(..., kernel=SMALL)` and
`CostModel.storage` call these for shards whose TablePlan.kernel is 'small'; `CostModel.batch_loads` calls
`regroup_s` on GPUs, where the runtime regroups with the Triton kernel (LookupOptions.regroup 'auto').

  forward   kernel_model.small_table_forward (+ routing, unchanged, for model-parallel shards)
  backward  model-parallel: small_table_backward(mode="atomic"): atomics into the gradient buffer, then the
            fused update of the touched rows; data-parallel: mode "dense" (the dense gradient only: the all-reduce
            and the update stay as with FBGEMM); column-wise under the exact row-wise Adagrad update: FBGEMM's
            terms (the exact backward replaces either kernel's)
  hot       n * top(r, a) * small_same_row_s, the hottest row's chain of atomic adds: the chains of one launch run
            side by side, so a lookup group on a rank pays the longest of its tables' chains once (State and
            predict add it per group, like the launch costs), not their sum
  storage   no sort workspace: SMALL_ID_STEP_BYTES per id model-parallel (the received ids and the copy kept for
            backward), SMALL_DP_ID_STEP_BYTES data-parallel; model-parallel groups keep a persistent fp32
            gradient buffer as large as their weights (r c 4), counted with the step buffers
  launches  1 forward, 2 backward (atomics, update) per group on a rank; data-parallel: zero-fill and atomics
  regroup   forward B 4 (used + out columns), backward B 4 (out + in columns) bytes (kernel_model.regroup_bytes;
            every pooled column used once: P = B F D 4 each way twice) over hbm_bw * regroup_efficiency, plus
            one launch each way

On CPU topologies the kernel runs as plain torch (embedding_bag, index_add_, the update over the whole gradient
buffer): the planner never chooses it there, and a plan that names it is predicted with FBGEMM's per-id terms.
"""

from __future__ import annotations

from embshard.planner.kernel_model import regroup_bytes, regroup_seconds, small_table_backward, small_table_forward
from embshard.spec.plan import ShardingType

SMALL_ID_STEP_BYTES = 16
SMALL_DP_ID_STEP_BYTES = 16
SMALL_FWD_KERNELS, SMALL_BWD_KERNELS = 1, 2


def small_times(model, t, sharding: ShardingType, rows, cols, n, bags, u, alpha, keep_bwd=False, bwd=None):
    """(forward, backward, hot) seconds of a shard's lookups in the small-table kernel (module docstring); the
    forward without routing, the data-parallel backward without the all-reduce and the update. `keep_bwd`: the
    backward is `bwd` (exact column-wise), and there is no chain."""
    topo = model.topo
    k = topo.kernel_constants
    fwd = small_table_forward(n, bags, rows, cols, u, t.weighted, topo.hbm_bw, model.l2, k)
    mode = "dense" if sharding is ShardingType.DATA_PARALLEL else "atomic"
    sb = model.state_bytes(cols)
    small_bwd, hot = small_table_backward(n, bags, rows, cols, u, t.weighted, sb, alpha, topo.hbm_bw, k, mode)
    if keep_bwd:
        return fwd, bwd, 0.0 * hot
    return fwd, small_bwd, hot


def small_step_bytes(sharding: ShardingType, rows, cols, n, weighted_bytes):
    """GPU memory of one step of a small-kernel shard beyond its pooled rows: ids (and per-sample weights) and
    the gradient buffer (model-parallel: persistent, r c 4; data-parallel: the dense gradient and the flat
    all-reduce buffer with counts, 2 r (c + 1) 4, as with FBGEMM)."""
    if sharding is ShardingType.DATA_PARALLEL:
        return n * (SMALL_DP_ID_STEP_BYTES + weighted_bytes) + 2 * rows * (cols + 1) * 4.0
    return n * (SMALL_ID_STEP_BYTES + 2 * weighted_bytes) + rows * cols * 4.0


def regroup_s(model, batch: int, pooled_cols: float) -> tuple[float, float]:
    """(forward, backward) seconds of the Triton regroup of a rank's pooled rows (module docstring)."""
    fwd_b, bwd_b = regroup_bytes(batch, int(model.out_bytes), int(pooled_cols), int(pooled_cols), int(pooled_cols))
    k, topo = model.topo.kernel_constants, model.topo
    return float(regroup_seconds(fwd_b, topo.hbm_bw, topo.kernel_s, k)), float(
        regroup_seconds(bwd_b, topo.hbm_bw, topo.kernel_s, k)
    )
