"""Sequence sharding of model-parallel tables (table-wise, column-wise, row-wise, table-row-wise): one row per id,
each id's row sent back to the rank the id came from.

Segments. A table's shards with one column offset form a segment: one column block, cut into row blocks (one
block for table-wise and column-wise, one per rank for row-wise; table-row-wise is row-wise inside one host: no
partial sums to add up, so it is the same engine). Every feature of the table reads the segment: the segment's ids
on a rank are its features' ids, feature after feature, in the batch's order.

One step, on every rank (the collection calls the stages; every rank calls every stage, even with no ids):
1. `local_ids`: each id's destination (the rank of its row block: fixed for one block, `bucketize` on the blocks'
   first rows otherwise) and its row in the block; with dedup (per table or collection), the segment's unique ids
   (`torch.unique`: ids are unique per (table, column block, destination)) and the inverse that expands them back;
   ids sorted by destination (stable). How many ids go to each rank for each segment: known on the host from the
   step's counts (`gather_batch_counts`) when every segment has one block and no dedup, else counted on the device
   and swapped by `exchange_segment_counts` (one small all-to-all and one host sync for all such schemes, as the
   pooled row-wise exchange does).
2. `start_input_dist`: one all-to-all of the ids (destination-major, segment-major within), sizes from step 1.
3. `lookup`: the rows of every received id, in the received order (source-major, segment-major).
4. `start_output_dist`: the rows go back along the reverse routes: one all-to-all of `n x D` elements per
   (rank, segment), sized from step 1's counts (no further host sync); its backward sends the rows' gradients to
   the lookups, whose fused optimizer updates the touched rows.
5. `feature_rows`: each segment's rows back in the ids' order (the sort undone, dedup expanded: `index_select`,
   whose backward sums the gradients of repeated ids), cut per feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embshard.lookup.sequence import HostSequenceLookup, TBESequenceLookup
from embshard.lookup.shards import LocalShard, group_shards
from embshard.runtime.comm import start_all_to_all
from embshard.runtime.ops import cached_tensor, joined
from embshard.sharding.base import Ready, ShardingContext, column_key
from embshard.sharding.exchange import BatchCounts
from embshard.spec.optim import OptimizerKind
from embshard.spec.plan import Shard, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError, TableConfig


@dataclass(frozen=True)
class Segment:
    """One column block of a table, cut into row blocks, each on one rank."""

    table: TableConfig
    table_index: int
    table_plan: TablePlan
    blocks: tuple[Shard, ...]
    """The row blocks, ascending."""
    dedup: bool
    """Whether the segment's ids are exchanged and looked up once per step (unique per destination)."""

    @property
    def col_offset(self) -> int:
        """First column of the block."""
        return self.blocks[0].col_offset

    @property
    def num_cols(self) -> int:
        """Width of the block."""
        return self.blocks[0].num_cols

    @property
    def row_starts(self) -> tuple[int, ...]:
        """First row of each row block."""
        return tuple(b.row_offset for b in self.blocks)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Rank of each row block."""
        return tuple(b.rank for b in self.blocks)

    @property
    def routed_on_host(self) -> bool:
        """Whether the host knows where every id goes (one block, no dedup): no counts exchange needed."""
        return len(self.ranks) == 1 and not self.dedup


def segments_of(
    tables: Sequence[TableConfig], plan: ShardingPlan, types: Sequence[ShardingType], dedup: Mapping[str, bool]
) -> list[Segment]:
    """The segments of the tables planned with one of `types`, in collection order, column blocks in order. A rank
    may hold one row block of a segment at most."""
    out = []
    for i, t in enumerate(tables):
        tp = plan[t.name]
        if tp.sharding_type not in types:
            continue
        by_col: dict[int, list] = {}
        for s in tp.shards:
            by_col.setdefault(s.col_offset, []).append(s)
        for col in sorted(by_col):
            blocks = sorted(by_col[col], key=lambda s: s.row_offset)
            ranks = [s.rank for s in blocks]
            if len(set(ranks)) != len(ranks):
                raise ConfigError(
                    f"table {t.name!r}: the plan puts several row blocks of columns {col}.. on one rank {ranks}; a "
                    "sequence table holds one row block per rank: plan it again"
                )
            out.append(Segment(t, i, tp, tuple(blocks), dedup[t.name]))
    return out


@dataclass
class SegmentIds:
    """One scheme's ids of the local batch laid out for sending, and what undoes the layout afterwards."""

    send: list[torch.Tensor]
    """Per segment: the rows to look up (in their block), sorted by destination; unique ones with dedup."""
    order: list[torch.Tensor | None]
    """Per segment: the sort's permutation (None: no sort, one destination)."""
    inverse: list[torch.Tensor | None]
    """Per segment with dedup: each id's position among the unique ones."""
    feature_ids: list[list[int]]
    """Per segment: ids of each of its features in the local batch (host)."""
    counts_WS: torch.Tensor | None
    """`[W, S]` ids to each rank per segment, on the device, where the host cannot know them; else None."""
    sent: np.ndarray | None = None
    """`[W, S]` ids sent to each rank per segment (host)."""
    received: np.ndarray | None = None
    """`[W, S]` ids received from each rank per segment (host)."""


