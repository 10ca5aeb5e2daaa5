"""Choices: every option of every table with its per-block load vectors and storage, computed at once with
numpy (one call of the cost model per sharding type x tier x cache size x kernel). An option that may run on the
small-table kernel has a twin with kernel 'small' after the table's options (`Item.twins`; kernel_choice.py
decides which of the two the search uses). Co-located tables form one item whose choices are the tiers they can
share, as table-wise, with FBGEMM."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embshard.planner import loads
from embshard.planner.constraints import ParameterConstraints, colocation_groups
from embshard.planner.cost import CostModel, TableStats
from embshard.planner.options import Option, column_runs, small_forms, table_options
from embshard.spec.plan import ShardingType
from embshard.spec.tables import ConfigError, TableConfig


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
        self.group = (option.sharding, option.tier, option.kernel, option.raw)
        """Its lookup group (sharding type, tier, kernel, raw ids): the tables whose blocks share launches."""
        self.avg = avg
        """Balanced cost: the step time this choice adds if its work were spread evenly over the ranks (s)."""
        self.members = members
        """The option of each of the item's tables (co-located tables may differ in cache size)."""
        self._runs = runs  # (kind arrays: owner, same, other [n, NROWS]; the others [n]), first, end
        self._counts = counts
        self.blocks, self.hbm_max, self.ddr_max, self.total_hbm, self.total_ddr, self.lookup_s = sizes
        self.dense: dict = {}
        """Cache of [NROWS, W] loads for placements on fixed ranks (row-wise kinds, DP)."""
        self.peers: dict = {}
        """Cache of the rows each block loads on ranks other than its own (State._peer_rows)."""
        self._total: tuple[int, int, np.ndarray] | None = None

    def _expanded(self, k: int) -> np.ndarray:
        arrays, a, b = self._runs
        x = arrays[k][a:b]
        return x if self.blocks == 1 else np.repeat(x, self._counts.astype(int), axis=0)

    @functools.cached_property
    def owner_peak(self) -> np.ndarray:
        """[phases]: the longest any one block keeps its own rank busy in each phase (s)."""
        return np.maximum.reduceat(self.owner.max(axis=0), loads.PHASE_START)

    def total(self, world_size: int, local_world_size: int) -> np.ndarray:
        """[NROWS]: what all its blocks load on all ranks together (each block: `owner` on its rank, `same` on its
        host's other ranks, `other` on the other hosts' ranks), kept."""
        if self._total is None or self._total[:2] != (world_size, local_world_size):
            peers_same, peers_other = local_world_size - 1, world_size - local_world_size
            summed = (self.owner + peers_same * self.same + peers_other * self.other).sum(axis=0)
            self._total = (world_size, local_world_size, summed)
        return self._total[2]

    @property
    def first_owner(self) -> np.ndarray:
        """[NROWS]: load of the first block on its rank."""
        arrays, a, _ = self._runs
        return arrays[0][a]


class ChoiceList(Sequence):
    """An item's choices, each made (a Choice object) on first access and kept: the search reads most choices only
    in bulk (`ChoiceTable`), so most are never made."""

    def __init__(self, make: Callable[[int], Choice], n: int) -> None:
        self._make, self._made = make, [None] * n

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, k):  # type: ignore[override]
        ch = self._made[k]
        if ch.__class__ is Choice:  # made already (the common case)
            return ch
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if ch is None:
            ch = self._made[k] = self._make(k if k >= 0 else k + len(self._made))
        return ch


@dataclass
class Item:
    """A table, or co-located tables placed together."""

    tables: list[int]
    """Indices of its tables."""
    choices: Sequence[Choice]
    """Its options with their costs, in the fixed option order (a ChoiceList: made on first access)."""
    pinned: tuple[int, ...] = ()
    """Ranks its blocks may use (empty: any)."""
    weighted: bool = False
    """Whether any of its tables is weighted (one more input collective)."""
    twins: dict[int, int] = field(default_factory=dict)
    """Choice index -> the same option with the other lookup kernel (both ways), where it has one."""
    kernels: tuple = ()
    """The lookup kernels its constraints allow (empty: any)."""
    options: list[Option] = field(default_factory=list)
    """The option of each choice (`choices[c].option` without making the choice)."""
    base: int = 0
    """Index of its first choice in the ChoiceTable."""


