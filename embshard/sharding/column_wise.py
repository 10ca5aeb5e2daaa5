"""Column-wise sharding: a table's columns cut into blocks, each block placed on a rank like a whole table.

Data flow: every column block is read by all of the table's features, under one lookup key per (feature, block),
`column_key(feature, col_offset)` (sharding/base.py). The keys travel exactly like table-wise features (the routed
engine, routed.py: ids to the block's rank, pooled `[B, block width]` back); ShardedEmbeddingBagCollection maps
each key back to its feature and lays the blocks side by side in column order.

Row-wise Adagrad keeps one state value per row, `m += mean(g^2)` over the row. A block sees only its columns, so
with FBGEMM's fused update each block would keep its own `m` (the mean over the block's columns: TorchRec's
behaviour, `LookupOptions(column_wise_exact=False)`). Exact mode (the default) trains like the unsharded table:
1. forward: the blocks' lookups pool without the fused update;
2. backward (`_ExactColumnStep`, a node every rank runs): each block rank sums its gradient per touched row
   (`g_UD`, rows in sorted order) and its part of the row's squared norm, `sq_U`;
3. one all-to-all swaps the `sq_U` of each table among the ranks holding its blocks (every block rank touched the
   same rows: each gets all of the table's ids); each rank adds them up in column order, so every block rank
   holds the same `m`, and applies `m += sq / D`, `w -= lr * g / (sqrt(m) + eps)` to its columns.
UVM-caching blocks keep per-block state (their HBM cache would hold stale rows), with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from embshard.lookup import LocalShard
from embshard.runtime.comm import scoped_label, start_all_to_all
from embshard.sharding.base import ShardingContext, column_key, planned_as
from embshard.sharding.exchange import LookupInput
from embshard.sharding.routed import RoutedSharding
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import LookupOptions
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig


def column_wise(tables: Sequence[TableConfig], plan: ShardingPlan, ctx: ShardingContext) -> RoutedSharding | None:
    """The column-wise part of the collection: each column block on its planned rank, read by one key per
    feature. None if no table is column-wise."""
    shards_per_rank: list[list[LocalShard]] = [[] for _ in range(plan.world_size)]
    key_source: dict[str, str] = {}
    for i, cfg, tp in planned_as(tables, plan, ShardingType.COLUMN_WISE):
        for shard in sorted(tp.shards, key=lambda s: s.col_offset):
            keys = tuple(column_key(f, shard.col_offset) for f in cfg.feature_names)
            shards_per_rank[shard.rank].append(LocalShard.planned(cfg, i, shard, keys, tp))
            key_source.update({k: f for k, f in zip(keys, cfg.feature_names)})
    if not key_source:
        return None
    if ctx.optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD and ctx.options.column_wise_exact:
        return ExactColumnSharding(shards_per_rank, key_source, ctx)
    return RoutedSharding(shards_per_rank, key_source, ctx, name="column_wise")


PER_BLOCK_STATE_TIERS = frozenset({MemoryTier.UVM_CACHING})
"""Tiers whose column blocks keep a per-block row-wise Adagrad state even in exact mode (their HBM cache would hold
stale rows under the exact update)."""


def _first_slots(seg_N: torch.Tensor) -> torch.Tensor:
    """The index of each segment's first sorted id, in slots 0..N-1 (past the last segment: the last id)."""
    n = seg_N.numel()
    first = torch.full((n,), n - 1, dtype=torch.long, device=seg_N.device)
    return first.scatter_reduce_(0, seg_N, torch.arange(n, device=seg_N.device), "amin")


def shares_row_state(optimizer: FusedOptimizerConfig, options: LookupOptions, tier: MemoryTier | str) -> bool:
    """Whether the column blocks of a row-wise Adagrad table each hold the table's own per-row state (exact mode:
    identical copies, equal to the unsharded table's) rather than a per-block state of their own (TorchRec's
    behaviour: `column_wise_exact=False`, and blocks in `PER_BLOCK_STATE_TIERS`). Checkpoints map the state by this
    rule."""
    exact = optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD and options.column_wise_exact
    return exact and MemoryTier(tier) not in PER_BLOCK_STATE_TIERS


class _ExactColumnStep(torch.autograd.Function):
    """Pooled sums of the exact lookups (no fused update); backward runs the exact row-wise Adagrad update."""

    @staticmethod
    def forward(ctx, scheme, inp, anchor):  # type: ignore[override]
        ctx.scheme, ctx.inp = scheme, inp
        ctx.label = scoped_label("column_wise row norms all-to-all (backward)")
        with torch.no_grad():
            return scheme.pool_exact(inp)

    @staticmethod
    def backward(ctx, grad_BD):  # type: ignore[override]
        ctx.scheme.exact_update(ctx.inp, grad_BD, ctx.label)
        ctx.scheme = ctx.inp = None
        return None, None, None


