"""Data-parallel sharding: every rank holds a full replica of the table and looks up its own batch locally.

Data flow for one step, on every rank:
The replicas and their update live in embshard/lookup/replicas.py. Here:
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

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from embshard.kernels.data_parallel import KernelDataParallelLookup
from embshard.lookup import LocalShard
from embshard.lookup.replicas import DataParallelLookup
from embshard.ops import cached_tensor, complete_cumsum, permute_2d, weights_or_ones
from embshard.plan import LookupKernel, ShardingPlan, ShardingType
from embshard.sharding.base import OutputLayout, Ready, Scheme, ShardingContext, planned_as
from embshard.sharding.exchange import LocalBatch, LocalIds, LookupInput
from embshard.tables import TableConfig


class DataParallelSharding(Scheme):
    """The data-parallel tables of the collection: local lookups, gradients all-reduced in backward."""

    local_output = True

    def __init__(self, shards: Sequence[LocalShard], ctx: ShardingContext) -> None:
        super().__init__()
        cls = KernelDataParallelLookup if shards[0].kernel is LookupKernel.SMALL else DataParallelLookup
        lookup = cls(shards, ctx.optimizer, ctx.device, ctx.group, ctx.seed, ctx.options)
        self.lookups = nn.ModuleList([lookup])
        keys, dims = lookup.features, lookup.dims  # the lookup's order: tables grouped by width
        self.layout = OutputLayout(list(keys), list(dims), [list(keys)], [list(dims)])  # one output block
        self.rank = ctx.rank
        self._cols = np.array([ctx.columns[f] for f in keys], dtype=np.int64)  # in BatchCounts.ids
        self.weighted = any(s.table.weighted for s in shards)
        # The small-table kernels (atomic backward) read each bag's ids through its offsets alone, whatever the
        # length of the values: a padded batch (embshard/padding.py) gives these features no fillers and their
        # lookup no weights to add. Not so the sorted (deterministic) backward or the touched-row marks (every id).
        small = isinstance(lookup, KernelDataParallelLookup)
        self.pads_free = small and not lookup._needs_touched and not lookup.kernel.deterministic
        if self.pads_free:
            lookup.pads_free = True

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """Select this scheme's features from the local batch (sized from `batch.counts`: no host sync)."""
        n = int(batch.counts.ids[self.rank, self._cols].sum())
        values = batch.values
        select = cached_tensor([batch.feature_index[f] for f in self.layout.keys], values.device, torch.int32)
        if self.pads_free:  # its features hold no fillers: weights only for weighted tables
            weights = weights_or_ones(values, batch.weights, True) if self.weighted else None
        else:
            weights = weights_or_ones(values, batch.weights, self.weighted)
        # n: the ids of these features (a padded batch: their capacity, of which the bags hold the first ones)
        lengths, ids, w = permute_2d(select, batch.lengths_FB, values, weights, n)
        return LocalIds(lengths.reshape(-1), ids, w, [n], [n])

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> Ready:
        """Nothing to send: the selected ids are this rank's lookup input."""
        return Ready(LookupInput(ids.lengths, ids.values, ids.weights, [len(ids.lengths) // len(self.layout.keys)]))

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums `[B_local, sum of feature dims]`."""
        return self.lookups[0](inp.values, complete_cumsum(inp.lengths), inp.weights)

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> Ready:
        """Nothing to send: the pooled rows (one block) are already on the rank owning the samples."""
        return Ready([pooled])


def data_parallel(
    tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext
) -> DataParallelSharding | None:
    """The data-parallel part of the collection: this rank's replica of each data-parallel table. None if no
    table is data-parallel."""
    shards = []
    for i, cfg, tp in planned_as(tables, plan, ShardingType.DATA_PARALLEL):
        (mine,) = [s for s in tp.shards if s.rank == ctx.rank]
        shards.append(LocalShard.planned(cfg, i, mine, cfg.feature_names, tp))
    return DataParallelSharding(shards, ctx) if shards else None
