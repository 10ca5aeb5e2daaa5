"""Local lookups: the shards a rank holds, grouped into FBGEMM TBE kernels with the optimizer fused in.

One `TBELookup` per group of compatible shards (same tier, weight type, weighted-ness). Input: the ids of the
rank's lookup features for the (global) batch, as indices + offsets in feature-major order. Output: pooled
sums `[B, sum of feature widths]`, features in the lookup's order. Pooling is always a sum here; mean pooling
is applied after the output exchange, where every bag's full length is known (row-wise shards see only part).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embshard.optim import FusedOptimizerConfig, OptimizerKind
from embshard.plan import MemoryTier, Shard
from embshard.tables import ConfigError, DataType, TableConfig

INIT_CHUNK_ROWS = 65536  # rows drawn per generator seed, so any row block initialises identically


def init_rows(
    cfg: TableConfig,
    table_index: int,
    row_offset: int,
    num_rows: int,
    col_offset: int,
    num_cols: int,
    seed: int | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Deterministic initial weights of rows [row_offset, +num_rows) x columns [col_offset, +num_cols).

    The same (seed, table_index) gives the same full table whichever block is asked for, so a sharded table
    starts identical to its unsharded twin. Values are uniform in [-cfg.init_bound, cfg.init_bound].
    `seed=None` draws on the device instead (fast for huge tables, not reproducible across shardings).
    """
    if seed is None:
        return torch.empty(num_rows, num_cols, device=device).uniform_(-cfg.init_bound, cfg.init_bound)
    out = torch.empty(num_rows, num_cols, dtype=torch.float32)
    gen = torch.Generator()  # always the CPU generator: the same numbers whatever device the shard lives on
    first, last = row_offset // INIT_CHUNK_ROWS, (row_offset + num_rows - 1) // INIT_CHUNK_ROWS
    for chunk in range(first, last + 1):
        c0 = chunk * INIT_CHUNK_ROWS
        c1 = min(c0 + INIT_CHUNK_ROWS, cfg.num_embeddings)
        gen.manual_seed(hash((seed, table_index, chunk)) & 0x7FFF_FFFF_FFFF)
        block = torch.empty(c1 - c0, cfg.embedding_dim).uniform_(-cfg.init_bound, cfg.init_bound, generator=gen)
        lo, hi = max(c0, row_offset), min(c1, row_offset + num_rows)
        out[lo - row_offset : hi - row_offset] = block[lo - c0 : hi - c0, col_offset : col_offset + num_cols]
    out = out.to(device)
    return out


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank holds, and the lookup features (in order) that read it."""

    table: TableConfig
    """The table the shard belongs to."""
    table_index: int
    """Index of the table in the collection (for deterministic initialisation)."""
    shard: Shard
    """The block of the table."""
    features: tuple[str, ...]
    """Lookup keys that read this shard, in lookup order."""
    tier: MemoryTier
    """Memory tier."""
    cache_load_factor: float = 0.2
    """UVM-caching cache size as a fraction of rows."""

    @property
    def group_key(self) -> tuple:
        """Shards with equal keys share one TBE."""
        return (self.tier, self.table.data_type, self.table.weighted)


def _location(tier: MemoryTier, device: torch.device) -> tuple:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    if device.type == "cpu":
        if tier is not MemoryTier.HOST:
            raise ConfigError(
                f"memory tier {tier.value!r} needs a GPU, but this process computes on the CPU: plan with "
                "tier 'host' for CPU training, or run on GPUs"
            )
        return EmbeddingLocation.HOST, ComputeDevice.CPU
    loc = {
        MemoryTier.HBM: EmbeddingLocation.DEVICE,
        MemoryTier.UVM: EmbeddingLocation.MANAGED,
        MemoryTier.UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
    }.get(tier)
    if loc is None:
        raise ConfigError(f"memory tier {tier.value!r} is for CPU training; on GPU use hbm, uvm or uvm_caching")
    return loc, ComputeDevice.CUDA


class TBELookup(nn.Module):
    """One FBGEMM TBE over a group of compatible shards, optimizer fused into its backward."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        keys = {s.group_key for s in shards}
        if len(keys) != 1:
            raise ValueError(f"TBELookup needs shards with one group key, got {keys}")
        self.shards = list(shards)
        self.features = [f for s in shards for f in s.features]
        self.dims = [s.shard.num_cols for s in shards for _ in s.features]
        self.weighted = shards[0].table.weighted
        tier = shards[0].tier
        location, compute = _location(tier, device)
        for s in shards:
            if s.shard.num_cols % 4:
                raise ConfigError(
                    f"table {s.table.name!r}: a shard is {s.shard.num_cols} columns wide; FBGEMM's TBE needs a "
                    "multiple of 4: change embedding_dim or the column split"
                )
        if device.type == "cuda" and optimizer.weight_decay and optimizer.kind is not OptimizerKind.ROWWISE_ADAGRAD:
            raise ConfigError(
                f"optimizer {optimizer.kind.value} with weight_decay={optimizer.weight_decay}: FBGEMM's fused GPU kernel "
                "ignores weight decay for this optimizer (seen with fbgemm-gpu 1.6 and 1.8); use rowwise_adagrad, or "
                "weight_decay: 0"
            )
        kwargs = optimizer.fbgemm_kwargs()
        if tier is MemoryTier.UVM_CACHING:
            kwargs["cache_load_factor"] = shards[0].cache_load_factor
        dtype = SparseType.FP16 if shards[0].table.data_type is DataType.FP16 else SparseType.FP32
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(s.shard.num_rows, s.shard.num_cols, location, compute) for s in shards],
            feature_table_map=[i for i, s in enumerate(shards) for _ in s.features],
            pooling_mode=PoolingMode.SUM,
            weights_precision=dtype,
            output_dtype=SparseType.FP32,
            device=device,
            bounds_check_mode=BoundsCheckMode.FATAL if device.type == "cuda" else BoundsCheckMode.NONE,
            **kwargs,
        )
        with torch.no_grad():
            for w, s in zip(self.tbe.split_embedding_weights(), shards):
                sh = s.shard
                init = init_rows(
                    s.table,
                    s.table_index,
                    sh.row_offset,
                    sh.num_rows,
                    sh.col_offset,
                    sh.num_cols,
                    seed,
                    w.device,
                )
                w.copy_(init.to(w.dtype))

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1)."""
        return self.tbe(indices.long(), offsets.long(), per_sample_weights=weights if self.weighted else None)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard (views, in shard order)."""
        return list(self.tbe.split_embedding_weights())


