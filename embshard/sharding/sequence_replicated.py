"""Sequence sharding of data-parallel tables: every rank holds a full replica and looks up its own ids; no
exchange in forward. Backward all-reduces each replica's gradient and every rank applies the same update
(embshard/lookup/sequence.py, `ReplicaSequenceLookup`). Same stages as `RoutedSequenceSharding`
(sequence_routed.py); the exchanges are `Ready` values. Dedup looks each unique id up once and expands the rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from embshard.lookup.sequence import ReplicaSequenceLookup
from embshard.lookup.shards import LocalShard
from embshard.sharding.base import Ready, ShardingContext
from embshard.sharding.exchange import BatchCounts
from embshard.sharding.sequence_routed import SegmentIds
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


class ReplicatedSequenceSharding(nn.Module):
    """The data-parallel sequence tables: local lookups on full replicas."""

    on_host = True  # nothing to count on the device

    def __init__(self, shards: Sequence[LocalShard], ctx: ShardingContext, dedup: Mapping[str, bool]) -> None:
        super().__init__()
        lookup = ReplicaSequenceLookup(shards, ctx.optimizer, ctx.device, ctx.group, ctx.seed, ctx.options)
        self.lookups = nn.ModuleList([lookup])
        self.rank = ctx.rank
        self.features = [list(s.table.feature_names) for s in shards]
        self._dedup = [dedup[s.table.name] for s in shards]
        self._cols = [np.array([ctx.columns[f] for f in fs], dtype=np.int64) for fs in self.features]

    def local_ids(self, values: Mapping[str, torch.Tensor], counts: BatchCounts) -> SegmentIds:
        """Each table's ids of the local batch (unique ones with dedup)."""
        send, inverse, feature_ids = [], [], []
        for j, fs in enumerate(self.features):
            ids = torch.cat([values[f] for f in fs]).long()
            inv = None
            if self._dedup[j]:
                ids, inv = torch.unique(ids, sorted=True, return_inverse=True)
            send.append(ids)
            inverse.append(inv)
            feature_ids.append([int(n) for n in counts.ids[self.rank, self._cols[j]]])
        return SegmentIds(send, [None] * len(send), inverse, feature_ids, None)

    def start_input_dist(self, ids: SegmentIds) -> Ready:
        """Nothing to send."""
        return Ready(None)

    def lookup(self, ids: SegmentIds, received: None) -> list[torch.Tensor]:
        """The rows of every table's ids."""
        return self.lookups[0](ids.send)

    def start_output_dist(self, ids: SegmentIds, rows: list[torch.Tensor]) -> Ready:
        """Nothing to send: the rows are home."""
        return Ready(rows)

    def feature_rows(self, ids: SegmentIds, back: list[torch.Tensor]) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """{feature: [(0, `[n_f, D]` rows)]}, dedup expanded."""
        out: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for j, rows in enumerate(back):
            if ids.inverse[j] is not None:
                rows = rows.index_select(0, ids.inverse[j])
            for f, part in zip(self.features[j], rows.split(ids.feature_ids[j])):
                out[f] = [(0, part)]
        return out


def replicated_sequence(
    tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext, dedup: Mapping[str, bool]
) -> ReplicatedSequenceSharding | None:
    """The data-parallel sequence tables' scheme (None when there are none)."""
    shards = []
    for i, t in enumerate(tables):
        tp = plan[t.name]
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            mine = next(s for s in tp.shards if s.rank == ctx.rank)
            shards.append(LocalShard.planned(t, i, mine, (t.name,), tp))
    return ReplicatedSequenceSharding(shards, ctx, dedup) if shards else None