@dataclass
class ChoiceTable:
    """Every choice of every item as flat arrays, items one after another in item order, each item's choices in
    their order (choice c of item i at `items[i].base + c`): what the search reads for all choices at once."""

    avg: np.ndarray
    """Balanced cost (s)."""
    hbm_max: np.ndarray
    """GPU memory of the largest block (bytes)."""
    ddr_max: np.ndarray
    """Host memory of the largest block (bytes)."""
    total_hbm: np.ndarray
    """GPU memory of all blocks (bytes)."""
    total_ddr: np.ndarray
    """Host memory of all blocks (bytes)."""
    lookup_s: np.ndarray
    """Lookup forward + backward of all blocks, the part that depends on the kernel (s)."""
    blocks: np.ndarray
    """Blocks (int)."""
    floor: np.ndarray
    """What the choice adds to the mean rank's time in the phases of one row (the lookups forward and backward,
    the data-parallel all-reduce and update), summed (s): a lower bound of the step of every plan is the batch's
    loads there plus each item's least (`step_floor`); 0 for co-located items."""


SINGLE_ROW_PHASES = np.array(
    [int(a) for a, b in zip(loads.PHASE_START, [*loads.PHASE_START[1:], loads.NROWS]) if b - a == 1]
)
"""The rows that are phases of their own: a phase lasts at least its mean rank's load there."""


def step_floor(base: np.ndarray, items: Sequence[Item], table: ChoiceTable) -> float:
    """A lower bound of the step time of every placement of the items (any of their choices) with the loads
    `base` [NROWS] on every rank: in a phase of one row the busiest rank does at least the mean rank's work, and
    loads only add up (fixed costs included)."""
    least = np.minimum.reduceat(table.floor, [it.base for it in items]) if items else np.zeros(0)
    return float(base[SINGLE_ROW_PHASES].sum() + least.sum())


def balanced_cost(total: np.ndarray, world_size: int) -> np.ndarray:
    """[..., NROWS] summed loads over all ranks -> step time if spread evenly (s)."""
    return np.maximum.reduceat(total, loads.PHASE_START, axis=-1).sum(axis=-1) / world_size


def build_items(
    model: CostModel,
    tables: Sequence[TableConfig],
    constraints: dict[str, ParameterConstraints],
) -> list[Item]:
    """Items with their choices, in table order."""
    return build_choices(model, tables, constraints)[0]


