"""Choices: every option of every table with its per-block load vectors and storage, computed at once with
numpy (one call of the cost model per sharding type x tier x cache size x kernel). An option that may run on the
small-table kernel has a twin with kernel 'small' after the table's options (`Item.twins`; kernel_choice.py
decides which of the two the search uses). Co-located tables form one item whose choices are the tiers they can
share, as table-wise, with FBGEMM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embshard.plan import ShardingType
from embshard.planner import loads
from embshard.planner.constraints import ParameterConstraints, colocation_groups
from embshard.planner.cost import CostModel, TableStats
from embshard.planner.options import Option, shard_runs, small_forms, table_options
from embshard.tables import ConfigError, TableConfig


class _Blocks:
    """A per-block array of a Choice: its run arrays' k-th, expanded to one row per block on first use, then kept."""

    def __init__(self, k: int, doc: str) -> None:
        self.k, self.__doc__ = k, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, choice: Choice | None, owner: type | None = None) -> Any:
        if choice is None:
            return self
        value = choice._expanded(self.k)
        choice.__dict__[self.name] = value  # an instance attribute now: later reads do not come here
        return value


class Choice:
    """One option of an item, with what each of its blocks costs and stores. Blocks are kept as runs of equal
    blocks (a row-wise option over 64 ranks is two runs) and expanded to one row per block on first use."""

    owner = _Blocks(0, "[blocks, NROWS]: load on the block's rank.")
    same = _Blocks(1, "[blocks, NROWS]: load on each other rank of the block's host.")
    other = _Blocks(2, "[blocks, NROWS]: load on each rank of the other hosts.")
    hbm = _Blocks(3, "[blocks]: GPU memory of each block (bytes).")
    ddr = _Blocks(4, "[blocks]: host memory of each block (bytes).")
    buffers = _Blocks(5, "[blocks]: each block's step memory (ids, backward workspace, pooled rows), part of hbm/ddr.")
    hot = _Blocks(6, "[blocks]: small-table kernel: the block's hot-row chain, paid once per group: its longest (s).")
    lookup = _Blocks(7, "[blocks]: the block's lookup forward + backward, the part that depends on the kernel (s).")

    def __init__(
        self, option: Option, runs: tuple, counts: np.ndarray, avg: float, members: list[Option], sizes: tuple
    ) -> None:
        self.option = option
        self.avg = avg
        """Balanced cost: the step time this choice adds if its work were spread evenly over the ranks (s)."""
        self.members = members
        """The option of each of the item's tables (co-located tables may differ in cache size)."""
        self._runs = runs  # (kind arrays: owner, same, other [n, NROWS]; the others [n]), first, end
        self._counts = counts
        self.blocks, self.hbm_max, self.ddr_max, self.total_hbm, self.total_ddr, self.lookup_s = sizes
        self.dense: dict = {}
        """Cache of [NROWS, W] loads for placements on fixed ranks (row-wise kinds, DP)."""

    def _expanded(self, k: int) -> np.ndarray:
        arrays, a, b = self._runs
        x = arrays[k][a:b]
        return x if self.blocks == 1 else np.repeat(x, self._counts.astype(int), axis=0)

    @property
    def first_owner(self) -> np.ndarray:
        """[NROWS]: load of the first block on its rank."""
        arrays, a, _ = self._runs
        return arrays[0][a]


@dataclass
class Item:
    """A table, or co-located tables placed together."""

    tables: list[int]
    """Indices of its tables."""
    choices: list[Choice]
    """Its options, in the fixed option order."""
    pinned: tuple[int, ...] = ()
    """Ranks its blocks may use (empty: any)."""
    weighted: bool = False
    """Whether any of its tables is weighted (one more input collective)."""
    twins: dict[int, int] = field(default_factory=dict)
    """Choice index -> the same option with the other lookup kernel (both ways), where it has one."""
    kernels: tuple = ()
    """The lookup kernels its constraints allow (empty: any)."""


def balanced_cost(total: np.ndarray, world_size: int) -> np.ndarray:
    """[..., NROWS] summed loads over all ranks -> step time if spread evenly (s)."""
    return np.maximum.reduceat(total, loads.PHASE_START, axis=-1).sum(axis=-1) / world_size