def exchange_segment_counts(parts: Sequence[SegmentIds], group: dist.ProcessGroup | None, world_size: int) -> None:
    """Fill in `sent` / `received` of the parts counted on the device: one all-to-all of all their `[W, S]` counts
    and one host sync."""
    W = world_size
    table = torch.cat([p.counts_WS.to(torch.int64) for p in parts], dim=1)
    recv = start_all_to_all(table, [1] * W, [1] * W, group, "sequence id counts all-to-all").wait(host=True)
    both = torch.cat([recv, table], dim=1).cpu().numpy()  # the host sync
    K, c0 = table.shape[1], 0
    for p in parts:
        S = p.counts_WS.shape[1]
        p.received, p.sent = both[:, c0 : c0 + S], both[:, K + c0 : K + c0 + S]
        c0 += S


class RoutedSequenceSharding(nn.Module):
    """The segments of one group of sharding types, their lookups on this rank, and the five stages (module
    docstring)."""

    def __init__(self, segments: Sequence[Segment], ctx: ShardingContext, label: str) -> None:
        super().__init__()
        self.segments = list(segments)
        self.label = label
        self.rank, self.W, self.group, self.device = ctx.rank, ctx.world_size, ctx.group, ctx.device
        self.features = [list(s.table.feature_names) for s in self.segments]
        self._cols = [np.array([ctx.columns[f] for f in fs], dtype=np.int64) for fs in self.features]
        self.on_host = all(s.routed_on_host for s in self.segments)
        local: list[tuple[int, LocalShard]] = []
        for j, seg in enumerate(self.segments):
            if self.rank in seg.ranks:
                block = seg.blocks[seg.ranks.index(self.rank)]
                key = (column_key(seg.table.name, seg.col_offset),)  # one lookup key per shard (its ids: one bag)
                local.append((j, LocalShard.planned(seg.table, seg.table_index, block, key, seg.table_plan)))
        self.lookups = nn.ModuleList()
        self._where: dict[int, tuple[int, int]] = {}  # segment -> (lookup, shard index in it)
        for group_ in _lookup_groups([s for _, s in local], ctx):
            lk = _build_lookup(group_, ctx)
            for pos, s in enumerate(group_):
                j = next(j for j, ls in local if ls is s)
                self._where[j] = (len(self.lookups), pos)
            self.lookups.append(lk)
        self._segment_of = {w: j for j, w in self._where.items()}  # (lookup, shard index in it) -> segment
        for j, seg in enumerate(self.segments):
            if len(seg.ranks) > 1:
                self.register_buffer(f"_starts{j}", torch.tensor(seg.row_starts, device=self.device), persistent=False)
                self.register_buffer(f"_ranks{j}", torch.tensor(seg.ranks, device=self.device), persistent=False)

    # ---- 1. the local batch's ids ----------------------------------------------------------------------------
    def local_ids(self, values: Mapping[str, torch.Tensor], counts: BatchCounts) -> SegmentIds:
        """Each segment's ids laid out for sending (module docstring, step 1); `values[f]`: feature f's ids of
        the local batch."""
        send, order, inverse, feature_ids, counts_cols = [], [], [], [], []
        for j, seg in enumerate(self.segments):
            ids = joined([values[f] for f in self.features[j]]).long()
            feature_ids.append([int(n) for n in counts.ids[self.rank, self._cols[j]]])
            inv = None
            if seg.dedup:
                ids, inv = torch.unique(ids, sorted=True, return_inverse=True)
            inverse.append(inv)
            if len(seg.ranks) == 1:
                rows, perm = (ids - seg.row_starts[0] if seg.row_starts[0] else ids), None
                if not self.on_host:  # counted with the scheme's other segments
                    counts_cols.append(
                        torch.zeros(self.W, dtype=torch.int64, device=ids.device).index_fill_(
                            0, cached_tensor([seg.ranks[0]], ids.device), ids.numel()
                        )
                    )
            else:
                block = torch.bucketize(ids, getattr(self, f"_starts{j}"), right=True) - 1
                dest = getattr(self, f"_ranks{j}")[block]
                perm = torch.argsort(dest, stable=True)
                rows = (ids - getattr(self, f"_starts{j}")[block])[perm]
                zeros = torch.zeros(self.W, dtype=torch.int64, device=ids.device)  # bincount would sync on CUDA
                counts_cols.append(zeros.index_add_(0, dest, torch.ones_like(dest)))
            send.append(rows)
            order.append(perm)
        out = SegmentIds(send, order, inverse, feature_ids, None)
        if self.on_host:
            S = len(self.segments)
            out.sent = np.zeros((self.W, S), dtype=np.int64)
            out.received = np.zeros((self.W, S), dtype=np.int64)
            for j, seg in enumerate(self.segments):
                out.sent[seg.ranks[0], j] = sum(feature_ids[j])
                if seg.ranks[0] == self.rank:
                    out.received[:, j] = counts.ids[:, self._cols[j]].sum(axis=1)
        else:
            out.counts_WS = torch.stack(counts_cols, dim=1) if counts_cols else None
        return out

    # ---- 2. ids to the ranks that look them up --------------------------------------------------------------
    def start_input_dist(self, ids: SegmentIds):
        """Send each destination its ids, destination-major, segment-major within; `wait()` gives them."""
        S = len(self.segments)
        if self.W == 1:  # every id stays here: no exchange, no copy
            return Ready(_joined(ids.send, 1) if S else self._empty_ids())
        pieces = [ids.send[j].split(ids.sent[:, j].tolist()) for j in range(S)]
        buf = torch.cat([pieces[j][d] for d in range(self.W) for j in range(S)]) if S else self._empty_ids()
        return start_all_to_all(
            buf, ids.sent.sum(axis=1).tolist(), ids.received.sum(axis=1).tolist(), self.group, f"{self.label} ids"
        )

    def _empty_ids(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64, device=self.device)

    # ---- 3. lookup -------------------------------------------------------------------------------------------
    def lookup(self, ids: SegmentIds, received: torch.Tensor) -> torch.Tensor:
        """The rows of every received id, flattened in the received order (source-major, segment-major), as one
        tensor that requires grad on every rank (so every rank runs the output exchange's backward)."""
        S = len(self.segments)
        recv = ids.received
        pieces = received.split(recv.reshape(-1).tolist())  # (source, segment)
        per_lookup: list[list] = [[None] * len(lk.shards) for lk in self.lookups]
        for j, (li, pos) in self._where.items():
            per_lookup[li][pos] = _joined([pieces[s * S + j] for s in range(self.W)], self.W)
        rows_of: dict[int, list[torch.Tensor]] = {}
        for li, lk in enumerate(self.lookups):
            for pos, rows in enumerate(lk(per_lookup[li])):
                j = self._segment_of[(li, pos)]
                rows_of[j] = list(rows.split(recv[:, j].tolist()))
        flat = [rows_of[j][s].reshape(-1) for s in range(self.W) for j in range(S) if j in rows_of]
        dtype = self._out_dtype()
        out = _joined(flat, self.W) if flat else torch.zeros(0, dtype=dtype, device=self.device)
        return out if out.requires_grad or not torch.is_grad_enabled() else out.requires_grad_()

    def _out_dtype(self) -> torch.dtype:
        return self.lookups[0].options.output_dtype.torch_dtype if len(self.lookups) else torch.float32

    # ---- 4. rows back to the ids' ranks ---------------------------------------------------------------------
    def start_output_dist(self, ids: SegmentIds, rows: torch.Tensor):
        """Send every row back to the rank its id came from; `wait()` gives them (flat, destination-major)."""
        dims = np.array([s.num_cols for s in self.segments], dtype=np.int64)
        send = (ids.received * dims).sum(axis=1).tolist() if len(dims) else [0] * self.W
        recv = (ids.sent * dims).sum(axis=1).tolist() if len(dims) else [0] * self.W
        if self.W == 1:  # every row stays here: no exchange, no copy (autograd passes straight through)
            return Ready(rows)
        return start_all_to_all(rows, send, recv, self.group, f"{self.label} rows")

    # ---- 5. rows in the ids' order, per feature ----------------------------------------------------------------
    def feature_rows(self, ids: SegmentIds, back: torch.Tensor) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """{feature: [(first column, `[n_f, width]` rows in the local batch's order)]} of every segment."""
        S = len(self.segments)
        dims = [s.num_cols for s in self.segments]
        out: dict[str, list[tuple[int, torch.Tensor]]] = {}
        if self.W == 1 and len(set(dims)) == 1 and not any(o is not None for o in ids.order + ids.inverse):
            # one rank, one width, no reordering: every feature's rows are one piece of `back`, so one split (its
            # backward: one concatenation of the features' gradients)
            sizes = [n for j in range(S) for n in ids.feature_ids[j]]
            parts = iter(back.view(-1, dims[0]).split(sizes) if len(sizes) > 1 else [back.view(-1, dims[0])])
            for j, seg in enumerate(self.segments):
                for f in self.features[j]:
                    out.setdefault(f, []).append((seg.col_offset, next(parts)))
            return out
        pieces = back.split([int(ids.sent[d, j]) * dims[j] for d in range(self.W) for j in range(S)])
        for j, seg in enumerate(self.segments):
            rows = _joined([pieces[d * S + j].view(-1, dims[j]) for d in range(self.W)], self.W)
            if ids.order[j] is not None:  # undo the sort by destination
                perm = ids.order[j]
                undo = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
                rows = rows.index_select(0, undo)
            if ids.inverse[j] is not None:  # expand the unique ids; backward sums repeated ids' gradients
                rows = rows.index_select(0, ids.inverse[j])
            parts = rows.split(ids.feature_ids[j]) if len(self.features[j]) > 1 else [rows]
            for f, part in zip(self.features[j], parts):
                out.setdefault(f, []).append((seg.col_offset, part))
        return out