class ExactColumnSharding(RoutedSharding):
    """Column-wise blocks under row-wise Adagrad with one state value per full row (module docstring)."""

    def __init__(self, shards_per_rank, key_source, ctx: ShardingContext) -> None:
        super().__init__(shards_per_rank, key_source, ctx, name="column_wise")
        self._opt = ctx.optimizer
        self._exact = [shares_row_state(ctx.optimizer, ctx.options, lk.shards[0].tier) for lk in self.lookups]
        caching = sorted(
            {
                (s.table.name, s.tier.value)
                for shards in shards_per_rank
                for s in shards
                if s.tier in PER_BLOCK_STATE_TIERS
            }
        )
        if caching:
            warnings.warn(
                f"column-wise tables (name, tier) {caching} keep their row-wise Adagrad state per column block (the HBM "
                "cache of uvm_caching would hold stale rows under the exact update); plan them in hbm or uvm for the "
                "exact update",
                stacklevel=2,
            )
        # Ranks holding each table's exact blocks, in column order of their first block; this rank's blocks. The
        # same on every rank (from the plan), so every rank agrees on whether the exact node and its all-to-all run.
        holders: dict[int, list[tuple[int, int]]] = {}
        for d, shards in enumerate(shards_per_rank):
            for s in shards:
                if shares_row_state(ctx.optimizer, ctx.options, s.tier):
                    holders.setdefault(s.table_index, []).append((s.shard.col_offset, d))
        self._holders = {t: list(dict.fromkeys(d for _, d in sorted(h))) for t, h in holders.items()}
        # Per table of mine: (lookup, shard, feature positions in the lookup, first output column of each).
        self._mine: dict[int, list[tuple[int, int, list[int], list[int]]]] = {}
        col = 0
        for i, lk in enumerate(self.lookups):
            pos = 0
            for j, s in enumerate(lk.shards):
                n = len(s.features)
                if self._exact[i]:  # columns of the exact lookups' output (the uvm_caching ones are not in it)
                    cols = [col + k * s.shard.num_cols for k in range(n)]
                    self._mine.setdefault(s.table_index, []).append((i, j, list(range(pos, pos + n)), cols))
                    col += n * s.shard.num_cols
                pos += n
        self._key_base = np.cumsum([0] + [len(lk.features) for lk in self.lookups]).tolist()
        self._device = ctx.device
        self._anchor = torch.zeros((), device=ctx.device, requires_grad=True)

    def lookup(self, inp: LookupInput) -> torch.Tensor:
        """Pooled sums `[B_global, D_me]`: the exact lookups through `_ExactColumnStep`, the others (uvm_caching)
        with their fused update.

        Collectives: when any rank holds an exact block, EVERY rank makes the `_ExactColumnStep` node every step and
        its output is part of the returned tensor (zero columns wide on a rank without exact blocks), so every
        rank's backward reaches it and joins its all-to-all; when no rank holds one (every block uvm_caching), no
        rank makes it. Both follow from the plan alone, never from what one rank holds or its batch."""
        Bg = inp.global_batch
        if self.lookups and Bg and inp.parts is None:
            inp.parts = self._split(inp)
        if not self._holders:  # no exact block on any rank: the routed lookup, no exact all-to-all anywhere
            return super().lookup(inp)
        exact = _ExactColumnStep.apply(self, inp, self._anchor)
        if all(self._exact):
            return exact
        outs, e0 = [exact[:, :0]], 0  # the (possibly empty) exact node stays in the graph on every rank
        for i, lk in enumerate(self.lookups):
            width = sum(lk.dims)
            if self._exact[i]:
                outs.append(exact[:, e0 : e0 + width])
                e0 += width
            elif Bg == 0:
                outs.append(exact.new_zeros(0, width))
            else:
                outs.append(lk(*inp.parts[i]))
        return torch.cat(outs, dim=1)

    def pool_exact(self, inp: LookupInput) -> torch.Tensor:
        """The exact lookups' pooled sums, side by side in lookup order (no autograd: no fused update)."""
        exact = [i for i, e in enumerate(self._exact) if e]
        if not exact or inp.global_batch == 0:
            width = sum(sum(self.lookups[i].dims) for i in exact)
            return torch.zeros(inp.global_batch, width, device=self._device, dtype=self.out_dtype)
        outs = [self.lookups[i](*inp.parts[i]) for i in exact]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

    def exact_update(self, inp: LookupInput, grad_BD: torch.Tensor, label: str = "row norms") -> None:
        """Per table of mine: gradient per touched row, squared norms swapped among the block ranks, update.

        Every size comes from the host's id counts (no device sync, so a captured step can hold it): a table's N ids
        sorted by row, one slot per id; the sums of a row's ids land in the slot of its segment (the row's first
        sorted id; the other slots stay zero), and every id of a row writes the row's same new weights and state."""
        Bg, grads = inp.global_batch, {}
        sq_local: dict[int, torch.Tensor] = {}
        for t, blocks in sorted(self._mine.items()) if Bg else []:
            rows_N, seg_N, len_N, bag_N, weight_N = self._touched(inp, blocks[0])
            g_per_block = []
            for i, j, _, cols in blocks:
                w_RD = self.lookups[i].shard_weights()[j]
                width = w_RD.shape[1]
                per_id = torch.cat([grad_BD[:, c : c + width] for c in cols], dim=0).float()[bag_N]
                if weight_N is not None:
                    per_id = per_id * weight_N.unsqueeze(1)
                # deterministic sums per row segment (no atomics), in slots 0..rows-1, zero after
                g_SD = torch.segment_reduce(per_id, "sum", lengths=len_N, unsafe=True) if len(per_id) else per_id
                g_ND = g_SD[seg_N]  # each id's row gradient
                if self._opt.weight_decay:
                    g_ND = g_ND + self._opt.weight_decay * w_RD[rows_N].float()
                g_per_block.append((g_SD, g_ND))
            grads[t] = (rows_N, seg_N, [g for _, g in g_per_block])
            sq_local[t] = sum(g.square().sum(1) for g, _ in g_per_block)
            if self._opt.weight_decay:  # the decayed gradient's norm, per segment
                sq_local[t] = sum(g[_first_slots(seg_N)].square().sum(1) for _, g in g_per_block)
        totals = self._swap_squares(sq_local, label)
        for t, (rows_N, seg_N, g_per_block) in grads.items():
            for (i, j, _, _), g_ND in zip(self._mine[t], g_per_block):
                lk = self.lookups[i]
                w_RD, m_R = lk.shard_weights()[j], lk.shard_optimizer_states()[j]["m"]
                m_N = m_R[rows_N] + totals[t][seg_N] / lk.shards[j].table.embedding_dim
                m_R[rows_N] = m_N  # every id of a row writes the same value
                step = g_ND * (self._opt.lr / (m_N.sqrt() + self._opt.eps)).unsqueeze(1)
                w_RD[rows_N] = (w_RD[rows_N].float() - step).to(w_RD.dtype)

    def _touched(self, inp: LookupInput, block) -> tuple:
        """(rows_N, seg_N, len_N, bag_N, weight_N) of one table's N ids sorted by row: each id's row, its row's
        segment (0, 1, ... in row order), the ids per segment (zero past the last), its bag (the table's features'
        bags stacked: bag p * B_global + b for its p-th feature) and its weight (None: unweighted). Sized from the
        host's counts alone."""
        i, _, positions, _ = block
        values, offsets, weights = inp.parts[i]
        Bg = inp.global_batch
        ends = np.cumsum([0] + inp.key_ids[self._key_base[i] : self._key_base[i + 1]])  # ids per key, on the host
        v0, v1 = int(ends[positions[0]]), int(ends[positions[-1] + 1])
        lo, hi = positions[0] * Bg, (positions[-1] + 1) * Bg
        lengths = offsets[lo + 1 : hi + 1] - offsets[lo:hi]
        n, dev = v1 - v0, values.device
        bag = torch.repeat_interleave(torch.arange(hi - lo, device=dev), lengths, output_size=n)
        lk = self.lookups[i]
        weighted = weights is not None and (lk.weighted or getattr(lk, "every_id_weighted", False))
        ids = values[v0:v1].long()
        order = torch.argsort(ids, stable=True)
        rows = ids[order]
        first = torch.ones(n, dtype=torch.bool, device=dev)
        if n > 1:
            first[1:] = rows[1:] != rows[:-1]
        seg = torch.cumsum(first, 0) - 1
        len_N = torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, seg, torch.ones_like(seg))
        weight = weights[v0:v1].float()[order] if weighted else None
        return rows, seg, len_N, bag[order], weight

    def _swap_squares(self, sq_local: dict[int, torch.Tensor], label: str) -> dict[int, torch.Tensor]:
        """Every block rank's squared row norms of each table, summed in the tables' column order (identical
        bits on every block rank): one all-to-all that every rank joins."""
        me, W = self.rank, self.world_size
        send: list[list[torch.Tensor]] = [[] for _ in range(W)]
        recv_sizes = [0] * W
        for t, sq in sorted(sq_local.items()):
            for d in self._holders[t]:
                if d != me:
                    send[d].append(sq)
                    recv_sizes[d] += sq.numel()
        totals = dict(sq_local)
        if W == 1:
            return totals
        flat = [x for parts in send for x in parts]
        buf = torch.cat(flat) if flat else torch.zeros(0, device=self._device)
        splits = ([sum(x.numel() for x in p) for p in send], recv_sizes)
        received = start_all_to_all(buf, *splits, self.group, label, scoped=False).wait()
        got: dict[tuple[int, int], torch.Tensor] = {}
        for d, piece in enumerate(received.split(recv_sizes)):
            shared = [(t, sq.numel()) for t, sq in sorted(sq_local.items()) if d != me and d in self._holders[t]]
            for (t, _), part in zip(shared, piece.split([n for _, n in shared])):
                got[(t, d)] = part
        for t in sq_local:
            parts = [sq_local[t] if d == me else got[(t, d)] for d in self._holders[t]]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            totals[t] = total
        return totals
