"""Local lookups: the shards a rank holds, grouped into FBGEMM TBE kernels with the optimizer fused in.

One `TBELookup` per group of compatible shards (`LocalShard.group_key`; settings from tiers.tbe_settings).
Input: the ids of the rank's lookup features for the (global) batch, as indices + offsets in feature-major
order. Output: pooled sums `[B, sum of feature widths]`, features in the lookup's order. Pooling is always a
sum here; mean pooling is applied after the output exchange, where every bag's full length is known (row-wise
shards see only part).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embshard.optim import FusedOptimizerConfig, OptimizerKind, optimizer_state, sparse_update
from embshard.plan import CacheAlgorithm, MemoryTier, Shard
from embshard.tables import ConfigError, DataType, TableConfig
from embshard.tiers import LookupOptions, OutputDtype, summarize_cache_stats, tbe_settings

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
    """UVM-caching cache size as a fraction of the shard's rows."""
    cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """UVM-caching replacement policy."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", MemoryTier(self.tier))
        object.__setattr__(self, "cache_algorithm", CacheAlgorithm(self.cache_algorithm))

    @property
    def group_key(self) -> tuple:
        """Shards with equal keys share one TBE: one TBE has one tier, weight type, weighted-ness and (UVM-caching)
        one cache policy; cache sizes may differ (tiers.py: the group's cache holds the sum)."""
        policy = self.cache_algorithm if self.tier is MemoryTier.UVM_CACHING else None
        return (self.tier, self.table.data_type, self.table.weighted, policy)


INIT_BLOCK_BYTES = 64 << 20  # a TBE's weights are initialised in row blocks of about this size (temporary buffer)


class TBELookup(nn.Module):
    """One FBGEMM TBE over a group of compatible shards, optimizer fused into its backward."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        seed: int = 0,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.shards = list(shards)
        self.features = [f for s in shards for f in s.features]
        self.dims = [s.shard.num_cols for s in shards for _ in s.features]
        self.weighted = shards[0].table.weighted
        self.settings = tbe_settings(shards, options or LookupOptions(), device.type)
        if device.type == "cuda" and optimizer.weight_decay and optimizer.kind is not OptimizerKind.ROWWISE_ADAGRAD:
            raise ConfigError(
                f"optimizer {optimizer.kind.value} with weight_decay={optimizer.weight_decay}: FBGEMM's fused GPU kernel "
                "ignores weight decay for this optimizer (seen with fbgemm-gpu 1.6 and 1.8); use rowwise_adagrad, or "
                "weight_decay: 0"
            )
        if device.type == "cuda" and optimizer.kind is OptimizerKind.ADAM and self.settings.weights_precision == "fp16":
            raise ConfigError(
                f"tables {[s.table.name for s in shards]}: fp16 weights with adam fail inside FBGEMM's GPU kernel "
                "(seen with fbgemm-gpu 1.6.0: 'row_counter_dev' Half vs Float); use data_type fp32 for these tables, "
                "or sgd/adagrad/rowwise_adagrad"
            )
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            device=device, **self.settings.fbgemm_kwargs(), **optimizer.fbgemm_kwargs()
        )
        self.opt_kind = optimizer.kind
        self._cast = OutputDtype(self.settings.cast_output_to).torch_dtype if self.settings.cast_output_to else None
        with torch.no_grad():
            for w, s in zip(self.tbe.split_embedding_weights(), shards):
                sh = s.shard
                block = max(1, INIT_BLOCK_BYTES // (4 * s.table.embedding_dim * INIT_CHUNK_ROWS)) * INIT_CHUNK_ROWS
                for r0 in range(0, sh.num_rows, block):  # in blocks: a UVM table may exceed HBM
                    n = min(block, sh.num_rows - r0)
                    init = init_rows(
                        s.table, s.table_index, sh.row_offset + r0, n, sh.col_offset, sh.num_cols, seed, w.device
                    )
                    w[r0 : r0 + n].copy_(init.to(w.dtype))
        if self.settings.cache_stats:
            requested_F = torch.zeros(len(self.features), dtype=torch.int64, device=device)
            self.register_buffer("_requested_F", requested_F, persistent=False)
            self._occupied_base = 0

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1)."""
        offsets = offsets.long()
        if self.settings.cache_stats:
            F = len(self.features)
            bounds = offsets[torch.arange(F + 1, device=offsets.device) * ((offsets.numel() - 1) // F)]
            self._requested_F += bounds[1:] - bounds[:-1]
        out = self.tbe(indices.long(), offsets, per_sample_weights=weights if self.weighted else None)
        return out.to(self._cast) if self._cast is not None else out

    def prefetch(
        self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream: torch.cuda.Stream | None = None
    ) -> None:
        """Load the rows of a coming batch into the UVM cache (no-op without a cache). The next forward must get
        the same ids."""
        if self.settings.caching:
            self.tbe.prefetch(indices.long(), offsets.long(), forward_stream=forward_stream)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard (views, in shard order). UVM-caching: the cache is written back first (FBGEMM's
        flush also empties it); after writing into these tensors call `drop_cache()` so no stale row hides them."""
        if self.settings.caching:
            self.tbe.flush()
        return list(self.tbe.split_embedding_weights())

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """The fused optimizer's state of each shard (views, in shard order), named as `optim.optimizer_state`:
        adagrad `m` `[rows, D]`, rowwise_adagrad `m` `[rows]`, adam `m` and `v` `[rows, D]`, sgd none. Read from
        FBGEMM's `split_optimizer_states()` (one list of states per table, momentum1 first; the same layout in
        fbgemm-gpu 1.6 and 1.8). UVM tiers keep optimizer state out of the cache: nothing to flush."""
        return [_named_states(self.opt_kind, states) for states in _fbgemm_states(self.tbe, len(self.shards))]

    def drop_cache(self) -> None:
        """Forget every cached row (after flushing nothing is lost); later lookups reload them from UVM."""
        if self.settings.caching:
            self.tbe.flush()
            self.tbe.reset_cache_states()

    # ---- UVM-cache statistics ----------------------------------------------------------------------------
    def _cached_rows(self) -> list[int]:
        state = self.tbe.lxu_cache_state.flatten()
        state = state[(state >= 0) & (state < int(sum(self.settings.rows)))]
        bounds = torch.tensor(self.settings.rows, device=state.device).cumsum(0)
        table = torch.bucketize(state, bounds, right=True)
        return torch.bincount(table, minlength=len(self.settings.rows)).tolist()

    def cache_stats(self) -> dict[str, dict]:
        """Per-table cache statistics since the last reset (tiers.summarize_cache_stats); {} without stats."""
        if not self.settings.cache_stats:
            return {}
        return summarize_cache_stats(
            self.settings,
            self._requested_F.tolist(),
            self.tbe.get_table_wise_cache_miss().tolist(),
            self.tbe.get_uvm_cache_stats().tolist(),
            self._cached_rows(),
            self._occupied_base,
            int(self.tbe.lxu_cache_state.numel()),
        )

    def reset_cache_stats(self) -> None:
        """Start counting afresh."""
        if self.settings.cache_stats:
            self._requested_F.zero_()
            self.tbe.get_table_wise_cache_miss().zero_()
            self.tbe.reset_uvm_cache_stats()
            self._occupied_base = sum(self._cached_rows())


class HostLookup(nn.Module):
    """CPU lookup for what FBGEMM's CPU TBE cannot do: Adam (not implemented there) and weight decay (silently
    ignored there, seen with fbgemm-gpu-cpu 1.8.0). Plain embedding_bag with sparse gradients; the optimizer is
    applied to the touched rows as soon as each shard's gradient is ready (fused into backward). fp16 tables keep
    fp16 values in fp32 storage (torch cannot add sparse fp16 gradients on the CPU): initial and updated values
    are rounded to the nearest fp16 value (no stochastic rounding here), so the numerics are those of fp16."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        seed: int = 0,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        if device.type != "cpu":
            raise ValueError("HostLookup computes on the CPU only")
        tbe_settings(shards, options or LookupOptions(), device.type)  # the same checks as a TBE
        self._out_dtype = (options or LookupOptions()).output_dtype.torch_dtype
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
            p = nn.Parameter(w.half().float() if s.table.data_type is DataType.FP16 else w)
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            self.weights.append(p)
            self._state.append(optimizer_state(optimizer, w))
        self._fp16 = [s.table.data_type is DataType.FP16 for s in shards]
        self._feature_shard = [i for i, s in enumerate(shards) for _ in s.features]

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            grad = p.grad.coalesce()
            p.grad = None
            self._step[i] += 1
            with torch.no_grad():
                sparse_update(
                    self.opt, p.data, self._state[i], grad.indices()[0], grad.values(), self._step[i], self._fp16[i]
                )

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
            w = self.weights[self._feature_shard[f]]
            psw = weights[start:end] if (weights is not None and self.weighted) else None
            # Also for B == 0 (an empty global batch): the output must reach the weights, so that backward runs
            # here (the output all-to-all's backward is a collective) and the step is counted (Adam's t).
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
            )
        out = torch.cat(outs, dim=1) if outs else indices.new_zeros(B, 0, dtype=torch.float32)
        return out.to(self._out_dtype)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard, in shard order."""
        return [p.data for p in self.weights]

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each shard, in shard order (`optim.optimizer_state`'s names and shapes)."""
        return [dict(st) for st in self._state]

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream=None) -> None:
        """No cache on the host: nothing to do."""

    def drop_cache(self) -> None:
        """No cache on the host: nothing to do."""

    def cache_stats(self) -> dict[str, dict]:
        """No cache on the host: no statistics."""
        return {}

    def reset_cache_stats(self) -> None:
        """No cache on the host: nothing to reset."""


