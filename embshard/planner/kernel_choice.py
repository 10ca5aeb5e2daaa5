"""Which tables the small-table kernel takes (TablePlan.kernel 'small'; embshard/kernels/small_tables.py).

The choice follows kernels.cost.choose_small_tables: the kernel must be predicted faster than FBGEMM for each
table alone (by a 10% margin, without its hot-row chain), and for each group of tables one lookup serves (a
rank's tables of one sharding scheme) with the group's longest chain, which the chains' launch pays once. The
planner takes it in three steps around the search (search.py):

1. `select` (before the search; choices.py built every option that may run on the kernel twice, one per kernel,
   options.small_form says which): each option keeps the kernel predicted faster for the table alone
   (kernels.cost.faster_alone on the lookup's forward + backward), so the search sees one choice per option
   and its size, and its speed, stay the same. A table constrained to `kernels: [small]` keeps the small forms
   only. Data-parallel tables share one lookup on every rank, so they get one kernel (ShardingPlan.check): the
   small one when every table whose cheapest option is data-parallel has a small form and
   choose_small_tables takes all of them together; the other kernel's data-parallel choices leave the search.
2. The search places and moves choices; the state counts each small-kernel group's launches and its longest
   chain per rank (state.py), so predicted step times include both.
3. `check_groups` (after the search): per rank and group, choose_small_tables on the placed small blocks with
   their chains; tables it does not take go back to FBGEMM (their other twin, on the same ranks, when it fits in
   memory; data-parallel tables all or none).

The kernel is never chosen on CPU topologies unless a constraint asks for it: there it is plain torch (no
Triton, no atomics), no faster than FBGEMM's CPU kernels, and its constants describe GPUs.
"""

from __future__ import annotations

import numpy as np

from embshard.kernels.cost import choose_small_tables, faster_alone
from embshard.plan import LookupKernel, ShardingType
from embshard.planner.choices import Item
from embshard.planner.problem import Problem
from embshard.planner.state import State
from embshard.tables import ConfigError

SMALL, FBGEMM, DP = LookupKernel.SMALL, LookupKernel.FBGEMM, ShardingType.DATA_PARALLEL


def _forced(item: Item) -> bool:
    return tuple(item.kernels) == (SMALL,)


def select(p: Problem) -> None:
    """Step 1 (module docstring): one kernel per option in `p.usable`, one kernel for data-parallel tables."""
    pairs = []  # (item, FBGEMM choice, small choice), both usable
    for i, it in enumerate(p.items):
        if it.twins and not _forced(it):
            usable = set(p.usable[i])
            for c in p.usable[i]:
                twin = it.twins.get(c)
                if it.choices[c].option.kernel is FBGEMM and twin in usable:
                    pairs.append((i, c, twin))
    fb = [p.items[i].choices[c].lookup_s for i, c, _ in pairs]
    wins = faster_alone(fb, [p.items[i].choices[s].lookup_s for i, _, s in pairs], True).tolist()
    loser = {(i, c if w else s) for (i, c, s), w in zip(pairs, wins)}
    for i, it in enumerate(p.items):
        if not it.twins and not _forced(it):
            continue
        if _forced(it):
            keep = [c for c in p.usable[i] if it.choices[c].option.kernel is SMALL]
        else:
            keep = [c for c in p.usable[i] if (i, c) not in loser]
        if not keep:
            raise ConfigError(
                f"table {p.names(it)[0]!r}: kernels: [small] but none of its options can run on the small-table "
                "kernel within a rank's memory (it needs fp32 weights in tier hbm, or host on CPUs): allow fbgemm"
            )
        p.usable[i] = keep
    _data_parallel_kernel(p)