def build_choices(
    model: CostModel,
    tables: Sequence[TableConfig],
    constraints: dict[str, ParameterConstraints],
) -> tuple[list[Item], ChoiceTable]:
    """Items with their choices, in table order, and the ChoiceTable of all choices."""
    topo, settings = model.topo, model.settings
    W, lws = topo.world_size, topo.local_world_size
    names = [t.name for t in tables]
    index = {n: i for i, n in enumerate(names)}
    groups = colocation_groups(names, constraints)
    grouped = {index[n] for g in groups if len(g) > 1 for n in g}
    memo: dict[tuple, list[Option]] = {}  # the options depend on the table only through its width and id kind

    def options_of(i: int, t: TableConfig) -> list[Option]:
        c, colocated = constraints[t.name], i in grouped
        key = (id(c), t.embedding_dim, t.raw_ids, colocated)
        if key not in memo:
            memo[key] = table_options(t, c, topo, settings, colocated=colocated)
        return list(memo[key])

    opts = [options_of(i, t) for i, t in enumerate(tables)]
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
    # Runs of equal blocks of every (table, option), grouped by (sharding, tier, clf, kernel) for one vectorized
    # call of the cost model each; the (table, option) pairs of one Option object are cut into runs at once.
    stats = TableStats.of(tables)
    by_option: dict[int, tuple[Option, list[int], list[int]]] = {}
    for i, table_opts in enumerate(opts):
        for j, o in enumerate(table_opts):
            got = by_option.get(id(o))
            if got is None:
                got = by_option[id(o)] = (o, [], [])
            got[1].append(i)
            got[2].append(j)
    rows_all = np.array([t.num_embeddings for t in tables], dtype=np.int64)
    dims_all = np.array([t.embedding_dim for t in tables], dtype=np.int64)
    parts: dict[tuple, list[np.ndarray]] = {}
    for o, ti, oj in by_option.values():
        key = (o.sharding, o.tier, o.cache_load_factor, o.kernel)
        parts.setdefault(key, []).append(option_runs(o, np.array(ti), np.array(oj), rows_all, dims_all))
    kinds: list[tuple] = []  # per kind: (arrays, per-pair ti, oj, start, end, count, aggregates)
    for (st, tier, clf, kernel), runs_list in parts.items():
        ti, oj, run, rows_i, cols_i, count_i = np.concatenate(runs_list, axis=1)
        order = np.lexsort((run, oj, ti))  # each (table, option)'s runs together, in block order
        ti, oj = ti[order], oj[order]
        rows, cols, count = rows_i[order].astype(float), cols_i[order].astype(float), count_i[order].astype(float)
        sub = TableStats(*(getattr(stats, f)[ti] for f in TableStats.__dataclass_fields__))
        wk = model.work(sub, st, tier, rows, cols, clf, alpha[ti], kernel)
        mem = model.storage(sub, st, tier, rows, cols, clf, kernel)
        shape = (len(ti), loads.NROWS)
        first = np.flatnonzero(np.r_[True, (ti[1:] != ti[:-1]) | (oj[1:] != oj[:-1])])
        blocks = np.repeat(np.add.reduceat(count, first), np.diff(np.r_[first, len(ti)]))  # each run's table's
        owner, same, other = (np.broadcast_to(v, shape) for v in model.block_vecs(wk, st, blocks))
        hbm = np.broadcast_to(np.asarray(mem.hbm, dtype=float), rows.shape)
        ddr = np.broadcast_to(np.asarray(mem.ddr, dtype=float), rows.shape)
        step = np.broadcast_to(np.asarray(mem.hbm_buffers + mem.ddr_buffers, dtype=float), rows.shape)
        hot = np.broadcast_to(np.asarray(wk.hot_s, dtype=float), rows.shape)
        look = np.broadcast_to(np.asarray(wk.fwd_s - wk.route_s + wk.bwd_s, dtype=float), rows.shape)
        total = count[:, None] * (owner + (lws - 1) * same + (W - lws) * other)
        starts = np.flatnonzero(np.r_[True, (ti[1:] != ti[:-1]) | (oj[1:] != oj[:-1])])
        ends = np.r_[starts[1:], len(ti)]
        summed = np.add.reduceat(total, starts, axis=0)
        agg = (
            balanced_cost(summed, W),
            np.add.reduceat(count, starts).astype(int),
            np.maximum.reduceat(hbm, starts),
            np.maximum.reduceat(ddr, starts),
            np.add.reduceat(hbm * count, starts),
            np.add.reduceat(ddr * count, starts),
            np.add.reduceat(look * count, starts),
            summed[:, SINGLE_ROW_PHASES].sum(axis=1) / W,
        )
        kinds.append(
            ((owner, same, other, hbm, ddr, step, hot, look), ti[starts], oj[starts], starts, ends, count, agg)
        )
    # Where each (table, option) pair's numbers are: kind and pair index, by table-major flat position.
    n_opts = np.array([len(o) for o in opts], dtype=np.int64)
    table_base = np.r_[0, np.cumsum(n_opts)[:-1]]
    kind_of = np.empty(int(n_opts.sum()), dtype=np.int64)
    pair_of = np.empty_like(kind_of)
    for k, (_, pti, poj, *_rest) in enumerate(kinds):
        pos = table_base[pti] + poj
        kind_of[pos] = k
        pair_of[pos] = np.arange(len(pti))
    kind_l, pair_l = kind_of.tolist(), pair_of.tolist()
    aggs = [[a.tolist() for a in agg] for *_, agg in kinds]

    def numbers(i: int, j: int) -> tuple:
        """((arrays, first run, end), run counts, balanced cost, sizes) of option j of table i."""
        f = int(table_base[i]) + j
        arrays, _, _, starts, ends, count, _ = kinds[kind_l[f]]
        s, agg = pair_l[f], aggs[kind_l[f]]
        a, b = int(starts[s]), int(ends[s])
        return (arrays, a, b), count[a:b], agg[0][s], (agg[1][s], agg[2][s], agg[3][s], agg[4][s], agg[5][s], agg[6][s])

    def maker(i: int) -> Callable[[int], Choice]:
        table_opts = opts[i]

        def make(j: int) -> Choice:
            runs, n, avg, size = numbers(i, j)
            return Choice(table_opts[j], runs, n, avg, [table_opts[j]], size)

        return make

    items: list[Item] = []
    flat_items: list[tuple[int, Item]] = []  # singleton items: (table, item)
    base = 0
    for g in groups:
        members = [index[n] for n in g]
        if len(members) == 1:
            i = members[0]
            c = constraints[names[i]]
            item = Item([i], ChoiceList(maker(i), len(opts[i])), c.ranks, tables[i].weighted, twins[i], c.kernels)
            item.options = opts[i]
            flat_items.append((i, item))
        else:
            item = _colocated(g, members, opts, numbers, constraints, tables, W, lws)
        item.base = base
        base += len(item.options)
        items.append(item)
    # The flat table: singleton items' numbers straight from the kinds' aggregates, co-located ones from their
    # (few) choices.
    cols = [np.empty(base) for _ in range(6)] + [np.empty(base, dtype=np.int64), np.zeros(base)]
    if flat_items:
        t_idx = np.array([i for i, _ in flat_items])
        i_base = np.array([it.base for _, it in flat_items])
        span = n_opts[t_idx]
        src = np.repeat(table_base[t_idx], span) + _ranges(span)
        dst = np.repeat(i_base, span) + _ranges(span)
        ks, ps = kind_of[src], pair_of[src]
        for k, (*_x, agg) in enumerate(kinds):
            sel = ks == k
            avg, blocks, hbm_max, ddr_max, total_hbm, total_ddr, look, floor = agg
            for col, values in zip(cols, (avg, hbm_max, ddr_max, total_hbm, total_ddr, look, blocks, floor)):
                col[dst[sel]] = values[ps[sel]]
    for it in items:
        if len(it.tables) > 1:
            for c, ch in enumerate(it.choices):
                f = it.base + c
                values = (ch.avg, ch.hbm_max, ch.ddr_max, ch.total_hbm, ch.total_ddr, ch.lookup_s, ch.blocks)
                for col, v in zip(cols, values):
                    col[f] = v
    return items, ChoiceTable(*cols)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of `counts`, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)


