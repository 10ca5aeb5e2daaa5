"""Data-parallel sharding: every rank holds a full replica of the table and looks up its own batch locally.

Data flow for one step, on every rank:
1. input dist: none; the local batch's ids of the data-parallel features are only selected and reordered;
2. lookup: `embedding_bag` sums over the replica, for the local batch; no output dist either;
3. backward: each rank forms the dense gradient of every replica from its local batch (embedding_bag's own
   backward, deterministic on CPU and CUDA), plus a per-row count of the ids it looked up; one all-reduce sums both over ranks (the gradient of the global-batch loss is the sum
   of the ranks' local losses' gradients). Every rank then applies the same update (embshard.lookup's
   `sparse_update`, the fused optimizers' rule) to the rows touched anywhere in the global batch. The all-reduce
   gives every rank the same bits, so the replicas stay bitwise identical.

The update runs inside backward, like FBGEMM's fused optimizers, and the replicas get no `.grad`. Replicas live
on the compute device whatever the tier says; fp16 tables keep fp16 values in fp32 storage (rounded to nearest
after each update, as HostLookup does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embshard.comm import start_all_reduce
from embshard.lookup import LocalShard, init_rows, optimizer_state, sparse_update
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.exchange import LookupInput
from embshard.tables import DataType, TableConfig
from embshard.tiers import LookupOptions


class Ready:
    """A result that needs no communication, behind the same `.wait()` as the exchanges."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self):
        """Return the value."""
        return self._value


class _ReplicaBags(torch.autograd.Function):
    """Pooled sums over the replicas; backward all-reduces the gradient and updates the replicas in place."""

    @staticmethod
    def forward(ctx, lookup, indices, offsets, psw, *stacks):  # type: ignore[override]
        ctx.lookup, ctx.inputs = lookup, (indices, offsets, psw)
        return lookup.pool(indices, offsets, psw, [w.detach() for w in stacks])

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        ctx.lookup.apply_gradient(grad_BD, *ctx.inputs)
        return (None,) * (4 + len(ctx.lookup.stacks))


class DataParallelLookup(nn.Module):
    """Full replicas of the data-parallel tables, updated with the all-reduced gradient in backward.

    Tables of one width and weighted-ness are stacked into one `[sum of rows, D]` tensor (each table a block of
    rows), so a group of tables costs one embedding_bag, one gradient and one update, however many it holds.
    """

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int | None,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        self._out_dtype = (options or LookupOptions()).output_dtype.torch_dtype
        grouped: dict[tuple[int, bool, DataType], list[LocalShard]] = {}
        for s in shards:
            grouped.setdefault((s.table.embedding_dim, s.table.weighted, s.table.data_type), []).append(s)
        self.shards = [s for g in grouped.values() for s in g]
        self.features = [f for s in self.shards for f in s.features]
        self.dims = [s.table.embedding_dim for s in self.shards for _ in s.features]
        self.opt, self.group = optimizer, group
        self._groups: list[tuple[int, int, int, bool]] = []  # (first feature, end feature, width, weighted)
        self._blocks: list[tuple[int, int, int]] = []  # per shard: (group, first row in the stack, rows)
        bases: list[int] = []  # per feature: first row of its table in the group's stack
        stacks = []
        self._fp16: list[bool] = []  # per stack: fp16 table values, kept in fp32 (as HostLookup does)
        for (dim, weighted, data_type), members in grouped.items():
            f0, row = len(bases), 0
            for s in members:
                self._blocks.append((len(stacks), row, s.table.num_embeddings))
                bases += [row] * len(s.features)
                row += s.table.num_embeddings
            self._groups.append((f0, len(bases), dim, weighted))
            t = [init_rows(s.table, s.table_index, 0, s.table.num_embeddings, 0, dim, seed, device) for s in members]
            self._fp16.append(data_type is DataType.FP16)
            stacks.append(torch.cat(t).half().float() if self._fp16[-1] else torch.cat(t))
        # requires_grad only puts the lookup into the autograd graph: backward returns no gradient for them.
        self.stacks = nn.ParameterList(nn.Parameter(w) for w in stacks)
        self.register_buffer("_bases", torch.tensor(bases, dtype=torch.int64, device=device), persistent=False)
        if seed is None and dist.is_initialized() and dist.get_world_size(group) > 1:
            # Drawn on the device, not reproducibly: start every replica from rank 0's draw.
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for w in self.stacks:
                dist.broadcast(w.data, src=src, group=group)
        self._state = [optimizer_state(optimizer, w) for w in self.stacks]
        self._step = 0

    def _layout(self, indices: torch.Tensor, offsets: torch.Tensor) -> tuple[int, list[int], torch.Tensor]:
        """Batch size B, where each feature's ids start (F + 1 values; one host sync), and the ids as rows of
        their group's stack."""
        F_ = len(self.features)
        B = (offsets.numel() - 1) // F_
        starts = offsets[torch.arange(F_ + 1, device=offsets.device) * B]
        shift = torch.repeat_interleave(self._bases, starts.diff(), output_size=indices.numel())
        return B, starts.tolist(), indices + shift

    def pool(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        stacks: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1)."""
        B, bounds, rows = self._layout(indices, offsets)
        outs = []
        for (f0, f1, D, weighted), w in zip(self._groups, stacks):
            lo, hi = bounds[f0], bounds[f1]
            pooled = F.embedding_bag(
                rows[lo:hi],
                w,
                offsets[f0 * B : f1 * B] - lo,
                mode="sum",
                per_sample_weights=psw[lo:hi] if (weighted and psw is not None) else None,
            )  # [(f1 - f0) * B, D], feature-major
            outs.append(pooled.view(f1 - f0, B, D).transpose(0, 1).reshape(B, (f1 - f0) * D))
        return torch.cat(outs, dim=1)

    def apply_gradient(
        self, grad_BD: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None
    ) -> None:
        """Local dense gradients and touch counts -> one all-reduce -> the same update on every rank."""
        # The dense gradients come from embedding_bag's own backward (sort-based on CUDA, so reproducible).
        with torch.enable_grad():
            leaves = [w.detach().requires_grad_() for w in self.stacks]
            grads = torch.autograd.grad(self.pool(indices, offsets, psw, leaves), leaves, grad_BD)
        _, bounds, rows = self._layout(indices, offsets)
        counts = [w.new_zeros(w.shape[0]) for w in self.stacks]
        for (f0, f1, _, _), c in zip(self._groups, counts):  # sums of ones: exact in any order
            ids = rows[bounds[f0] : bounds[f1]]
            c.index_add_(0, ids, torch.ones_like(ids, dtype=c.dtype))
        flat = torch.cat([t.reshape(-1) for pair in zip(grads, counts) for t in pair])
        flat = start_all_reduce(flat, self.group).wait()
        self._step += 1
        pos = 0
        with torch.no_grad():
            for w, st, fp16 in zip(self.stacks, self._state, self._fp16):
                n_grad, n_rows = w.numel(), w.shape[0]
                g = flat[pos : pos + n_grad].view_as(w)
                touched = flat[pos + n_grad : pos + n_grad + n_rows].nonzero().squeeze(1)
                pos += n_grad + n_rows
                if touched.numel():
                    sparse_update(self.opt, w.data, st, touched, g[touched], self._step, fp16)

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` (same contract as TBELookup); the update happens in backward."""
        pooled = _ReplicaBags.apply(self, indices.long(), offsets.long(), weights, *self.stacks)
        return pooled.to(self._out_dtype)

    def shard_weights(self) -> list[torch.Tensor]:
        """Each table's replica (views into the stacks), in shard order."""
        return [self.stacks[g].data[r0 : r0 + n] for g, r0, n in self._blocks]

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream=None) -> None:
        """No cache: nothing to do."""

    def drop_cache(self) -> None:
        """No cache: nothing to do."""

    def cache_stats(self) -> dict[str, dict]:
        """No cache: no statistics."""
        return {}

    def reset_cache_stats(self) -> None:
        """No cache: nothing to reset."""


