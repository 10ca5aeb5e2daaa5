"""`DataParallelLookup`: full replicas of the data-parallel tables in one FBGEMM dense TBE, updated in backward
with the gradient all-reduced over ranks (the data flow is in embshard/sharding/data_parallel.py)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from embshard.lookup.base import CountedSteps, EveryIdWeighted, NoCache
from embshard.lookup.shards import LocalShard, init_rows
from embshard.lookup.updates import apply_update, optimizer_state
from embshard.runtime.comm import scoped_label, start_all_reduce
from embshard.runtime.ops import feature_of_ids
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import LookupOptions
from embshard.spec.tables import ConfigError, DataType


class _ReplicaBags(torch.autograd.Function):
    """Pooled sums over the replicas; backward all-reduces the gradient and updates the replicas in place."""

    @staticmethod
    def forward(ctx, lookup, indices, offsets, psw, weights):  # type: ignore[override]
        ctx.lookup, ctx.inputs = lookup, (indices, offsets)
        ctx.label = scoped_label("data_parallel gradient all-reduce (backward)")
        if offsets.numel() == 1:  # an empty local batch: no kernel, but backward still joins the all-reduce
            ctx.pooled = None
            return weights.new_zeros(0, sum(lookup.dims))
        with torch.enable_grad():  # FBGEMM's own graph: backward runs only its dense backward, not the lookup
            pooled = lookup.tbe(indices, offsets, psw)
        ctx.pooled = pooled
        return pooled.detach()

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        lookup, pooled = ctx.lookup, ctx.pooled
        ctx.pooled = None
        if pooled is None:
            grad = torch.zeros_like(lookup.tbe.weights)
        else:
            (grad,) = torch.autograd.grad(
                pooled, lookup.tbe.weights, grad_BD
            )  # its warning: embshard/runtime/notices.py
        lookup.apply_gradient(grad, *ctx.inputs, label=ctx.label)
        return (None,) * 5


class DataParallelLookup(EveryIdWeighted, NoCache, CountedSteps, nn.Module):
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
        forced = self.every_id_weighted  # a padded batch weighs every id
        if weights is not None and (self._weighted != "none" or forced):
            psw = weights.float()
            if self._weighted == "some" and not forced:  # unweighted features pool with weight 1
                psw = torch.where(self._per_id(self._weighted_F, offsets, indices.numel()), psw, 1.0)
        if torch.is_grad_enabled():
            pooled = _ReplicaBags.apply(self, indices, offsets, psw, self.tbe.weights)
        elif offsets.numel() == 1:  # an empty local batch
            pooled = self.tbe.weights.new_zeros(0, sum(self.dims))
        else:
            pooled = self.tbe(indices, offsets, psw)
        return pooled.to(self._out_dtype)

    def apply_gradient(
        self, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, label: str = "all-reduce"
    ) -> None:
        """Local flat gradient (+ touched-row marks) -> one all-reduce -> the same update on every rank."""
        n = grad.numel()
        touched = None
        if self._needs_touched:
            rows = indices.long() + self._per_id(self._row0_F, offsets, indices.numel())
            marks = grad.new_zeros(self._rows).index_fill_(0, rows, 1.0)
            summed = start_all_reduce(torch.cat([grad, marks]), self.group, label, scoped=False).wait()
            grad, touched = summed[:n], summed[n:] > 0
        else:
            grad = start_all_reduce(grad, self.group, label, scoped=False).wait()
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
        """The optimizer state of each replica (views, in shard order), named as `optim.optimizer_state`."""
        per_row = self.opt.kind is OptimizerKind.ROWWISE_ADAGRAD
        out = []
        for s, (e0, r0) in zip(self.shards, self._blocks):
            R, D = s.table.num_embeddings, s.table.embedding_dim
            out.append(
                {k: v[r0 : r0 + R] if per_row else v[e0 : e0 + R * D].view(R, D) for k, v in self._state.items()}
            )
        return out