def _data_parallel_kernel(p: Problem) -> None:
    """One kernel for all data-parallel tables: small when choose_small_tables takes every table whose cheapest
    choice (as _cheapest ranks them) is data-parallel, with its small form; else FBGEMM."""
    cheapest_dp = []
    for i, (it, u) in enumerate(zip(p.items, p.usable)):
        dp = [c for c in u if it.choices[c].option.sharding is DP]
        if not dp:
            continue
        if len(dp) == len(u) or min(u, key=lambda k, it=it: (round(it.choices[k].avg * 1e12), k)) in dp:
            cheapest_dp.append((i, dp[0]))
    if not cheapest_dp:
        return
    kernel = FBGEMM
    if all(p.items[i].choices[c].option.kernel is SMALL for i, c in cheapest_dp):
        small = [p.items[i].choices[c] for i, c in cheapest_dp]
        fb = [p.items[i].choices[p.items[i].twins[c]] for i, c in cheapest_dp if c in p.items[i].twins]
        if len(fb) == len(small):  # per rank: one block of each table (lookup_s is over all ranks' blocks)
            per = np.array([[f.lookup_s / f.blocks, s.lookup_s / s.blocks, s.hot[0]] for f, s in zip(fb, small)])
            if choose_small_tables(per[:, 0], per[:, 1], per[:, 2], True).all():
                kernel = SMALL
        elif all(_forced(p.items[i]) for i, _ in cheapest_dp):
            kernel = SMALL
    for i, it in enumerate(p.items):
        u = p.usable[i]
        for k, c in enumerate(u):
            ch = it.choices[c]
            if ch.option.sharding is DP and ch.option.kernel is not kernel:
                twin = it.twins.get(c)
                ok = twin is not None and it.choices[twin].hbm_max <= p.budgets.hbm + 0.5
                u[k] = twin if ok and not (kernel is FBGEMM and _forced(it)) else -1
        p.usable[i] = [c for c in u if c >= 0]
        if not p.usable[i]:
            other = "fbgemm" if kernel is SMALL else "small"
            raise ConfigError(
                f"table {p.names(it)[0]!r}: its only options are data-parallel with the {other} kernel, but the "
                f"data-parallel tables share one lookup and use {kernel.value}: allow other sharding types for it, "
                "or change its kernels constraint"
            )
    names = [n for i, _ in cheapest_dp for n in p.names(p.items[i])]
    for i, c in cheapest_dp:
        if kernel is SMALL or any(p.items[i].choices[k].option.kernel is SMALL for k in p.items[i].twins):
            p.note(
                p.items[i],
                f"data-parallel tables share one lookup: kernel {kernel.value} for all of them ({len(names)} tables "
                "cheapest data-parallel)",
            )


def check_groups(state: State, p: Problem) -> None:
    """Step 3 (module docstring): small-kernel groups that choose_small_tables rejects go back to FBGEMM."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, (c, ranks) in sorted(state.placed.items()):
        ch = p.items[i].choices[c]
        if ch.option.kernel is SMALL:  # data-parallel: every rank holds the same blocks, one rank tells
            for b, r in enumerate(ranks[:1] if ch.option.sharding is DP else ranks):
                groups.setdefault((ch.option.sharding.value, ch.option.tier.value, r), []).append((i, b))
    back: set[int] = set()
    for key, members in sorted(groups.items()):
        fb, sm, hot = [], [], []
        for i, b in members:
            it = p.items[i]
            c = state.placed[i][0]
            twin = it.twins.get(c)
            sm.append(it.choices[c].lookup[b])
            hot.append(it.choices[c].hot[b])
            fb.append(it.choices[twin].lookup[b] if twin is not None else np.inf)
        pick = choose_small_tables(fb, sm, hot, True)
        back.update(i for (i, _), ok in zip(members, pick.tolist()) if not ok and not _forced(p.items[i]))
    dp = [i for i, (c, _) in state.placed.items() if p.items[i].choices[c].option.sharding is DP]
    if back & set(dp):
        back -= set(dp)
        if all(not _forced(p.items[i]) and state.placed[i][0] in p.items[i].twins for i in dp):
            _flip(state, p, sorted(dp))
    for i in sorted(back):
        _flip(state, p, [i])


def _flip(state: State, p: Problem, items: list[int]) -> None:
    """Move the items to their FBGEMM twins on the same ranks, all of them if they fit in memory, else none."""
    was = {i: state.remove(i, p.items[i]) for i in items}
    new = {i: p.items[i].twins[c] for i, (c, _) in was.items()}
    need_h, need_d = np.zeros(state.W), np.zeros(state.W)
    for i, (_, ranks) in was.items():
        ch = p.items[i].choices[new[i]]
        np.add.at(need_h, list(ranks), ch.hbm)
        np.add.at(need_d, list(ranks), ch.ddr)
    fits = np.all(need_h <= state.hbm_free + 0.5) and np.all(need_d <= state.ddr_free + 0.5)
    for i, (c, ranks) in was.items():
        state.apply(i, p.items[i], new[i] if fits else c, ranks)
        if fits:
            p.note(
                p.items[i],
                "kernel: back to fbgemm: with the longest hot-row chain of its group the small-table kernel is not "
                "predicted 10% faster there",
            )
