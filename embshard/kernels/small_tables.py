"""Small, hot tables in one fused kernel per row width: pooled forward, atomic backward, fused optimizer.

`SmallTableLookup` has the contract of `embshard.lookup.TBELookup` (shards in, feature-major ids in, pooled sums
`[B, sum of feature widths]` out, the optimizer applied to the touched rows inside backward), built for tables
whose rows fit the GPU's L2 cache: many collisions per row and step, where FBGEMM's backward spends its time
sorting ids. Data flow of one step:

  forward   ids, offsets (F*B+1), per-sample weights -> one Triton launch per row width (`_pool_triton._fwd`):
            each program pools a few bags of one feature from the width group's `[rows, D]` block -> `[B, cols]`
  backward  output gradient -> `_grad_triton._bwd_atomic`: each bag's chunk of ids is sorted in registers and
            every distinct row adds (count or weight sum) x its bag's gradient row into the group's gradient
            buffer (relaxed atomics, no global sort; the launch interleaves its tables so hot rows' chains of
            adds overlap) -> `_update`: the rule of embshard.spec.optim on every row whose gradient is non-zero (or
            that was marked touched: weight decay, adam), which also zeroes the buffer again
  deterministic mode: `_grad_triton._bwd_sorted` instead of the atomics (int32 row keys, a stable radix sort,
            fixed tiles of sorted ids summed by a segmented scan, rows across tiles fixed up in tile order),
            bitwise reproducible run to run

Atomics are the default: they are the fast path this module exists for (no global sort, no segment reduction),
and the update rule is the same; only the order in which one row's contributions are summed varies between runs
(last bits of fp32). `deterministic=True` trades speed for bitwise reproducibility. On the CPU (`impl="auto"`) a plain
torch path runs the same math (embedding_bag forward, index_add_ backward, embshard.lookup.updates.apply_update), which is
deterministic; `impl="triton"` with CPU tensors runs the Triton kernels under TRITON_INTERPRET=1 (tests).

For the data-parallel scheme, `pool` and `dense_gradients` are the forward and the backward without an optimizer:
the gradient of every row of a flat `[rows, D]` block (FBGEMM's dense TBE layout), which the caller all-reduces.

Per-sample weights multiply the ids of weighted tables only (the layout's per-feature `weighted` flags), except
while its `every_id_weighted` is set (a padded batch: filler ids of weight 0, embshard/training/step_graph.py): then the
lookup pools every feature with the batch's weights (`all_weighted=True`: the kernels get all-ones flags, made
once per layout and device, and the torch path weighs every feature), and its backward, which may run after the
context has closed, weighs every id the same way. A filler then adds nothing to its bag and no gradient to its row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embshard.kernels.layout import PoolLayout, Tiles, build_layout
from embshard.lookup import LocalShard, init_rows
from embshard.lookup.base import CountedSteps, NoCache, ShardLookup
from embshard.lookup.updates import apply_update, optimizer_state
from embshard.spec.optim import OptimizerKind
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError, DataType

_KIND = {OptimizerKind.SGD: 0, OptimizerKind.ADAGRAD: 1, OptimizerKind.ROWWISE_ADAGRAD: 2, OptimizerKind.ADAM: 3}


@dataclass(frozen=True)
class SmallTableOptions:
    """How the small-table kernel runs."""

    deterministic: bool = False
    """Sort ids by row in backward and sum each row in a fixed order (bitwise reproducible, slower); default:
    atomics (fast, the order of one row's fp32 sums varies between runs)."""
    impl: str = "auto"
    """"triton", "torch", or "auto" (Triton on CUDA tensors, torch on the CPU unless TRITON_INTERPRET=1)."""
    direct_sgd: bool = False
    """sgd without weight decay: add -lr x each id's gradient straight into the weights (no gradient buffer, no
    update pass). The same rule in exact arithmetic; fp32 rounding differs (each add rounds to the weight)."""
    tiles: Tiles = field(default_factory=Tiles)
    """Tile sizes of the Triton kernels."""

    def __post_init__(self) -> None:
        if self.impl not in ("auto", "triton", "torch"):
            raise ConfigError(f"SmallTableOptions impl={self.impl!r} is unknown: choose auto, triton or torch")


def use_triton(impl: str, device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device`."""
    if impl == "auto":
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return impl == "triton"


def _kernels():
    from embshard.kernels import _pool_triton

    return _pool_triton


def _grad_kernels():
    from embshard.kernels import _grad_triton

    return _grad_triton


# ---- functional API (also the data-parallel scheme's forward and dense backward) ---------------------------------
def pool(
    layout: PoolLayout,
    weights: Sequence[torch.Tensor],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    kernel: SmallTableOptions | None = None,
    all_weighted: bool = False,
) -> torch.Tensor:
    """Pooled sums `[B, layout.out_cols]` of feature-major bags (offsets of length F*B+1) over the groups' blocks
    `weights[g]` `[rows, D]` (fp32, row-major). No autograd. `psw` weighs the ids of weighted tables, or with
    `all_weighted` every id (a padded batch: `every_id_weighted`). `kernel`: which implementation runs, with which
    tiles (default SmallTableOptions())."""
    kernel = kernel or SmallTableOptions()
    B = (offsets.numel() - 1) // max(layout.num_features, 1)
    if not use_triton(kernel.impl, indices.device):
        return _pool_torch(layout, weights, indices, offsets, psw, B, all_weighted).to(out_dtype)
    if not (B and indices.numel()):
        return torch.zeros(B, layout.out_cols, dtype=out_dtype, device=indices.device)
    indices, offsets = indices.contiguous(), offsets.contiguous()
    psw = psw.contiguous() if psw is not None else None
    out = torch.empty(B, layout.out_cols, dtype=out_dtype, device=indices.device)  # every column is written
    dgroups = layout.on(indices.device, all_weighted)
    _kernels().forward(list(weights), dgroups, indices, offsets, psw, out, kernel.tiles)
    return out


def dense_gradients(
    layout: PoolLayout,
    grads: Sequence[torch.Tensor],
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None = None,
    kernel: SmallTableOptions | None = None,
    touched: Sequence[torch.Tensor] | None = None,
    all_weighted: bool = False,
) -> None:
    """The gradient of the pooled sums with respect to every row of the groups' blocks, given the output's
    gradient `grad_out` `[B, layout.out_cols]`, into `grads[g]` `[rows, D]` fp32, which the caller zeroes first:
    atomic mode adds every id's contribution, deterministic mode (`kernel.deterministic`) writes each row that has
    ids once (summed in a fixed order). `touched[g]` (int8 `[rows]`, optional): rows read by an id are set to 1.
    `psw`, `kernel` and `all_weighted` as in `pool` (the forward's)."""
    kernel = kernel or SmallTableOptions()
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if not use_triton(kernel.impl, indices.device):
        _grads_torch(layout, grads, grad_out, indices, offsets, psw, touched, all_weighted)
        return
    indices, offsets = indices.contiguous(), offsets.contiguous()
    psw = psw.contiguous() if psw is not None else None
    k = _grad_kernels()
    dgroups = layout.on(indices.device, all_weighted)
    if kernel.deterministic:
        features = layout.feature_tables(indices.device, all_weighted)
        k.backward_sorted(
            list(grads), list(touched) if touched else None, dgroups, features, indices, offsets, psw, grad_out,
            kernel.tiles,
        )  # fmt: skip
    elif grad_out.shape[0] and indices.numel():
        k.backward_atomic(
            list(grads), list(touched) if touched else None, dgroups, indices, offsets, psw, grad_out, kernel.tiles
        )


def _bags(layout: PoolLayout, offsets: torch.Tensor, B: int, all_weighted: bool = False):
    """Per feature of each group: (group index, group, row0, col, weighted (True for every feature with
    `all_weighted`), id range start, end, bag offsets)."""
    for gi, g in enumerate(layout.groups):
        for f, r0, c, w in zip(g.features, g.row0, g.cols, g.weighted):
            off = offsets[f * B : (f + 1) * B + 1].long()
            lo, hi = int(off[0]), int(off[-1])
            yield gi, g, r0, c, w or all_weighted, lo, hi, off - lo


def _pool_torch(layout, weights, indices, offsets, psw, B, all_weighted=False) -> torch.Tensor:
    out = torch.zeros(B, layout.out_cols, dtype=torch.float32, device=indices.device)
    if B == 0:
        return out
    for gi, g, r0, c, w, lo, hi, off in _bags(layout, offsets, B, all_weighted):
        p = psw[lo:hi].float() if (w and psw is not None) else None
        ids = indices[lo:hi].long() + r0
        out[:, c : c + g.dim] = F.embedding_bag(
            ids, weights[gi], off, mode="sum", per_sample_weights=p, include_last_offset=True
        )
    return out


def _grads_torch(layout, grads, grad_out, indices, offsets, psw, touched, all_weighted=False) -> None:
    B = grad_out.shape[0]
    if B == 0:
        return
    for gi, g, r0, c, w, lo, hi, off in _bags(layout, offsets, B, all_weighted):
        ids = indices[lo:hi].long() + r0
        bag = torch.repeat_interleave(torch.arange(B, device=ids.device), off.diff(), output_size=hi - lo)
        rows = grad_out[bag, c : c + g.dim].float()
        if w and psw is not None:
            rows = rows * psw[lo:hi].float().unsqueeze(1)
        grads[gi].index_add_(0, ids, rows)
        if touched is not None:
            touched[gi][ids] = 1


def shards_layout(shards: Sequence[LocalShard], by_dtype: bool = False) -> tuple[PoolLayout, list[tuple[int, int]]]:
    """The kernels' layout of `shards` (features in shard order; groups by width, or by (width, data type) as the
    data-parallel scheme's flat weights) and each shard's (group, first row)."""
    table_features, f = [], 0
    for s in shards:
        table_features.append(list(range(f, f + len(s.features))))
        f += len(s.features)
    return build_layout(
        [s.shard.num_rows for s in shards],
        [s.shard.num_cols for s in shards],
        table_features,
        [s.table.weighted for s in shards],
        [s.shard.num_cols for s in shards for _ in s.features],
        [(s.shard.num_cols, s.table.data_type) for s in shards] if by_dtype else None,
    )


def group_views(flat: torch.Tensor, layout: PoolLayout) -> list[torch.Tensor]:
    """`[rows, D]` views of a flat tensor holding the layout's groups one after another (FBGEMM's dense TBE)."""
    out, e0 = [], 0
    for g in layout.groups:
        out.append(flat[e0 : e0 + g.rows * g.dim].view(g.rows, g.dim))
        e0 += g.rows * g.dim
    if e0 != flat.numel():
        raise ValueError(f"group_views: the layout holds {e0} elements, the flat tensor {flat.numel()}")
    return out


# ---- the lookup module ----------------------------------------------------------------------------------------
class _Pool(torch.autograd.Function):
    """Pooled sums; backward applies the fused optimizer (the weights get no .grad), weighing the ids as the
    forward did (`all_weighted`)."""

    @staticmethod
    def forward(ctx, lookup, indices, offsets, psw, all_weighted, *weights):  # type: ignore[override]
        ctx.lookup, ctx.inputs, ctx.n = lookup, (indices, offsets, psw, all_weighted), len(weights)
        return lookup.pooled(indices, offsets, psw, all_weighted)

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        ctx.lookup.apply_gradient(grad_BD, *ctx.inputs)
        ctx.inputs = None
        return (None,) * (5 + ctx.n)


class SmallTableLookup(NoCache, CountedSteps, ShardLookup):
    """Shards of small tables (fp32, in device memory) pooled by the small-table kernels, optimizer fused into
    the backward. Same contract as TBELookup (constructor, forward, shard_weights and the cache no-ops)."""

    def __init__(self, *args: Any, kernel: SmallTableOptions | None = None, **kwargs: Any) -> None:
        """ShardLookup's arguments (shards, optimizer, device, seed, options), and the kernels' options `kernel`
        (keyword only; default SmallTableOptions())."""
        self.kernel = kernel or SmallTableOptions()  # a plain attribute, read by _build
        super().__init__(*args, **kwargs)

    def _build(self, device: torch.device, seed: int | None) -> None:
        self._check(device)
        self.layout, self._place = shards_layout(self.shards)
        self.weights = nn.ParameterList()
        self._state: list[dict[str, torch.Tensor]] = []
        self._grads: list[torch.Tensor] = []
        self._touched: list[torch.Tensor] | None = [] if self._needs_touched else None
        for g in self.layout.groups:
            w = torch.empty(g.rows, g.dim, dtype=torch.float32, device=device)
            self.weights.append(nn.Parameter(w))
            self._state.append(optimizer_state(self.optimizer, w))
            if not self.kernel.direct_sgd:
                self._grads.append(torch.zeros_like(w))
            if self._touched is not None:
                self._touched.append(torch.zeros(g.rows, dtype=torch.int8, device=device))
        with torch.no_grad():
            for s, view in zip(self.shards, self.shard_weights()):
                sh = s.shard
                init = init_rows(
                    s.table, s.table_index, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols, seed, view.device
                )
                view.copy_(init)
        self._step = 0

    @property
    def _needs_touched(self) -> bool:
        return self.optimizer.kind is OptimizerKind.ADAM or self.optimizer.weight_decay > 0

    def _check(self, device: torch.device) -> None:
        names = [s.table.name for s in self.shards]
        fp16 = [s.table.name for s in self.shards if s.table.data_type is not DataType.FP32]
        if fp16:
            raise ConfigError(
                f"tables {fp16}: the small-table kernel keeps fp32 weights; use data_type fp32 for them, or the "
                "FBGEMM TBE lookup (small_table_kernel: false)"
            )
        off_device = [s.table.name for s in self.shards if s.tier not in (MemoryTier.HBM, MemoryTier.HOST)]
        if off_device:
            raise ConfigError(
                f"tables {off_device}: the small-table kernel keeps weights in the compute device's memory (tier "
                "hbm, or host on CPUs); give them tier hbm, or use the FBGEMM TBE lookup for UVM tiers"
            )
        o = self.optimizer
        if self.kernel.direct_sgd and (o.kind is not OptimizerKind.SGD or o.weight_decay):
            raise ConfigError(
                f"tables {names}: direct_sgd adds the update into the weights and needs optimizer sgd without weight "
                f"decay (got {o.kind.value}, weight_decay={o.weight_decay}); set direct_sgd: false"
            )

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1)."""
        if len(self.features) and (offsets.numel() - 1) % len(self.features):
            raise ValueError(
                f"SmallTableLookup over features {self.features}: offsets has {offsets.numel()} entries, not "
                f"F*B+1 with F={len(self.features)}; pass one bag per feature and sample, feature-major"
            )
        forced = self.every_id_weighted  # a padded batch weighs every id
        weighted = any(s.table.weighted for s in self.shards)
        psw = weights if weights is not None and (weighted or forced) else None
        if torch.is_grad_enabled():
            return _Pool.apply(self, indices, offsets, psw, forced, *self.weights)
        return self.pooled(indices, offsets, psw, forced)

    def pooled(
        self, indices: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None, all_weighted: bool = False
    ) -> torch.Tensor:
        """Forward without autograd (`all_weighted`: `psw` weighs every feature's ids, as `pool`)."""
        w = [p.detach() for p in self.weights]
        out_dtype = self.options.output_dtype.torch_dtype
        return pool(self.layout, w, indices, offsets, psw, out_dtype, self.kernel, all_weighted)

    def apply_gradient(
        self,
        grad_BD: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        all_weighted: bool = False,
    ) -> None:
        """Backward: the rows' gradients, then the update rule on the touched rows (`psw` and `all_weighted`: the
        forward's)."""
        self._step += 1
        o, k = self.optimizer, self.kernel
        weights = [p.detach() for p in self.weights]
        triton_path = use_triton(k.impl, indices.device)
        if k.direct_sgd:
            if triton_path:
                grad_BD = grad_BD if grad_BD.stride(-1) == 1 else grad_BD.contiguous()
                indices, offsets = indices.contiguous(), offsets.contiguous()
                psw = psw.contiguous() if psw is not None else None
                if grad_BD.shape[0] and indices.numel():
                    _grad_kernels().backward_atomic(
                        weights, None, self.layout.on(indices.device, all_weighted), indices, offsets, psw, grad_BD,
                        k.tiles, -o.lr,
                    )  # fmt: skip
                return
            grads = [torch.zeros_like(w) for w in weights]
            dense_gradients(self.layout, grads, grad_BD, indices, offsets, psw, k, all_weighted=all_weighted)
            for w, g in zip(weights, grads):
                w.sub_(g * o.lr)
            return
        touched = self._touched
        dense_gradients(self.layout, self._grads, grad_BD, indices, offsets, psw, k, touched, all_weighted)
        for i, (w, g) in enumerate(zip(weights, self._grads)):
            t = touched[i] if touched is not None else None
            if triton_path:
                _kernels().update(
                    _KIND[o.kind], w, g, self._state[i], t, o.lr, o.eps, o.weight_decay, o.beta1, o.beta2,
                    self._step, True, k.tiles,
                )  # fmt: skip
            else:
                apply_update(o, w, self._state[i], g, self._step, False, t.bool() if t is not None else None)
                g.zero_()
                if t is not None:
                    t.zero_()

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard (views into the width groups' blocks, in shard order)."""
        out = []
        for s, (gi, r0) in zip(self.shards, self._place):
            out.append(self.weights[gi].data[r0 : r0 + s.shard.num_rows])
        return out

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """Each shard's optimizer state (views; names as embshard.lookup.updates.optimizer_state: 'm' [, 'v'])."""
        out = []
        for s, (gi, r0) in zip(self.shards, self._place):
            out.append({k: v[r0 : r0 + s.shard.num_rows] for k, v in self._state[gi].items()})
        return out
