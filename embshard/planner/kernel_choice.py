"""Which tables the small-table kernel takes (TablePlan.kernel 'small'; embshard/kernels/small_tables.py).

The choice follows kernel_model.choose_small_tables: the kernel must be predicted faster than FBGEMM for each
table alone (by a 10% margin, without its hot-row chain), and for each group of tables one lookup serves (a
rank's tables of one sharding scheme) with the group's longest chain, which the chains' launch pays once. The
planner takes it in three steps around the search (search.py):

1. `select` (before the search; choices.py built every option that may run on the kernel twice, one per kernel,
   options.small_form says which): each option keeps the kernel predicted faster for the table alone
   (kernel_model.faster_alone on the lookup's forward + backward), so the search sees one choice per option
   and its size, and its speed, stay the same. A table constrained to `kernels: [small]` keeps the small forms
   only. Data-parallel tables share one lookup on every rank, so they get one kernel (ShardingPlan.check): the
   one with the lower summed balanced cost of the tables that may be data-parallel, each at its cheapest
   choice (the small one only if choose_small_tables takes those that would be data-parallel on it, with their
   longest chain); the other kernel's data-parallel choices leave the search.
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

from embshard.planner.choices import Item
from embshard.planner.kernel_model import choose_small_tables, faster_alone
from embshard.planner.problem import Problem
from embshard.planner.state import State
from embshard.spec.plan import LookupKernel, ShardingType
from embshard.spec.tables import ConfigError

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
                if it.options[c].kernel is FBGEMM and twin in usable:
                    pairs.append((i, c, twin))
    look = p.table.lookup_s
    fb = [look[p.items[i].base + c] for i, c, _ in pairs]
    wins = faster_alone(fb, [look[p.items[i].base + s] for i, _, s in pairs], True).tolist()
    loser = {(i, c if w else s) for (i, c, s), w in zip(pairs, wins)}
    for i, it in enumerate(p.items):
        if not it.twins and not _forced(it):
            continue
        if _forced(it):
            keep = [c for c in p.usable[i] if it.options[c].kernel is SMALL]
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
    """One kernel for all data-parallel tables: for each kernel, every table that may be data-parallel takes its
    cheapest choice with the data-parallel choice on that kernel (or none, where it has no such form); the kernel
    with the lower sum of those balanced costs wins, the small one only if choose_small_tables also takes all
    the tables that would be data-parallel on it (with their longest hot chain). The data-parallel choices of the
    other kernel leave the search."""
    usable = {SMALL: {}, FBGEMM: {}}  # kernel -> item -> its usable choices with that data-parallel kernel
    total = {SMALL: 0.0, FBGEMM: 0.0}
    chosen_dp = {SMALL: [], FBGEMM: []}  # kernel -> (item, choice) of the tables that would be data-parallel
    avg, key, hbm_max = p.table.avg.tolist(), np.round(p.table.avg * 1e12).tolist(), p.table.hbm_max.tolist()
    hbm_budget = p.budgets.hbm + 0.5
    for i, it in enumerate(p.items):
        u = p.usable[i]
        c = next((c for c in u if it.options[c].sharding is DP), None)
        if c is None:
            continue
        b = it.base
        for kernel in (SMALL, FBGEMM):
            dp = c if it.options[c].kernel is kernel else it.twins.get(c)
            if dp is not None and (hbm_max[b + dp] > hbm_budget or (kernel is FBGEMM and _forced(it))):
                dp = None
            uk = [x for x in (dp if x == c else x for x in u) if x is not None]
            usable[kernel][i] = uk
            if not uk:
                total[kernel] = np.inf
                continue
            best = min(uk, key=lambda k, b=b: (key[b + k], k))
            total[kernel] += avg[b + best]
            if best == dp:
                chosen_dp[kernel].append((i, dp))
    if not usable[FBGEMM]:
        return
    kernel = FBGEMM
    if total[SMALL] < total[FBGEMM]:
        per = np.array([_per_rank(p.items[i], c) for i, c in chosen_dp[SMALL]]).reshape(-1, 3)
        if choose_small_tables(per[:, 0], per[:, 1], per[:, 2], True).all() or total[FBGEMM] == np.inf:
            kernel = SMALL
    if total[kernel] == np.inf:
        i = next(i for i, u in usable[kernel].items() if not u)
        other = "fbgemm" if kernel is SMALL else "small"
        raise ConfigError(
            f"table {p.names(p.items[i])[0]!r}: its only options are data-parallel with the {other} kernel, but the "
            f"data-parallel tables share one lookup and use {kernel.value}: allow other sharding types for it, or "
            "change its kernels constraint"
        )
    for i, u in usable[kernel].items():
        p.usable[i] = u
    if any(p.items[i].twins for i in usable[kernel]):
        other = FBGEMM if kernel is SMALL else SMALL
        why = (
            f"data-parallel tables share one lookup: kernel {kernel.value} for all of them ({len(chosen_dp[kernel])} "
            f"cheapest data-parallel; summed balanced cost {total[kernel] * 1e3:.4f} ms, with {other.value} "
            f"{total[other] * 1e3:.4f} ms)"
        )
        for i, _ in chosen_dp[kernel]:
            p.note(p.items[i], why)


def _per_rank(it: Item, c: int) -> tuple[float, float, float]:
    """(FBGEMM lookup, small lookup, hot chain) of one block of a small data-parallel choice (one per rank)."""
    twin = it.twins.get(c)
    fb = it.choices[twin].lookup_s / it.choices[twin].blocks if twin is not None else np.inf
    return fb, it.choices[c].lookup_s / it.choices[c].blocks, float(it.choices[c].hot[0])


def check_groups(state: State, p: Problem) -> None:
    """Step 3 (module docstring): small-kernel groups that choose_small_tables rejects go back to FBGEMM."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, (c, ranks) in sorted(state.placed.items()):
        ch = p.items[i].choices[c]
        if ch.option.kernel is SMALL:  # data-parallel: every rank holds the same blocks, one rank tells
            for b, r in enumerate(ranks[:1] if ch.option.sharding is DP else ranks):
                groups.setdefault((ch.option.sharding.value, ch.option.tier.value, r), []).append((i, b))
    back: set[int] = set()
    for _key, members in sorted(groups.items()):
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
