"""Data-parallel sharding: every rank holds a full replica of the table and looks up its own batch locally.

Data flow for one step, on every rank:
The replicas and their update live in embshard/lookup/replicas.py. Here:
1. input dist: none; the local batch's ids of the data-parallel features are only selected and reordered;
2. lookup: one FBGEMM `DenseTableBatchedEmbeddingBagsCodegen` pools (sums) over all the replicas, for the local
   batch; no output dist either;
3. backward: FBGEMM's dense backward forms the gradient of all the replicas (one flat tensor) from the local
   batch; one all-reduce sums it over ranks (the gradient of the global-batch loss is the sum of the ranks' local
   losses' gradients). Every rank then applies the same update (`embshard.lookup.updates.apply_update`, the fused
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
from embshard.runtime.ops import cached_tensor, complete_cumsum, permute_2d, weights_or_ones
from embshard.sharding.base import OutputLayout, Ready, Scheme, ShardingContext, planned_as
from embshard.sharding.exchange import LocalBatch, LocalIds, LookupInput
from embshard.spec.plan import LookupKernel, ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


class DataParallelSharding(Scheme):
    """The data-parallel tables of the collection: local lookups, gradients all-reduced in backward."""

    local_output = True

    def __init__(self, shards: Sequence[LocalShard], ctx: ShardingContext) -> None:
        super().__init__()
        cls = KernelDataParallelLookup if shards[0].kernel is LookupKernel.SMALL else DataParallelLookup
        group = ctx.data_parallel_group if ctx.data_parallel_group is not None else ctx.group
        lookup = cls(shards, ctx.optimizer, ctx.device, group, ctx.seed, ctx.options)
        self.lookups = nn.ModuleList([lookup])
        keys, dims = lookup.features, lookup.dims  # the lookup's order: tables grouped by width
        self.layout = OutputLayout(list(keys), list(dims), [list(keys)], [list(dims)])  # one output block
        self.rank = ctx.rank
        self._cols = np.array([ctx.columns[f] for f in keys], dtype=np.int64)  # in BatchCounts.ids
        self._columns = dict(ctx.columns)
        self._runs: dict = {}  # a batch layout (feature -> row) -> None, or (first row, columns of the rows before)
        self.weighted = any(s.table.weighted for s in shards)
        # The small-table kernels (atomic backward) read each bag's ids through its offsets alone, whatever the
        # length of the values: a padded batch (embshard/collection/padding.py) gives these features no fillers and their
        # lookup no weights to add. Not so the sorted (deterministic) backward or the touched-row marks (every id).
        small = isinstance(lookup, KernelDataParallelLookup)
        self.pads_free = small and not lookup._needs_touched and not lookup.kernel.deterministic
        if self.pads_free:
            lookup.pads_free = True

    def local_ids(self, batch: LocalBatch) -> LocalIds:
        """Select this scheme's features from the local batch (sized from `batch.counts`: no host sync): views of
        the batch where its features are one run of the batch's, in this scheme's order (a padded batch's free
        features always are), else FBGEMM's permute."""
        n = int(batch.counts.ids[self.rank, self._cols].sum())
        values = batch.values
        if self.pads_free:  # its features hold no fillers: weights only for weighted tables
            weights = weights_or_ones(values, batch.weights, True) if self.weighted else None
        else:
            weights = weights_or_ones(values, batch.weights, self.weighted or self.every_id_weighted)
        run = self._run_of(batch)
        if run is not None:  # n: these features' ids (a padded batch: their capacity, the bags holding the first)
            a, start = run
            k = len(self.layout.keys)
            w = weights[start : start + n] if weights is not None else None
            return LocalIds(batch.lengths_FB[a : a + k].reshape(-1), values[start : start + n], w, [n], [n])
        select = cached_tensor([batch.feature_index[f] for f in self.layout.keys], values.device, torch.int32)
        lengths, ids, w = permute_2d(select, batch.lengths_FB, values, weights, n)
        return LocalIds(lengths.reshape(-1), ids, w, [n], [n])

    def _run_of(self, batch: LocalBatch) -> tuple[int, int] | None:
        """(first row, first id) of this scheme's features in the batch when they are consecutive rows of it in
        this scheme's order, else None; the first id counts the ids of the batch's rows before them."""
        key = tuple(batch.feature_index.items())
        if key not in self._runs:
            rows = [batch.feature_index[f] for f in self.layout.keys]
            a = rows[0] if rows else 0
            if rows != list(range(a, a + len(rows))):
                self._runs[key] = None
            else:
                before = [f for f, r in batch.feature_index.items() if r < a]
                self._runs[key] = (a, np.array([self._columns[f] for f in before], dtype=np.int64))
        found = self._runs[key]
        if found is None:
            return None
        a, cols = found
        return a, int(batch.counts.ids[self.rank, cols].sum())

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