def build_items(
    model: CostModel,
    tables: Sequence[TableConfig],
    constraints: dict[str, ParameterConstraints],
) -> list[Item]:
    """Items with their choices, in table order."""
    topo, settings = model.topo, model.settings
    W, lws = topo.world_size, topo.local_world_size
    names = [t.name for t in tables]
    index = {n: i for i, n in enumerate(names)}
    groups = colocation_groups(names, constraints)
    grouped = {index[n] for g in groups if len(g) > 1 for n in g}
    opts = [table_options(t, constraints[t.name], topo, settings, colocated=i in grouped) for i, t in enumerate(tables)]
    twins: list[dict[int, int]] = [{} for _ in tables]
    alone = [i for i in range(len(tables)) if i not in grouped]
    cons = [constraints[names[i]] for i in alone]
    forms = small_forms(
        [tables[i] for i in alone], [opts[i] for i in alone], cons, topo, settings, not model.exact_column
    )
    for i, small in zip(alone, forms):
        for j, o in enumerate(small):
            if o is not None:
                twins[i][j], twins[i][len(opts[i])] = len(opts[i]), j
                opts[i].append(o)
    hints = [constraints[t.name].zipf_alpha for t in tables]
    alpha = np.array([settings.zipf_alpha if a is None else a for a in hints], dtype=float)
    # Runs of equal blocks of every (table, option), grouped by (sharding, tier, clf) for one vectorized call each.
    stats = TableStats.of(tables)
    kinds: dict[tuple, list[tuple]] = {}
    for i, t in enumerate(tables):
        for j, o in enumerate(opts[i]):
            entries = kinds.setdefault((o.sharding, o.tier, o.cache_load_factor, o.kernel), [])
            table_runs = shard_runs(t, o)
            blocks = sum(n for _, _, n in table_runs)
            entries.extend((i, j, rows, c, n, blocks) for rows, c, n in table_runs)
    per: dict[tuple[int, int], tuple] = {}
    for (st, tier, clf, kernel), entries in kinds.items():
        table = np.array(entries, dtype=np.int64)
        ti, oj = table[:, 0], table[:, 1]
        rows, cols, count, blocks = (table[:, k].astype(float) for k in (2, 3, 4, 5))
        sub = TableStats(*(getattr(stats, f)[ti] for f in TableStats.__dataclass_fields__))
        wk = model.work(sub, st, tier, rows, cols, clf, alpha[ti], kernel)
        mem = model.storage(sub, st, tier, rows, cols, clf, kernel)
        shape = (len(ti), loads.NROWS)
        owner, same, other = (np.broadcast_to(v, shape) for v in model.block_vecs(wk, st, blocks))
        hbm = np.broadcast_to(np.asarray(mem.hbm, dtype=float), rows.shape)
        ddr = np.broadcast_to(np.asarray(mem.ddr, dtype=float), rows.shape)
        step = np.broadcast_to(np.asarray(mem.hbm_buffers + mem.ddr_buffers, dtype=float), rows.shape)
        hot = np.broadcast_to(np.asarray(wk.hot_s, dtype=float), rows.shape)
        look = np.broadcast_to(np.asarray(wk.fwd_s - wk.route_s + wk.bwd_s, dtype=float), rows.shape)
        total = count[:, None] * (owner + (lws - 1) * same + (W - lws) * other)
        starts = np.flatnonzero(np.r_[True, (ti[1:] != ti[:-1]) | (oj[1:] != oj[:-1])])
        avg = balanced_cost(np.add.reduceat(total, starts, axis=0), W).tolist()
        sizes = zip(
            np.add.reduceat(count, starts).astype(int).tolist(),
            np.maximum.reduceat(hbm, starts).tolist(),
            np.maximum.reduceat(ddr, starts).tolist(),
            np.add.reduceat(hbm * count, starts).tolist(),
            np.add.reduceat(ddr * count, starts).tolist(),
            np.add.reduceat(look * count, starts).tolist(),
        )
        arrays = (owner, same, other, hbm, ddr, step, hot, look)
        starts_l = starts.tolist()
        ends = [*starts_l[1:], len(ti)]
        ti_l, oj_l = ti.tolist(), oj.tolist()
        for s, (a, b, size) in enumerate(zip(starts_l, ends, sizes)):
            per[(ti_l[a], oj_l[a])] = ((arrays, a, b), count[a:b], avg[s], size)

    def choice(o: Option, j_of: tuple[int, int], members: list[Option]) -> Choice:
        runs, n, avg, size = per[j_of]
        return Choice(o, runs, n, avg, members, size)

    items: list[Item] = []
    for g in groups:
        members = [index[n] for n in g]
        if len(members) == 1:
            i = members[0]
            chs = [choice(o, (i, j), [o]) for j, o in enumerate(opts[i])]
            cons = constraints[names[i]]
            items.append(Item([i], chs, cons.ranks, tables[i].weighted, twins[i], cons.kernels))
        else:
            items.append(_colocated(g, members, opts, per, constraints, tables, W, lws))
    return items


def _colocated(g, members, opts, per, constraints, tables, W: int, lws: int) -> Item:
    """Co-located tables: one table-wise block per tier all members allow; pinned ranks must agree."""
    pinned = set(range(W))
    for i in members:
        if constraints[tables[i].name].ranks:
            pinned &= set(constraints[tables[i].name].ranks)
    if not pinned:
        raise ConfigError(f"co-located tables {g} have pinned ranks that share no rank: pin them to a common rank")
    tiers = [o.tier for o in opts[members[0]]]
    for i in members[1:]:
        tiers = [t for t in tiers if t in [o.tier for o in opts[i]]]
    if not tiers:
        raise ConfigError(f"co-located tables {g} allow no common memory tier: allow one tier for all of them")
    chs = []
    for tier in tiers:
        parts, member_opts = [], []
        for i in members:
            j = next(j for j, o in enumerate(opts[i]) if o.tier is tier)
            parts.append(per[(i, j)])
            member_opts.append(opts[i][j])
        ow, sa, ot, hb, dd, bu, ho, lk = (sum(p[0][0][k][p[0][1] : p[0][2]] for p in parts) for k in range(8))
        avg = float(balanced_cost(ow[0] + (lws - 1) * sa[0] + (W - lws) * ot[0], W))
        size = (1, float(hb[0]), float(dd[0]), float(hb[0]), float(dd[0]), float(lk[0]))
        arrays = (ow, sa, ot, hb, dd, bu, ho, lk)
        chs.append(Choice(member_opts[0], (arrays, 0, 1), np.ones(1), avg, member_opts, size))
    weighted = any(tables[i].weighted for i in members)
    return Item(members, chs, tuple(sorted(pinned)) if len(pinned) < W else (), weighted)


def is_dense(option: Option) -> bool:
    """Whether the option's blocks cover a fixed rank set (row-wise over all ranks, DP) or a host (TWRW)."""
    return option.sharding in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL, ShardingType.TABLE_ROW_WISE)