class DataParallelSharding(nn.Module):
    """The data-parallel tables of the collection: local lookups, gradients all-reduced in backward."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int | None,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        lookup = DataParallelLookup(shards, optimizer, device, group, seed, options)
        self.lookups = nn.ModuleList([lookup])
        self.keys, self.key_dims = lookup.features, lookup.dims  # the lookup's order: tables grouped by width
        self.weighted = any(s.table.weighted for s in shards)
        self._select: tuple | None = None

    def start_input_dist(
        self,
        lengths_FB: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        feature_index: dict[str, int],
    ) -> Ready:
        """Select this scheme's features from the local batch (no communication)."""
        key = (tuple(feature_index), values.device)
        if self._select is None or self._select[0] != key:
            perm = torch.tensor([feature_index[f] for f in self.keys], device=values.device, dtype=torch.int32)
            self._select = (key, perm)
        if weights is None and self.weighted:
            weights = torch.ones_like(values, dtype=torch.float32)
        lengths, ids, w = torch.ops.fbgemm.permute_2D_sparse_data(
            self._select[1], lengths_FB, values, weights if self.weighted else None
        )
        return Ready(LookupInput(lengths.reshape(-1), ids, w, [lengths_FB.shape[1]]))

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums `[B_local, sum of feature dims]`."""
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(inp.lengths)
        return self.lookups[0](inp.values, offsets, inp.weights)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> Ready:
        """Nothing to send: the pooled rows are already on the rank owning the samples."""
        return Ready(pooled)


def data_parallel(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    rank: int,
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    seed: int | None,
    options: LookupOptions | None = None,
) -> DataParallelSharding | None:
    """The data-parallel part of the collection: this rank's replica of each data-parallel table. None if no
    table is data-parallel."""
    shards = []
    for i, cfg in enumerate(tables):
        tp = plan[cfg.name]
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            (mine,) = [s for s in tp.shards if s.rank == rank]
            shards.append(
                LocalShard(cfg, i, mine, cfg.feature_names, tp.tier, tp.cache_load_factor, tp.cache_algorithm)
            )
    if not shards:
        return None
    return DataParallelSharding(shards, optimizer, device, group, seed, options)
