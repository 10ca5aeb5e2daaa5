"""Sequence lookups: one row per id, not pooled (the lookups of `ShardedEmbeddingCollection`).

Contract (every class here): `forward(ids_per_shard) -> rows_per_shard`, one `[n_i, D_i]` tensor per shard of the
lookup (in `shards` order) for the `[n_i]` local row indices of shard i; the fused optimizer updates the touched rows
in backward; `shard_weights()`, `shard_optimizer_states()`, `optimizer_step`, and the cache methods, as the pooled
lookups have them (embshard/lookup/__init__.py), so a collection's state (checkpoints) reads them the same way.

- `HostSequenceLookup`: CPU; plain `embedding` with sparse gradients and the update math of updates.py applied in
  a post-accumulate-grad hook (the pooled `HostLookup`'s weights, state and hook).
- `TBESequenceLookup`: CUDA; FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` with `PoolingMode.NONE`, one TBE per
  group of compatible shards of one width (tiers hbm, uvm, uvm_caching), the optimizer fused into its backward.
- `ReplicaSequenceLookup`: full replicas (data-parallel tables); backward all-reduces the gradient and every rank
  applies the same update.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embshard.lookup.base import NoCache
from embshard.lookup.host import HostLookup
from embshard.lookup.shards import LocalShard, init_rows
from embshard.lookup.tbe import TBELookup
from embshard.lookup.updates import apply_update, optimizer_state
from embshard.runtime.comm import scoped_label, start_all_reduce
from embshard.runtime.ops import host_to_device, joined
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import LookupOptions
from embshard.spec.tables import DataType


class HostSequenceLookup(HostLookup):
    """CPU rows of each shard: `embedding` with sparse gradients; the fused update runs once per shard per backward
    on the summed gradient of its touched rows (HostLookup's hook)."""

    def forward(self, ids_per_shard: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[override]
        """`[n_i, D_i]` rows of each shard for its local row indices."""
        dtype = self.options.output_dtype.torch_dtype
        return [
            nn.functional.embedding(ids.long(), w, sparse=True).to(dtype) for ids, w in zip(ids_per_shard, self.weights)
        ]


# Ids per bag handed to FBGEMM's no-bag TBE: its forward and its backward's index linearisation give one warp or
# thread to a bag and walk the bag's ids in turn, so a shard's ids must be spread over many bags.
BAG_IDS = 32


def bag_offsets(sizes: Sequence[int]) -> torch.Tensor:
    """TBE offsets `[T * B + 1]` (host, int64) for `sizes[t]` ids of each of T keys laid out key after key: every
    key's ids cut into the same number B of bags (B = ceil(max(sizes) / BAG_IDS), at least 1) of
    ceil(sizes[t] / B) ids at most (trailing bags empty). Rows come out in the ids' order whatever the cut."""
    n_T = np.asarray(sizes, dtype=np.int64).reshape(-1)
    B = max(1, -(-int(n_T.max(initial=0)) // BAG_IDS))
    chunk_T = (n_T + B - 1) // B
    start_T = np.cumsum(n_T) - n_T
    offsets_TB = np.minimum(np.arange(B, dtype=np.int64)[None, :] * chunk_T[:, None], n_T[:, None]) + start_T[:, None]
    return torch.from_numpy(np.append(offsets_TB.reshape(-1), n_T.sum()))


class TBESequenceLookup(TBELookup):
    """CUDA rows of each shard: one FBGEMM TBE with `PoolingMode.NONE` (every shard of the group one width), one
    lookup key per shard; each shard's ids are cut into bags of at most BAG_IDS ids (`bag_offsets`), so the output is
    one row per id, shard after shard. The fused optimizer updates the touched rows in the TBE's backward (repeated
    ids summed)."""

    pooling_mode = "NONE"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._captured_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._last_offsets: tuple[tuple[int, ...], torch.Tensor] | None = None

    def forward(self, ids_per_shard: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[override]
        """`[n_i, D]` rows of each shard for its local row indices."""
        sizes = tuple(int(ids.numel()) for ids in ids_per_shard)
        offsets = self._offsets(sizes, ids_per_shard[0].device)
        indices = joined(ids_per_shard).long()
        rows = super().forward(indices, offsets, None)  # [sum(sizes), D]
        return list(rows.split(sizes)) if len(sizes) > 1 else [rows]

    def _offsets(self, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`bag_offsets(sizes)` on the device: copied from the host in an eager call; a CUDA graph capture (which
        cannot copy from the host) reads the copy its warm-up call made, and the lookup keeps that copy for as long
        as it lives (the graph reads it in every replay), as later calls of the same sizes do."""
        kept, last = self._captured_offsets, self._last_offsets
        if sizes in kept:
            return kept[sizes]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            if last is None or last[0] != sizes:
                raise RuntimeError(
                    f"TBESequenceLookup: a CUDA graph captures ids of sizes {list(sizes)} that no call before the "
                    "capture had: run the step once outside the capture first (runtime/graphs.py: warm_up)"
                )
            kept[sizes] = last[1]
            return last[1]
        offsets = host_to_device(bag_offsets(sizes), device)
        self._last_offsets = (sizes, offsets)
        return offsets


class _ReplicaRows(torch.autograd.Function):
    """Rows of the replica; backward sums the rows' gradients into the replica's, all-reduces and updates."""

    @staticmethod
    def forward(ctx, lookup, ids, weight):  # type: ignore[override]
        ctx.lookup, ctx.ids = lookup, ids
        ctx.label = scoped_label("sequence data_parallel gradient all-reduce (backward)")
        return weight.detach().index_select(0, ids)

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        ctx.lookup.apply_gradient(ctx.ids, grad_ND, ctx.label)
        return None, None, None


class ReplicaSequenceLookup(NoCache, nn.Module):
    """A full replica of each data-parallel sequence table on every rank; backward: one all-reduce of the local
    gradients (and, for Adam and weight decay, of the touched-row marks) per table, then the same update on every
    rank (updates.py), so the replicas stay identical."""

    every_id_weighted = False

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
        self.shards = list(shards)
        self.features = [f for s in self.shards for f in s.features]
        self.dims = [s.table.embedding_dim for s in self.shards for _ in s.features]
        self.opt, self.group = optimizer, group
        self.options = options or LookupOptions()
        self.replicas = nn.ParameterList()
        self._state: list[dict[str, torch.Tensor]] = []
        for s in self.shards:
            t = s.table
            w = init_rows(t, s.table_index, 0, t.num_embeddings, 0, t.embedding_dim, seed, device)
            w = w.half().float() if t.data_type is DataType.FP16 else w
            if seed is None and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.broadcast(w, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            self.replicas.append(nn.Parameter(w))  # gets no .grad: backward updates it in place
            self._state.append(optimizer_state(optimizer, w))
        self._needs_touched = optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0
        self._steps = [0] * len(self.shards)

    def forward(self, ids_per_shard: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`[n_i, D]` rows of each replica (the local batch's ids); the update happens in backward."""
        dtype = self.options.output_dtype.torch_dtype
        out = []
        for i, ids in enumerate(ids_per_shard):
            w = self.replicas[i]
            if torch.is_grad_enabled():
                out.append(_ReplicaRows.apply(_Shard(self, i), ids.long(), w).to(dtype))
            else:
                out.append(w.index_select(0, ids.long()).to(dtype))
        return out

    def apply_gradient(self, i: int, ids: torch.Tensor, grad_ND: torch.Tensor, label: str) -> None:
        """Shard i's local row gradients -> one all-reduce -> the same update on every rank."""
        w = self.replicas[i].data
        R, D = w.shape
        grad = torch.zeros(R, D, dtype=torch.float32, device=w.device).index_add_(0, ids, grad_ND.float())
        touched = None
        if self._needs_touched:
            marks = grad.new_zeros(R, 1).index_fill_(0, ids, 1.0)
            summed = start_all_reduce(torch.cat([grad, marks], dim=1), self.group, label, scoped=False).wait()
            grad, touched = summed[:, :D], summed[:, D] > 0
        else:
            grad = start_all_reduce(grad, self.group, label, scoped=False).wait()
        fp16 = self.shards[i].table.data_type is DataType.FP16
        self._steps[i] += 1
        with torch.no_grad():
            apply_update(self.opt, w, self._state[i], grad, self._steps[i], fp16, touched)

    @property
    def optimizer_step(self) -> int:
        """Steps the optimizer has taken (Adam's bias-correction count)."""
        return max(self._steps, default=0)

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        self._steps = [int(step)] * len(self._steps)

    def shard_weights(self) -> list[torch.Tensor]:
        """Each table's replica."""
        return [p.data for p in self.replicas]

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """Each replica's optimizer state (the tensors themselves), named as `updates.optimizer_state`."""
        return list(self._state)


class _Shard:
    """(lookup, shard index): what a replica's backward updates."""

    def __init__(self, lookup: ReplicaSequenceLookup, i: int) -> None:
        self.lookup, self.i = lookup, i

    def apply_gradient(self, ids: torch.Tensor, grad_ND: torch.Tensor, label: str) -> None:
        self.lookup.apply_gradient(self.i, ids, grad_ND, label)
