"""Data-parallel sharding: every rank holds a full replica of the table and looks up its own batch locally.

Data flow for one step, on every rank:
1. input dist: none; the local batch's ids of the data-parallel features are only selected and reordered;
2. lookup: one FBGEMM `DenseTableBatchedEmbeddingBagsCodegen` pools (sums) over all the replicas, for the local
   batch; no output dist either;
3. backward: FBGEMM's dense backward forms the gradient of all the replicas (one flat tensor) from the local
   batch; one all-reduce sums it over ranks (the gradient of the global-batch loss is the sum of the ranks' local
   losses' gradients). Every rank then applies the same update (`embshard.optim.apply_update`, the fused
   optimizers' rule) to the same summed bits, so the replicas stay bitwise identical.

Touched rows. The rule updates only rows the global batch touched. For sgd, adagrad and rowwise_adagrad without
weight decay a row with a zero gradient is left exactly as it is by the rule itself (state += 0, w -= lr * 0), so
the update runs over all rows, with no host sync. Adam (its moments decay on every touched row) and weight decay
need the touched rows: each rank marks the rows its ids read, the marks ride in the gradient's all-reduce, and the
update keeps untouched rows with `torch.where` (still no host sync).

The update runs inside backward, like FBGEMM's fused optimizers; the replicas get no `.grad`. Replicas live on the
compute device whatever the tier says; fp16 tables keep fp16 values in fp32 storage (rounded to nearest after each
update, as HostLookup does).

Determinism: FBGEMM's dense backward is deterministic on the CPU (tested). On CUDA it is FBGEMM's sort-based
backward, whose summation order for rows with very many ids in a batch is not guaranteed run to run, so two runs
with one seed may differ in the last bits there. The replicas still agree bitwise across ranks whatever the order:
every rank applies the same update to the same all-reduced gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embshard.comm import start_all_reduce, world_and_rank
from embshard.lookup import LocalShard, init_rows
from embshard.optim import FusedOptimizerConfig, OptimizerKind, apply_update, optimizer_state
from embshard.plan import ShardingPlan, ShardingType
from embshard.sharding.exchange import BatchCounts, LocalIds, LookupInput, cached_tensor, feature_of_ids
from embshard.tables import ConfigError, DataType, TableConfig, feature_columns
from embshard.tiers import LookupOptions

# FBGEMM's CPU kernel builds its own autograd graph (the gradient is right) but torch warns on its backward.
_CPU_BACKWARD_WARNING = "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered"


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
    def forward(ctx, lookup, indices, offsets, psw, weights):  # type: ignore[override]
        with torch.enable_grad():  # FBGEMM's own graph: backward runs only its dense backward, not the lookup
            pooled = lookup.tbe(indices, offsets, psw)
        ctx.lookup, ctx.pooled, ctx.inputs = lookup, pooled, (indices, offsets)
        return pooled.detach()

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        lookup, pooled = ctx.lookup, ctx.pooled
        ctx.pooled = None
        with warnings.catch_warnings() if not grad_BD.is_cuda else nullcontext():
            if not grad_BD.is_cuda:
                warnings.filterwarnings("ignore", message=_CPU_BACKWARD_WARNING)
            (grad,) = torch.autograd.grad(pooled, lookup.tbe.weights, grad_BD)
        lookup.apply_gradient(grad, *ctx.inputs)
        return (None,) * 5


class DataParallelLookup(nn.Module):
    """Full replicas of the data-parallel tables in one FBGEMM dense TBE (one flat weight tensor), updated with
    the all-reduced gradient in backward.

    Tables are ordered by (width, data type), so the tables of one width form one `[rows, D]` block of the flat
    weights: the update costs a few kernels per block, however many tables it holds."""

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
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

        self._out_dtype = (options or LookupOptions()).output_dtype.torch_dtype
        for s in shards:
            if s.table.embedding_dim % 4:
                raise ConfigError(
                    f"table {s.table.name!r}: embedding_dim={s.table.embedding_dim}; FBGEMM's TBE (data-parallel "
                    "tables included) needs a multiple of 4: change embedding_dim"
                )
        grouped: dict[tuple[int, DataType], list[LocalShard]] = {}
        for s in shards:
            grouped.setdefault((s.table.embedding_dim, s.table.data_type), []).append(s)
        self.shards = [s for g in grouped.values() for s in g]
        self.features = [f for s in self.shards for f in s.features]
        self.dims = [s.table.embedding_dim for s in self.shards for _ in s.features]
        self.opt, self.group = optimizer, group
        specs = [(s.table.num_embeddings, s.table.embedding_dim) for s in self.shards]
        cuda = device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        # The TBE fills its weights with torch.randn: keep the caller's random stream untouched.
        with (
            torch.random.fork_rng(devices=[index] if cuda else []),
            torch.cuda.device(index) if cuda else nullcontext(),
        ):
            self.tbe = DenseTableBatchedEmbeddingBagsCodegen(
                specs, feature_table_map=[i for i, s in enumerate(self.shards) for _ in s.features], use_cpu=not cuda
            )
        self._blocks: list[tuple[int, int]] = []  # per shard: (first element in the flat weights, first row)
        self._groups: list[tuple[int, int, int, int, bool]] = []  # (first element, first row, rows, D, fp16)
        elem = row = 0
        for (dim, data_type), members in grouped.items():
            self._groups.append(
                (elem, row, sum(s.table.num_embeddings for s in members), dim, data_type is DataType.FP16)
            )
            for s in members:
                self._blocks.append((elem, row))
                elem += s.table.num_embeddings * dim
                row += s.table.num_embeddings
        self._rows = row
        flat = self.tbe.weights.data
        with torch.no_grad():
            for s, w in zip(self.shards, self.shard_weights()):
                init = init_rows(
                    s.table, s.table_index, 0, s.table.num_embeddings, 0, s.table.embedding_dim, seed, device
                )
                w.copy_(init.half().float() if s.table.data_type is DataType.FP16 else init)
        if seed is None and dist.is_initialized() and dist.get_world_size(group) > 1:
            # Drawn on the device, not reproducibly: start every replica from rank 0's draw.
            dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        row0_F = [self._blocks[i][1] for i, s in enumerate(self.shards) for _ in s.features]
        weighted_F = [s.table.weighted for s in self.shards for _ in s.features]
        self._weighted = "all" if all(weighted_F) else "none" if not any(weighted_F) else "some"
        self.register_buffer("_row0_F", torch.tensor(row0_F, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("_weighted_F", torch.tensor(weighted_F, device=device), persistent=False)
        self._needs_touched = optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0
        self._state = optimizer_state(optimizer, flat, rows=self._rows)
        self._step = 0

    def _per_id(self, values_F: torch.Tensor, offsets: torch.Tensor, n_ids: int) -> torch.Tensor:
        """`values_F[f]` for every id of feature f (ids feature-major; no host sync)."""
        B = (offsets.numel() - 1) // len(self.features)
        if B == 0:
            return values_F[:0]
        counts_F = offsets[::B].diff().long()  # offsets at each feature's first bag, and the end
        return values_F[feature_of_ids(counts_F, n_ids)]

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` (same contract as TBELookup); the update happens in backward."""
        if indices.dtype not in (torch.int32, torch.int64):
            indices = indices.long()
        psw = None
        if weights is not None and self._weighted != "none":
            psw = weights.float()
            if self._weighted == "some":  # unweighted features pool with weight 1
                psw = torch.where(self._per_id(self._weighted_F, offsets, indices.numel()), psw, 1.0)
        if torch.is_grad_enabled():
            pooled = _ReplicaBags.apply(self, indices, offsets, psw, self.tbe.weights)
        else:
            pooled = self.tbe(indices, offsets, psw)
        return pooled.to(self._out_dtype)

    def apply_gradient(self, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """Local flat gradient (+ touched-row marks) -> one all-reduce -> the same update on every rank."""
        n = grad.numel()
        touched = None
        if self._needs_touched:
            rows = indices.long() + self._per_id(self._row0_F, offsets, indices.numel())
            marks = grad.new_zeros(self._rows).index_fill_(0, rows, 1.0)
            summed = start_all_reduce(torch.cat([grad, marks]), self.group).wait()
            grad, touched = summed[:n], summed[n:] > 0
        else:
            grad = start_all_reduce(grad, self.group).wait()
        self._step += 1
        flat = self.tbe.weights.data
        per_row = self.opt.kind is OptimizerKind.ROWWISE_ADAGRAD  # one state value a row
        with torch.no_grad():
            for e0, r0, R, D, fp16 in self._groups:
                elems = slice(e0, e0 + R * D)
                state = {k: v[r0 : r0 + R] if per_row else v[elems].view(R, D) for k, v in self._state.items()}
                rows_touched = touched[r0 : r0 + R] if touched is not None else None
                apply_update(
                    self.opt, flat[elems].view(R, D), state, grad[elems].view(R, D), self._step, fp16, rows_touched
                )

    def shard_weights(self) -> list[torch.Tensor]:
        """Each table's replica (views into the flat weights), in shard order."""
        flat = self.tbe.weights.data
        out = []
        for s, (e0, _) in zip(self.shards, self._blocks):
            R, D = s.table.num_embeddings, s.table.embedding_dim
            out.append(flat[e0 : e0 + R * D].view(R, D))
        return out

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """Each table's optimizer state (views into the flat state, `optim.optimizer_state`'s names), in shard
        order: per element `[rows, D]`, rowwise_adagrad's `m` `[rows]`."""
        per_row = self.opt.kind is OptimizerKind.ROWWISE_ADAGRAD
        out = []
        for s, (e0, r0) in zip(self.shards, self._blocks):
            R, D = s.table.num_embeddings, s.table.embedding_dim
            out.append(
                {k: v[r0 : r0 + R] if per_row else v[e0 : e0 + R * D].view(R, D) for k, v in self._state.items()}
            )
        return out

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
        columns: Mapping[str, int],
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
        self.out_keys, self.out_dims = [self.keys], [self.key_dims]  # one output block
        self.rank = world_and_rank(group)[1]
        self._cols = np.array([columns[f] for f in self.keys], dtype=np.int64)  # in BatchCounts.ids
        self.weighted = any(s.table.weighted for s in shards)

    def local_ids(
        self,
        lengths_FB: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        feature_index: dict[str, int],
        counts: BatchCounts,
    ) -> LocalIds:
        """Select this scheme's features from the local batch (sized from `counts`: no host sync)."""
        n = int(counts.ids[self.rank, self._cols].sum())
        select = cached_tensor([feature_index[f] for f in self.keys], values.device, torch.int32)
        if weights is None and self.weighted:
            weights = torch.ones_like(values, dtype=torch.float32)
        lengths, ids, w = torch.ops.fbgemm.permute_2D_sparse_data(
            select, lengths_FB, values, weights if self.weighted else None, n
        )
        return LocalIds(lengths.reshape(-1), ids, w, [n], [n])

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> Ready:
        """Nothing to send: the selected ids are this rank's lookup input."""
        return Ready(LookupInput(ids.lengths, ids.values, ids.weights, [len(ids.lengths) // len(self.keys)]))

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums `[B_local, sum of feature dims]`."""
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(inp.lengths)
        return self.lookups[0](inp.values, offsets, inp.weights)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> Ready:
        """Nothing to send: the pooled rows (one block) are already on the rank owning the samples."""
        return Ready([pooled])


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
    return DataParallelSharding(shards, feature_columns(tables), optimizer, device, group, seed, options)