def _fbgemm_states(tbe: nn.Module, tables: int) -> list[list[torch.Tensor]]:
    """FBGEMM's per-table optimizer states; sgd has none (fbgemm-gpu 1.8 then returns an empty list)."""
    states = tbe.split_optimizer_states()
    return [list(s) for s in states] if states else [[] for _ in range(tables)]


def _named_states(kind: OptimizerKind, states: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """FBGEMM's states of one table under embshard's names: momentum1 is `m`, Adam's momentum2 is `v`."""
    names = {OptimizerKind.SGD: (), OptimizerKind.ADAM: ("m", "v")}.get(kind, ("m",))
    return dict(zip(names, states))


def build_lookups(
    shards: Sequence[LocalShard],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    seed: int,
    options: LookupOptions | None = None,
) -> list[nn.Module]:
    """Group shards by settings, one lookup module per group (first-seen group order, shard order kept)."""
    use_host = device.type == "cpu" and (optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0)
    cls = HostLookup if use_host else TBELookup
    return [cls(g, optimizer, device, seed, options) for g in group_shards(shards)]


def group_shards(shards: Sequence[LocalShard]) -> list[list[LocalShard]]:
    """Shards grouped into TBEs by `group_key`: groups in first-seen order, shards in their order within."""
    groups: dict[tuple, list[LocalShard]] = {}
    for s in shards:
        groups.setdefault(s.group_key, []).append(s)
    return list(groups.values())