def option_runs(o: Option, ti: np.ndarray, oj: np.ndarray, rows: np.ndarray, dims: np.ndarray) -> np.ndarray:
    """[6, n]: the runs of equal blocks of option `o` for tables `ti` (its index `oj` in each table's options):
    rows of (table, option index, run index, block rows, block cols, blocks in the run), runs in block order
    (`options.shard_runs` for many tables at once)."""
    R, D = rows[ti], dims[ti]
    one = np.ones_like(ti)
    st = o.sharding
    if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):  # geometry.row_runs
        bs = -(-R // o.parts)
        n = -(-R // bs)
        last = R - bs * (n - 1)
        full = last == bs
        head = np.stack([ti, oj, 0 * one, bs, D, np.where(full, n, n - 1)])
        tail = ~full
        rest = np.stack([ti[tail], oj[tail], one[tail], last[tail], D[tail], one[tail]])
        return np.concatenate([head, rest], axis=1)
    if st is ShardingType.COLUMN_WISE:  # one run per distinct width of its column blocks
        out = []
        for d in np.unique(D).tolist():
            sel = D == d
            for r, (c, n) in enumerate(column_runs(d, o.parts)):
                out.append(np.stack([ti[sel], oj[sel], r * one[sel], R[sel], c * one[sel], n * one[sel]]))
        return np.concatenate(out, axis=1)
    return np.stack([ti, oj, 0 * one, R, D, o.parts * one])


def _colocated(g, members, opts, numbers, constraints, tables, W: int, lws: int) -> Item:
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
            parts.append(numbers(i, j))
            member_opts.append(opts[i][j])
        ow, sa, ot, hb, dd, bu, ho, lk = (sum(p[0][0][k][p[0][1] : p[0][2]] for p in parts) for k in range(8))
        avg = float(balanced_cost(ow[0] + (lws - 1) * sa[0] + (W - lws) * ot[0], W))
        size = (1, float(hb[0]), float(dd[0]), float(hb[0]), float(dd[0]), float(lk[0]))
        arrays = (ow, sa, ot, hb, dd, bu, ho, lk)
        chs.append(Choice(member_opts[0], (arrays, 0, 1), np.ones(1), avg, member_opts, size))
    weighted = any(tables[i].weighted for i in members)
    item = Item(members, chs, tuple(sorted(pinned)) if len(pinned) < W else (), weighted)
    item.options = [ch.option for ch in chs]
    return item


def is_dense(option: Option) -> bool:
    """Whether the option's blocks cover a fixed rank set (row-wise over all ranks, DP) or a host (TWRW)."""
    return option.sharding in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL, ShardingType.TABLE_ROW_WISE)