def optimizer_state(opt: FusedOptimizerConfig, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero optimizer state for the weights `w` `[rows, cols]` (fp32, on w's device)."""
    kind = opt.kind
    state: dict[str, torch.Tensor] = {}
    if kind in (OptimizerKind.ADAGRAD, OptimizerKind.ADAM):
        state["m"] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    if kind is OptimizerKind.ADAM:
        state["v"] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    if kind is OptimizerKind.ROWWISE_ADAGRAD:
        state["m"] = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
    return state


def sparse_update(
    o: FusedOptimizerConfig, w: torch.Tensor, st: dict[str, torch.Tensor], rows: torch.Tensor, g: torch.Tensor, t: int
) -> None:
    """Apply the update rule (module docstring of embshard.optim) in place to rows `rows` (unique) of `w`, whose
    aggregated gradient is `g` `[len(rows), cols]`; `t` counts the steps taken so far, this one included."""
    if o.weight_decay:
        g = g + o.weight_decay * w[rows]
    if o.kind is OptimizerKind.SGD:
        w[rows] -= o.lr * g
    elif o.kind is OptimizerKind.ADAGRAD:
        st["m"][rows] += g * g
        w[rows] -= o.lr * g / (st["m"][rows].sqrt() + o.eps)
    elif o.kind is OptimizerKind.ROWWISE_ADAGRAD:
        st["m"][rows] += (g * g).mean(dim=1)
        w[rows] -= o.lr * g / (st["m"][rows].sqrt().unsqueeze(1) + o.eps)
    else:
        m = st["m"][rows].mul_(o.beta1).add_(g, alpha=1 - o.beta1)
        v = st["v"][rows].mul_(o.beta2).addcmul_(g, g, value=1 - o.beta2)
        st["m"][rows], st["v"][rows] = m, v
        w[rows] -= o.lr * (m / (1 - o.beta1**t)) / ((v / (1 - o.beta2**t)).sqrt() + o.eps)


class HostLookup(nn.Module):
    """CPU lookup for what FBGEMM's CPU TBE cannot do: Adam (not implemented there) and weight decay (silently
    ignored there, seen with fbgemm-gpu-cpu 1.8.0). Plain embedding_bag with sparse gradients; the optimizer is
    applied to the touched rows as soon as each shard's gradient is ready (fused into backward)."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if device.type != "cpu":
            raise ValueError("HostLookup computes on the CPU only")
        self.shards = list(shards)
        self.features = [f for s in shards for f in s.features]
        self.dims = [s.shard.num_cols for s in shards for _ in s.features]
        self.weighted = shards[0].table.weighted
        self.opt = optimizer
        self.weights = nn.ParameterList()
        self._state: list[dict[str, torch.Tensor]] = []
        self._step = [0] * len(shards)
        for i, s in enumerate(shards):
            sh = s.shard
            w = init_rows(s.table, s.table_index, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols, seed)
            p = nn.Parameter(w)
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            self.weights.append(p)
            self._state.append(optimizer_state(optimizer, w))
        self._feature_shard = [i for i, s in enumerate(shards) for _ in s.features]

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            grad = p.grad.coalesce()
            p.grad = None
            self._step[i] += 1
            with torch.no_grad():
                sparse_update(self.opt, p.data, self._state[i], grad.indices()[0], grad.values(), self._step[i])

        return hook

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]`, same contract as TBELookup."""
        F = len(self.features)
        B = (offsets.numel() - 1) // F
        outs = []
        for f in range(F):
            lo, hi = f * B, (f + 1) * B
            start = offsets[lo]
            off = offsets[lo : hi + 1] - start
            end = offsets[hi]
            idx = indices[start:end].long()
            psw = weights[start:end] if (weights is not None and self.weighted) else None
            w = self.weights[self._feature_shard[f]]
            outs.append(
                nn.functional.embedding_bag(
                    idx,
                    w,
                    off[:-1].long(),
                    mode="sum",
                    sparse=True,
                    per_sample_weights=psw,
                    include_last_offset=False,
                )
                if B
                else w.new_zeros(0, w.shape[1])
            )
        return torch.cat(outs, dim=1) if outs else indices.new_zeros(B, 0, dtype=torch.float32)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard, in shard order."""
        return [p.data for p in self.weights]


def build_lookups(
    shards: Sequence[LocalShard], optimizer: FusedOptimizerConfig, device: torch.device, seed: int
) -> list[nn.Module]:
    """Group shards by settings, one lookup module per group (first-seen group order, shard order kept)."""
    groups: dict[tuple, list[LocalShard]] = {}
    for s in shards:
        groups.setdefault(s.group_key, []).append(s)
    use_host = device.type == "cpu" and (optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0)
    cls = HostLookup if use_host else TBELookup
    return [cls(g, optimizer, device, seed) for g in groups.values()]
