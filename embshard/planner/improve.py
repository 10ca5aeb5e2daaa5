"""Improving a placed plan: local search on the bottleneck (move a table, or swap two), and for small models the
exact search's optimum when it is better."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from embshard.planner import exact, loads
from embshard.planner.choices import is_dense
from embshard.planner.problem import Problem
from embshard.planner.state import State

CANDIDATES_PER_ROUND = 6
SWAP_PARTNERS = 8
FLOOR_MARGIN = 1e-12
"""Relative margin under State.floor before a choice is skipped: the step times it bounds add their phases in
other orders (a few units in the last place)."""


def improve(state: State, p: Problem) -> None:
    """Local search on the bottleneck: re-place the tables loading the slowest (phase, rank) most (a table
    that is the last of its sharding scheme counts the fixed costs its move would save), at most settings.max_moves
    tries."""
    items, usable, max_moves = p.items, p.usable, p.settings.max_moves
    tried = 0
    while tried < max_moves:
        J0 = state.objective()
        tol = 1e-9 + 1e-6 * J0
        phases = loads.phase_times(state.loads)
        scores: dict[int, float] = {}
        for phase in np.argsort(-phases.max(axis=1), kind="stable"):
            if phases[phase].max() <= 0:
                break
            r = int(phases[phase].argmax())
            rows = loads.PHASE_SLICES[phase]
            for i, contrib in _contributions(state, items, rows, r):
                if contrib > 0:
                    scores[i] = max(scores.get(i, 0.0), contrib * phases[phase].max())
            if len(scores) >= CANDIDATES_PER_ROUND:
                break
        candidates = sorted(scores, key=lambda i: (-scores[i], i))[:CANDIDATES_PER_ROUND]
        moved = False
        for i in candidates:
            if tried >= max_moves:
                break
            tried += 1
            it = items[i]
            c0, r0 = state.remove(i, it)
            best = (J0 - tol, None, None)
            for c in usable[i]:
                if state.floor(it, it.choices[c]) * (1 - FLOOR_MARGIN) >= best[0]:
                    continue  # no placement of this choice can beat the best so far
                got = state.best_ranks(it, it.choices[c])
                if got is not None and got[0] < best[0]:
                    best = (got[0], c, got[1])
            if best[1] is not None and (best[1], best[2]) != (c0, r0):
                state.apply(i, it, best[1], best[2])
                old, new = it.choices[c0].option.label, it.choices[best[1]].option.label
                p.note(
                    it,
                    f"local search: {old} on {_rk(r0)} -> {new} on {_rk(best[2])}, step "
                    f"{J0 * 1e3:.4f} -> {best[0] * 1e3:.4f} ms",
                )
                moved = True
                break
            state.apply(i, it, c0, r0)
        if not moved and candidates:
            moved, tries = _try_swaps(state, p, candidates[:3], phases, J0 - tol)
            tried += tries
        if not moved:
            break


def _contributions(state: State, items: Sequence, rows: slice, r: int) -> list[tuple[int, float]]:
    """(item, how much it loads rank r in the rows `rows`) for every placed item, in placement order: its block's
    busiest row there if it has a block on r, else half its busiest rows on the other ranks of r's host and of the
    other hosts (its first block's); the last table of a scheme also counts the scheme's latencies (and the
    step's host sync) its move would save. The rows' maxima are read for all items at once."""
    placed = list(state.placed.items())
    chosen = [items[i].choices[c] for i, (c, _) in placed]
    on_r = [r in ranks for _, (_, ranks) in placed]
    mine = [ch.owner[ranks.index(r)] for ch, (_, (_, ranks)), here in zip(chosen, placed, on_r) if here]
    peers = [ch for ch, here in zip(chosen, on_r) if not here]
    peak = iter(np.array(mine).reshape(len(mine), loads.NROWS)[:, rows].max(axis=1).tolist())
    same = np.array([ch.same[0] for ch in peers]).reshape(len(peers), loads.NROWS)[:, rows].max(axis=1)
    other = np.array([ch.other[0] for ch in peers]).reshape(len(peers), loads.NROWS)[:, rows].max(axis=1)
    half = iter((same + other).tolist())
    out = []
    for (i, _), ch, here in zip(placed, chosen, on_r):
        contrib = next(peak) if here else next(half) * 0.5
        out.append((i, contrib + state.fixed_freed(items[i], ch, rows)))
    return out


def _try_swaps(state: State, p: Problem, candidates: list[int], phases: np.ndarray, target: float) -> tuple[bool, int]:
    """Swap a single-block table on a bottleneck rank with one on a less loaded rank; keep the first swap that
    brings the step time under `target`. Returns (swapped, swaps tried)."""
    items = p.items
    singles = {
        i: pl for i, pl in state.placed.items() if len(pl[1]) == 1 and not is_dense(items[i].choices[pl[0]].option)
    }
    rank_load = phases.sum(axis=0).tolist()
    tries = 0
    by_load: list[int] | None = None  # the singles by (their rank's load, balanced cost, index), made once
    for i in candidates:
        if i not in singles:
            continue
        ci, (ri,) = singles[i]
        if by_load is None:
            by_load = sorted(
                singles, key=lambda j: (rank_load[singles[j][1][0]], items[j].choices[singles[j][0]].avg, j)
            )
        partners = list(itertools.islice((j for j in by_load if singles[j][1][0] != ri), SWAP_PARTNERS))
        for j in partners:
            tries += 1
            cj, (rj,) = singles[j]
            chi, chj = items[i].choices[ci], items[j].choices[cj]
            if (items[i].pinned and rj not in items[i].pinned) or (items[j].pinned and ri not in items[j].pinned):
                continue
            state.remove(i, items[i])
            state.remove(j, items[j])
            fits = (
                state.hbm_free[rj] >= chi.hbm_max - 0.5
                and state.ddr_free[rj] >= chi.ddr_max - 0.5
                and state.hbm_free[ri] >= chj.hbm_max - 0.5
                and state.ddr_free[ri] >= chj.ddr_max - 0.5
            )
            if fits:
                J_before = target
                state.apply(i, items[i], ci, (rj,))
                state.apply(j, items[j], cj, (ri,))
                J = state.objective()
                if J < J_before:
                    text = f"local search: swapped with {p.names(items[j])[0]!r}: rank {ri} -> {rj}"
                    p.note(items[i], text + f", step -> {J * 1e3:.4f} ms")
                    p.note(items[j], f"local search: swapped with {p.names(items[i])[0]!r}")
                    return True, tries
                state.remove(i, items[i])
                state.remove(j, items[j])
            state.apply(i, items[i], ci, (ri,))
            state.apply(j, items[j], cj, (rj,))
    return False, tries


def exact_if_better(greedy: State, fresh: State, p: Problem) -> State:
    """The exhaustive optimum (built in the empty state `fresh`) when it beats the greedy plan, else `greedy`."""
    items = p.items
    J, assignment = exact.exhaustive(fresh, items, p.usable)
    J0 = greedy.objective()
    if not assignment or J >= J0 - 1e-12:
        for it in items:
            p.note(it, f"exact search over all placements: the greedy plan is optimal ({J0 * 1e3:.4f} ms)")
        return greedy
    for i, (c, ranks) in enumerate(assignment):
        fresh.apply(i, items[i], c, ranks)
        if (c, ranks) != greedy.placed[i]:
            label = items[i].choices[c].option.label
            p.note(items[i], f"exact search: {label} on {_rk(ranks)} (step {J0 * 1e3:.4f} -> {J * 1e3:.4f} ms)")
    return fresh


def _rk(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {min(ranks)}-{max(ranks)}" if len(ranks) > 2 else f"ranks {ranks[0]},{ranks[1]}"
