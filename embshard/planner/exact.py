"""Exact search for small models: every placement of every option of every table, depth first, pruned by the
best step time found so far (adding a table never lowers any phase's maximum, so a partial plan that is already
slower cannot become faster). Used by the planner when the placements to try are few (settings.exact_limit)."""

from __future__ import annotations

import itertools
import math

from embshard.planner.choices import Choice, Item
from embshard.planner.state import State
from embshard.spec.plan import ShardingType


def placements(state: State, item: Item, ch: Choice) -> list[tuple[int, ...]]:
    """Every rank tuple the choice could occupy (memory is checked when placing)."""
    W, lws = state.W, state.lws
    allowed = list(item.pinned) if item.pinned else list(range(W))
    st = ch.option.sharding
    if st in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL):
        return [tuple(range(ch.blocks))]
    if st is ShardingType.TABLE_ROW_WISE:
        hosts = [tuple(range(h * lws, h * lws + ch.blocks)) for h in range(state.H)]
        return [r for r in hosts if set(r) <= set(allowed)]
    return list(itertools.permutations(allowed, ch.blocks))


def n_placements(state: State, item: Item, ch: Choice) -> int:
    """len(placements(...)) without listing them."""
    st = ch.option.sharding
    if st in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL, ShardingType.TABLE_ROW_WISE):
        return len(placements(state, item, ch))
    n = len(item.pinned) if item.pinned else state.W
    return math.perm(n, ch.blocks) if ch.blocks <= n else 0


def count(state: State, items: list[Item], usable: list[list[int]]) -> int:
    """How many complete assignments the exhaustive search would enumerate (before pruning)."""
    total = 1
    for it, u in zip(items, usable):
        total *= sum(n_placements(state, it, it.choices[c]) for c in u)
        if total > 10**12:
            break
    return total


def exhaustive(state: State, items: list[Item], usable: list[list[int]]) -> tuple[float, list[tuple[int, tuple]]]:
    """The best (step time, [(choice, ranks) per item]) over all assignments that fit; `state` must be empty and
    is left empty. Items are tried largest first so the bound prunes early."""
    order = sorted(range(len(items)), key=lambda i: -max(items[i].choices[c].avg for c in usable[i]))
    moves = [
        [
            (c, r)
            for c in sorted(usable[i], key=lambda c: items[i].choices[c].avg)
            for r in placements(state, items[i], items[i].choices[c])
        ]
        for i in order
    ]
    best: list = [math.inf, None]
    current: dict[int, tuple[int, tuple]] = {}

    def fits(ch: Choice, ranks: tuple) -> bool:
        need_h, need_d = {}, {}
        for b, r in enumerate(ranks):
            need_h[r] = need_h.get(r, 0.0) + ch.hbm[b]
            need_d[r] = need_d.get(r, 0.0) + ch.ddr[b]
        return all(state.hbm_free[r] >= v - 0.5 for r, v in need_h.items()) and all(
            state.ddr_free[r] >= v - 0.5 for r, v in need_d.items()
        )

    def dfs(k: int) -> None:
        if k == len(order):
            J = state.objective()
            if J < best[0] - 1e-15:
                best[0], best[1] = J, dict(current)
            return
        i = order[k]
        for c, ranks in moves[k]:
            if not fits(items[i].choices[c], ranks):
                continue
            state.apply(i, items[i], c, ranks)
            if state.objective() < best[0]:
                current[i] = (c, ranks)
                dfs(k + 1)
                del current[i]
            state.remove(i, items[i])

    dfs(0)
    if best[1] is None:
        return math.inf, []
    return best[0], [best[1][i] for i in range(len(items))]
