"""The search: choose a sharding type, tier and ranks for every table, minimising the predicted step time under
the memory budgets. Deterministic (no randomness; ties go to the first option / lowest rank).

1. Choices: every allowed option of every table, costed at once (choices.py).
2. Cheapest: each table takes its option with the least balanced cost (the step time it adds if its work were
   spread evenly), which is what makes tiny tables with many ids data-parallel.
3. Fit the totals: while the tables' summed GPU memory exceeds the summed budgets, move the table that loses the
   least time per byte freed to its next-less-GPU-memory option (HBM -> UVM-caching -> UVM, DP -> sharded). Where
   that moved tables to UVM caching, a second start moves tables off whole (UVM, not cached): each frees all its
   rows, so fewer leave GPU memory; steps 4 and 5 run for both starts and the faster plan is kept.
4. Greedy placement: replicated and row-wise tables first, then tables by decreasing size (time or memory), each
   onto the ranks that give the lowest step time with room in memory; an option that fits nowhere falls back
   to the table's next cheapest.
5. Local search (improve.py): take a table off a bottleneck (phase, rank), re-place it under each of its
   options or swap it with a table on a lighter rank, keep what lowers the step time; stop when nothing helps
   or after settings.max_moves tries.
6. Small models (at most settings.exact_limit assignments): exhaustive search (exact.py); its optimum replaces
   the greedy plan when better.
The lookup kernel (FBGEMM's TBE or the small-table kernel) is chosen per option before step 2 and checked per
group of tables after step 6 (kernel_choice.py).
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from embshard.planner import balance, errors, exact, kernel_choice, loads
from embshard.planner import exchange as twrw_exchange
from embshard.planner.choices import build_choices, is_dense
from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.cost import CostModel
from embshard.planner.errors import PlanningError, gib
from embshard.planner.improve import exact_if_better, improve
from embshard.planner.options import make_shards
from embshard.planner.predict import budgets, predict
from embshard.planner.problem import Problem
from embshard.planner.report import PlanReport
from embshard.planner.settings import PlannerSettings
from embshard.planner.state import State
from embshard.planner.topology import Topology
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import Exchange, MemoryTier, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError, TableConfig, validate_tables


def plan_sharding(*args: Any, **kwargs: Any) -> ShardingPlan:
    """The ShardingPlan of `plan_with_report` (same arguments), without the report."""
    return plan_with_report(*args, **kwargs)[0]


def plan_with_report(
    tables: Sequence[TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig | None = None,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None = None,
    settings: PlannerSettings | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """The plan and its PlanReport (predicted memory and step time, and why each table went where it did)."""
    with gc_paused():
        return _plan_with_report(tables, topology, batch_size, optimizer, constraints, settings)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: the search allocates hundreds of thousands of small
    objects that live until it ends (choices, notes), and the collector's passes over them took about half the
    planner's time. Nothing the search makes needs it (no reference cycles are left to collect early)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_with_report(
    tables: Sequence[TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig | None,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None,
    settings: PlannerSettings | None,
) -> tuple[ShardingPlan, PlanReport]:
    start = time.perf_counter()
    tables = validate_tables(tables)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} is invalid: give the samples per rank per step (>= 1)")
    optimizer = optimizer or FusedOptimizerConfig()
    settings = settings or PlannerSettings()
    cons = resolve_constraints(tables, constraints, topology.world_size)
    model = CostModel(topology, batch_size, optimizer, settings)
    items, table = build_choices(model, tables, cons)
    p = Problem(model, tables, budgets(model, tables), items, table)
    p.notes = {t.name: [] for t in tables}
    _cheapest(p)
    cheapest = list(p.chosen)
    notes_cheapest = {name: list(n) for name, n in p.notes.items()}
    _fit_totals(p)
    base = model.batch_loads(tables)
    state = State(model, p.budgets.hbm, p.budgets.ddr, base)
    notes = {name: list(n) for name, n in p.notes.items()}
    _place_all(state, p)
    improve(state, p)
    cached = [i for i, c in enumerate(p.chosen) if p.items[i].options[c].tier is MemoryTier.UVM_CACHING]
    if any(cheapest[i] != p.chosen[i] for i in cached):  # the fit moved tables to UVM caching: try whole tables off
        first = (state, p.chosen, p.notes, notes)
        p.chosen, p.notes = list(cheapest), {name: list(n) for name, n in notes_cheapest.items()}
        second = State(model, p.budgets.hbm, p.budgets.ddr, base)
        try:
            _fit_totals(p, whole_tables=True)
            notes = {name: list(n) for name, n in p.notes.items()}
            _place_all(second, p)
            improve(second, p)
        except PlanningError:
            second = None
        if second is None or second.objective() >= first[0].objective() * (1 - 1e-9):
            state, p.chosen, p.notes, notes = first
        else:
            state = second
            for i, (was, now) in enumerate(zip(first[1], p.chosen)):
                if was != now:
                    p.note(p.items[i], f"second start: as {p.items[i].options[now].label} (the tables over the budget "
                           "moved to host memory whole, not cached, so fewer of them left GPU memory: a faster "
                           "predicted step)")  # fmt: skip
    split = _split_start(p)
    if split is not None:  # the tables too large to balance, started on a host's ranks: keep the faster plan
        state = _second_start(state, p, split, notes, "too slow on one rank", base)
    merged = _merged_start(state, p)
    if merged is not None:  # data-parallel and row-wise lookup groups side by side: try one group fewer
        notes = {name: list(n) for name, n in p.notes.items()}
        state = _second_start(state, p, merged, notes, "one lookup group fewer", base)
    if settings.exact_limit and exact.count(state, p.items, p.usable) <= settings.exact_limit:
        state = exact_if_better(state, State(model, p.budgets.hbm, p.budgets.ddr, base), p)
    kernel_choice.check_groups(state, p)
    plan = _to_plan(state, p)
    report = predict(plan, tables, topology, batch_size, optimizer, cons, settings, p.notes)
    report.search_step_time_s = state.objective()
    times = report.exchange_step_s
    if settings.table_row_wise_exchange == "auto" and times:  # the same placement under the other exchange
        best = min(times, key=lambda e: (times[e], e != plan.table_row_wise_exchange.value))
        if best != plan.table_row_wise_exchange.value:
            plan = replace(plan, table_row_wise_exchange=best)
            report = predict(plan, tables, topology, batch_size, optimizer, cons, settings, p.notes)
            report.search_step_time_s = None  # the search priced the other exchange
    report.planner_seconds = time.perf_counter() - start
    return plan, report


def _cheapest(p: Problem) -> None:
    """Each item's usable choices (its largest shard fits a rank) and, as its first choice, the cheapest of them
    by balanced cost."""
    bud, tab, items = p.budgets, p.table, p.items
    fits = (tab.hbm_max <= bud.hbm + 0.5) & (tab.ddr_max <= bud.ddr + 0.5)
    bases = [it.base for it in items]
    ends = [*bases[1:], len(fits)]
    hot = set(balance.hot_tables(p.tables, p.topology.world_size)) if p.settings.split_hot_tables else set()
    for it, a, b in zip(items, bases, ends):
        u = np.flatnonzero(fits[a:b]).tolist()
        if not u:
            raise errors.too_large_for_a_rank(p, it)
        if hot and any(p.tables[ti].name in hot for ti in it.tables):
            u = _row_split_only(p, it, u)
        p.usable.append(u)
    kernel_choice.select(p)
    avg = tab.avg.tolist()
    key = np.round(tab.avg * 1e12).tolist()
    for it, u in zip(items, p.usable):
        b = it.base
        c = min(u, key=lambda k: (key[b + k], k))
        p.chosen.append(c)
        runner = min((k for k in u if k != c), key=lambda k: (avg[b + k], k), default=None)
        why = f"cheapest option, {avg[b + c] * 1e3:.4f} ms balanced"
        if runner is not None:
            why += f" (next: {it.options[runner].label} {avg[b + runner] * 1e3:.4f} ms)"
        p.note(it, why)


def _row_split_only(p: Problem, it: Any, usable: list[int]) -> list[int]:
    """The usable options of a hot item (balance.hot_tables) whose blocks each look up at most a balanced rank's
    ids (W x its ids per sample / blocks for row and column splits, a column block of width D/k looking up every
    id at 1/k of the bytes; B x its ids per sample data-parallel): row-wise, and table-row-wise or column-wise where
    their blocks stay within that (column-wise alone where the step is one CUDA graph: `graph_settings`); all of
    `usable` (with a note) when none of those fits."""
    W = p.topology.world_size
    even = balance.HOT_SHARE * sum(balance.table_ids_per_sample(t) for t in p.tables)
    mine = sum(balance.table_ids_per_sample(p.tables[ti]) for ti in it.tables)
    row_split = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.COLUMN_WISE)

    def block_ids(c: int) -> float:
        sharding = it.options[c].sharding
        if sharding is ShardingType.DATA_PARALLEL:
            return mine
        return W * mine / (it.choices[c].blocks if sharding in row_split else 1)

    split = [c for c in usable if block_ids(c) <= even * (1 + 1e-9)]
    if not split:
        p.note(it, "hot table (its lookups as one block exceed a balanced rank's), but no row split fits: every option")
        return usable
    p.note(
        it,
        f"hot table: its lookups as one block, {W} x its ids per sample, exceed a balanced rank's (every table's ids "
        "per sample): only options whose blocks look up at most that many (settings.split_hot_tables)",
    )
    return split


MERGE_LIMIT = 100
"""Models of at most this many items also try `_merged_start` (a lookup group's fixed costs matter there)."""


def _merged_start(state: State, p: Problem) -> list[int] | None:
    """The placed choices with every data-parallel item moved to its cheapest usable row-wise choice, when the
    placement has row-wise and data-parallel items side by side (hot tables made row-wise; each lookup group costs
    fixed kernels and, in an eager step, the host's time, and moving one item at a time keeps the group); None
    otherwise, or for models of more than MERGE_LIMIT items."""
    if len(p.items) > MERGE_LIMIT:
        return None
    placed = [state.placed[i][0] for i in range(len(p.items))]
    kinds = {p.items[i].options[c].sharding for i, c in enumerate(placed)}
    if not {ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE} <= kinds:
        return None
    avg = p.table.avg
    out, moved = list(placed), False
    for i, it in enumerate(p.items):
        if it.options[placed[i]].sharding is not ShardingType.DATA_PARALLEL:
            continue
        rw = [c for c in p.usable[i] if it.options[c].sharding is ShardingType.ROW_WISE]
        if rw:
            out[i], moved = min(rw, key=lambda c: (float(avg[it.base + c]), c)), True
    return out if moved else None


def _second_start(state: State, p: Problem, start: list[int], notes: dict, why: str, base) -> State:
    """Place and improve again from the choices `start` (with `notes` as the tables' notes so far); keep that plan
    if its objective is lower, else the one in `state` (with its choices and notes). Tables that start otherwise
    get a note saying `why`."""
    first = (state, p.chosen, p.notes)
    p.chosen, p.notes = start, notes
    for i, c in enumerate(start):
        if c != first[1][i]:
            p.note(p.items[i], f"second start: as {p.items[i].choices[c].option.label} ({why})")
    state = State(p.model, p.budgets.hbm, p.budgets.ddr, base)
    _place_all(state, p)
    improve(state, p)
    if state.objective() >= first[0].objective() * (1 - 1e-9):
        state, p.chosen, p.notes = first
    return state


def _split_start(p: Problem) -> list[int] | None:
    """The chosen choices with every single-block item that one rank cannot carry within the balanced step (its
    block alone takes longer on its rank than the whole model would spread evenly) moved to its cheapest usable
    table-row-wise choice; None when no item moves (one host, or none too large). The first start takes each
    table's cheapest option by balanced cost, and moving one such table at a time cannot lower the step while the
    others still bound it: this start splits them together."""
    if not twrw_exchange.applies(p.topology):
        return None
    avg = p.table.avg
    target = sum(float(avg[it.base + c]) for it, c in zip(p.items, p.chosen))
    out, moved = list(p.chosen), False
    for i, it in enumerate(p.items):
        ch = p.choice(i)
        if is_dense(ch.option) or ch.blocks != 1:
            continue
        if np.maximum.reduceat(ch.first_owner, loads.PHASE_START).sum() <= target:
            continue
        twrw = [c for c in p.usable[i] if it.options[c].sharding is ShardingType.TABLE_ROW_WISE]
        if twrw:
            out[i], moved = min(twrw, key=lambda c: (float(avg[it.base + c]), c)), True
    return out if moved else None


def _fit_totals(p: Problem, whole_tables: bool = False) -> None:
    """Move tables to options with less GPU memory, least time lost per byte freed first, until the totals fit.
    `whole_tables`: never to UVM caching (a table leaves GPU memory whole: it frees more per table moved, so fewer
    tables leave; the second start of the search)."""
    items, usable, chosen, topo, tab = p.items, p.usable, p.chosen, p.topology, p.table
    fill = p.settings.memory_fill
    cap_h, cap_d = fill * topo.world_size * p.budgets.hbm, fill * topo.world_size * p.budgets.ddr
    avg, hbm, ddr = tab.avg.tolist(), tab.total_hbm.tolist(), tab.total_ddr.tolist()
    need_h = sum(hbm[it.base + c] for it, c in zip(items, chosen))
    need_d = sum(ddr[it.base + c] for it, c in zip(items, chosen))
    if need_h <= cap_h and need_d <= cap_d:
        return
    if need_d > cap_d or not topo.is_gpu:
        raise errors.totals_do_not_fit(p)
    over = need_h - cap_h

    def best_move(i: int) -> tuple[float, int, int] | None:
        b = items[i].base
        cur = b + chosen[i]
        best = None
        for c in usable[i]:
            freed = hbm[cur] - hbm[b + c]
            if freed <= 1.0 or (whole_tables and items[i].options[c].tier is MemoryTier.UVM_CACHING):
                continue
            ratio = (avg[b + c] - avg[cur]) / freed
            if best is None or (ratio, c) < best[:2]:
                best = (ratio, c, i)
        return best

    heap = [m for m in (best_move(i) for i in range(len(items))) if m is not None]
    heapq.heapify(heap)
    while need_h > cap_h:
        while heap:
            ratio, c, i = heapq.heappop(heap)
            b = items[i].base
            f, cur = b + c, b + chosen[i]
            if hbm[cur] - hbm[f] <= 1.0:
                continue  # stale
            if need_d - ddr[cur] + ddr[f] > cap_d:
                continue
            break
        else:
            raise errors.totals_do_not_fit(p)
        need_h += hbm[f] - hbm[cur]
        need_d += ddr[f] - ddr[cur]
        p.note(
            items[i],
            f"GPU memory over budget by {gib(over)} in total: moved from {items[i].options[chosen[i]].label} to "
            f"{items[i].options[c].label}, freeing {gib(hbm[cur] - hbm[f])} for +{(avg[f] - avg[cur]) * 1e3:.4f} ms "
            "(least time lost per GiB freed)",
        )
        chosen[i] = c
        nxt = best_move(i)
        if nxt is not None:
            heapq.heappush(heap, nxt)


def _place_all(state: State, p: Problem) -> None:
    """Greedy: replicated / row-wise items first, then the largest (in time or memory) first."""
    items, bud = p.items, p.budgets
    chosen = [p.choice(i) for i in range(len(items))]
    target = max(sum(ch.avg for ch in chosen), 1e-12)
    # Weight: the largest of the first block's time alone over the summed balanced cost, and its memory over
    # the budgets; replicated and row-wise items first. Heaviest first, ties in item order.
    first = np.array([ch.first_owner for ch in chosen]).reshape(len(chosen), loads.NROWS)
    peak = np.maximum.reduceat(first, loads.PHASE_START, axis=1).sum(axis=1)
    mem_h = np.array([ch.hbm_max for ch in chosen]) / max(bud.hbm, 1.0)
    mem_d = np.array([ch.ddr_max for ch in chosen]) / max(bud.ddr, 1.0)
    weight = np.maximum(np.maximum(peak / target, mem_h), mem_d)
    weight[[is_dense(ch.option) for ch in chosen]] = np.inf
    order = np.lexsort((np.arange(len(items)), -weight)).tolist()
    for i in order:
        it = items[i]
        first = p.chosen[i]
        got = state.best_ranks(it, it.choices[first])
        if got is not None:
            state.apply(i, it, first, got[1])
            continue
        fallbacks = sorted((c for c in p.usable[i] if c != first), key=lambda c: (it.choices[c].avg, c))
        for c in fallbacks:
            got = state.best_ranks(it, it.choices[c])
            if got is None:
                continue
            state.apply(i, it, c, got[1])
            p.note(
                it,
                f"{it.choices[first].option.label} fit no rank's free memory: placed as {it.choices[c].option.label}",
            )
            break
        else:
            raise errors.placement_failed(p, it, [first, *fallbacks], state.hbm_free, state.ddr_free)


def _to_plan(state: State, p: Problem) -> ShardingPlan:
    out: dict[str, TablePlan] = {}
    for i, it in enumerate(p.items):
        c, ranks = state.placed[i]
        ch = it.choices[c]
        for k, ti in enumerate(it.tables):
            t, opt = p.tables[ti], ch.members[k]
            shards = make_shards(t, opt, ranks)
            kw = {"cache_load_factor": opt.cache_load_factor} if opt.tier is MemoryTier.UVM_CACHING else {}
            out[t.name] = TablePlan(t.name, opt.sharding, opt.tier, shards, kernel=opt.kernel, **kw)
    topo = p.topology
    twrw = any(tp.sharding_type is ShardingType.TABLE_ROW_WISE for tp in out.values())
    exchange = p.model.exchange if twrw and twrw_exchange.applies(topo) else Exchange.FLAT
    return ShardingPlan(topo.world_size, topo.local_world_size, tuple(out[t.name] for t in p.tables), exchange)
