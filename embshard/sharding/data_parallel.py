"""Data-parallel sharding: every rank holds a full replica of the table and looks up its own batch locally.

Data flow for one step, on every rank:
1. input dist: none; the local batch's ids of the data-parallel features are only selected and reordered;
2. lookup: `embedding_bag` sums over the replica, for the local batch; no output dist either;
3. backward: each rank forms the dense gradient of every replica from its local batch (embedding_bag's own
   backward, deterministic on CPU and CUDA), plus a per-row count of the ids it looked up; one all-reduce sums both over ranks (the gradient of the global-batch loss is the sum
   of the ranks' local losses' gradients). Every rank then applies the same update (embshard.lookup's
   `sparse_update`, the fused optimizers' rule) to the rows touched anywhere in the global batch. The all-reduce
   gives every rank the same bits, so the replicas stay bitwise identical.

The update runs inside backward, like FBGEMM's fused optimizers, and the replicas get no `.grad`. Replicas are
kept in fp32 on the compute device whatever the table's data_type and tier say.
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
from embshard.tables import TableConfig


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
    def forward(ctx, lookup, indices, offsets, psw, *replicas):  # type: ignore[override]
        ctx.lookup, ctx.inputs = lookup, (indices, offsets, psw)
        return lookup.pool(indices, offsets, psw, [w.detach() for w in replicas])

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        ctx.lookup.apply_gradient(grad_BD, *ctx.inputs)
        return (None,) * (4 + len(ctx.lookup.replicas))


class DataParallelLookup(nn.Module):
    """Full replicas of the data-parallel tables, updated with the all-reduced gradient in backward."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int | None,
    ) -> None:
        super().__init__()
        self.shards = list(shards)
        self.features = [f for s in shards for f in s.features]
        self.dims = [s.shard.num_cols for s in shards for _ in s.features]
        self.opt, self.group = optimizer, group
        self._feature_shard = [i for i, s in enumerate(shards) for _ in s.features]
        # requires_grad only puts the lookup into the autograd graph: backward returns no gradient for them.
        self.replicas = nn.ParameterList(
            nn.Parameter(
                init_rows(s.table, s.table_index, 0, s.table.num_embeddings, 0, s.table.embedding_dim, seed, device)
            )
            for s in shards
        )
        if seed is None and dist.is_initialized() and dist.get_world_size(group) > 1:
            # Drawn on the device, not reproducibly: start every replica from rank 0's draw.
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for w in self.replicas:
                dist.broadcast(w.data, src=src, group=group)
        self._state = [optimizer_state(optimizer, w) for w in self.replicas]
        self._step = 0

    def _feature_bounds(self, offsets: torch.Tensor) -> tuple[int, list[int]]:
        """Batch size B and where each feature's ids start (F + 1 values; one host sync)."""
        F_ = len(self.features)
        B = (offsets.numel() - 1) // F_
        return B, offsets[torch.arange(F_ + 1, device=offsets.device) * B].tolist()

    def pool(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        replicas: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1), over
        `replicas` (default: this module's)."""
        replicas = self.replicas if replicas is None else replicas
        B, bounds = self._feature_bounds(offsets)
        outs = []
        for f, i in enumerate(self._feature_shard):
            lo, hi = bounds[f], bounds[f + 1]
            weighted = psw is not None and self.shards[i].table.weighted
            outs.append(
                F.embedding_bag(
                    indices[lo:hi],
                    replicas[i],
                    offsets[f * B : (f + 1) * B] - lo,
                    mode="sum",
                    per_sample_weights=psw[lo:hi] if weighted else None,
                )
            )
        return torch.cat(outs, dim=1)

    def apply_gradient(
        self, grad_BD: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None
    ) -> None:
        """Local dense gradients and touch counts -> one all-reduce -> the same update on every rank."""
        # The dense gradients come from embedding_bag's own backward (sort-based on CUDA, so reproducible).
        with torch.enable_grad():
            leaves = [w.detach().requires_grad_() for w in self.replicas]
            grads = torch.autograd.grad(self.pool(indices, offsets, psw, leaves), leaves, grad_BD)
        _, bounds = self._feature_bounds(offsets)
        counts = [w.new_zeros(w.shape[0]) for w in self.replicas]
        for f, i in enumerate(self._feature_shard):  # sums of ones: exact in any order
            ids = indices[bounds[f] : bounds[f + 1]]
            counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=counts[i].dtype))
        flat = torch.cat([t.reshape(-1) for pair in zip(grads, counts) for t in pair])
        flat = start_all_reduce(flat, self.group).wait()
        self._step += 1
        pos = 0
        with torch.no_grad():
            for w, st in zip(self.replicas, self._state):
                n_grad, n_rows = w.numel(), w.shape[0]
                g = flat[pos : pos + n_grad].view_as(w)
                rows = flat[pos + n_grad : pos + n_grad + n_rows].nonzero().squeeze(1)
                pos += n_grad + n_rows
                if rows.numel():
                    sparse_update(self.opt, w.data, st, rows, g[rows], self._step)

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` (same contract as TBELookup); the update happens in backward."""
        return _ReplicaBags.apply(self, indices.long(), offsets.long(), weights, *self.replicas)

    def shard_weights(self) -> list[torch.Tensor]:
        """The replicas, in shard order."""
        return [w.data for w in self.replicas]


class DataParallelSharding(nn.Module):
    """The data-parallel tables of the collection: local lookups, gradients all-reduced in backward."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        seed: int | None,
    ) -> None:
        super().__init__()
        self.lookups = nn.ModuleList([DataParallelLookup(shards, optimizer, device, group, seed)])
        self.keys = [f for s in shards for f in s.features]
        self.key_dims = [s.table.embedding_dim for s in shards for _ in s.features]
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
) -> DataParallelSharding | None:
    """The data-parallel part of the collection: this rank's replica of each data-parallel table. None if no
    table is data-parallel."""
    shards = []
    for i, cfg in enumerate(tables):
        tp = plan[cfg.name]
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            (mine,) = [s for s in tp.shards if s.rank == rank]
            shards.append(LocalShard(cfg, i, mine, cfg.feature_names, tp.tier, tp.cache_load_factor))
    if not shards:
        return None
    return DataParallelSharding(shards, optimizer, device, group, seed)