def _joined(parts: Sequence[torch.Tensor], world_size: int) -> torch.Tensor:
    """`torch.cat(parts)` without the copy where there is nothing to join: one part, or (on one rank, where no
    exchange follows) parts that are, in order, the whole of one contiguous tensor (`join_views`)."""
    if world_size == 1:
        return joined(parts)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _use_host(ctx: ShardingContext) -> bool:
    """The CPU's host lookup where FBGEMM's CPU TBE falls short (no Adam; weight decay ignored), as for pooled
    tables (sharding/lookups.py); FBGEMM's TBE with PoolingMode.NONE otherwise, on the CPU and on GPUs."""
    o = ctx.optimizer
    return ctx.device.type == "cpu" and (o.kind is OptimizerKind.ADAM or o.weight_decay > 0)


def _lookup_groups(shards: Sequence[LocalShard], ctx: ShardingContext) -> list[list[LocalShard]]:
    """Shards grouped into lookups: by `group_key`, and for a TBE by width too (a `PoolingMode.NONE` TBE has one)."""
    if _use_host(ctx):
        return group_shards(shards)
    groups: dict[tuple, list[LocalShard]] = {}
    for s in shards:
        groups.setdefault((s.group_key, s.shard.num_cols), []).append(s)
    return list(groups.values())


def _build_lookup(shards: Sequence[LocalShard], ctx: ShardingContext) -> nn.Module:
    cls = HostSequenceLookup if _use_host(ctx) else TBESequenceLookup
    return cls(shards, ctx.optimizer, ctx.device, ctx.seed, ctx.options)


def routed_sequence(
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    ctx: ShardingContext,
    types: Sequence[ShardingType],
    dedup: Mapping[str, bool],
    label: str,
) -> RoutedSequenceSharding | None:
    """The scheme of the tables planned with `types` (None when there are none: every rank builds the same)."""
    segments = segments_of(tables, plan, types, dedup)
    if not segments:
        return None
    return RoutedSequenceSharding(segments, ctx, label)
