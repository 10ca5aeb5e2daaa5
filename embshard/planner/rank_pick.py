"""Where one block goes best, read from a lower bound first: the rank a block would take if the loads it puts on
the other ranks raised no phase, checked on that rank alone.

A block on rank q makes each row k at least max(own[k, q], busiest[k]) (its rank's new load, or the row's
current maximum: loads only grow), so the step with the block on q is at least the bound, the sum over phases
of the larger of q's own new phase time and the phase's current time (`bound_pick`). The search ranks placements
by (step time to 1 ns, own time, free GPU memory, rank); the bound is never above the step time and the other
three are exact, so when the rank that is first by the bound has a step time equal to its bound (to 1 ns), no
other rank can come before it: the result is the one the evaluation of every rank gives. Most blocks of large
models land where the step does not grow, and one rank's evaluation replaces the whole matrix's."""

from __future__ import annotations

import numpy as np

from embshard.planner import loads


def bound_pick(
    own: np.ndarray,
    busiest: np.ndarray,
    phase_add: np.ndarray | None,
    feasible: np.ndarray,
    hbm_free: np.ndarray,
) -> tuple[int, float, np.ndarray]:
    """(the rank first by (bound to 1 ns, own time, most free GPU memory, lowest rank) among the feasible ones,
    its bound in ns, rounded, and every rank's own time [W]) for a block whose own loads on each rank are
    `own` [NROWS, W], with `busiest` [phases] the current phase times and `phase_add` [phases] (or None) what
    the placement adds to every rank's phases."""
    own_phase = loads.phase_maxima(own)
    own_t = own_phase.sum(axis=0)  # two or more columns: the phases added one after another (phase_max_sum's)
    bound = np.maximum(own_phase, busiest[:, None], out=own_phase)
    if phase_add is not None:
        bound += phase_add[:, None]
    key = np.rint(bound.sum(axis=0) * 1e9)
    key[~feasible] = np.inf
    least = key.min()
    ties = np.flatnonzero(key == least)
    if len(ties) > 1:
        t = own_t[ties]
        ties = ties[t == t.min()]
        if len(ties) > 1:
            free = hbm_free[ties]
            ties = ties[free == free.max()]
    return int(ties[0]), float(least), own_t


def column_step(column: np.ndarray, phase_add: np.ndarray | None) -> float:
    """Step time of one rank's new loads `column` [NROWS] (each row's new maximum over the ranks), with
    `phase_add` added to each phase: the number `loads.phase_max_sum` gives for that column of a matrix."""
    per_phase = np.maximum.reduceat(column, loads.PHASE_START)
    if phase_add is not None:
        per_phase += phase_add
    return loads.column_sum(per_phase.tolist())


def column(
    own_q: np.ndarray,
    row_max: np.ndarray,
    q: int,
    h: int,
    rows: np.ndarray | None,
    a: np.ndarray,
    x: np.ndarray,
    stats: tuple | None,
) -> np.ndarray:
    """[NROWS]: each row's new maximum with a block on rank q of host h (its column of the matrix that
    State._best_single evaluates for every rank, the same numbers): q's own new loads `own_q`, the row's current
    maximum, and in `rows` (the rows the block loads on other ranks) the largest of q's host's other ranks plus
    `a` and the other hosts' plus `x`, from `stats` (State._host_stats: per host its top, second, the other
    hosts' top and its busiest rank)."""
    col = np.maximum(own_q, row_max)
    if rows is not None:
        host_top, second, other_top, top_pos = stats
        reach = np.where(top_pos[:, h] == q, second[:, h], host_top[:, h]) + a[rows]
        if other_top is not None:
            np.maximum(reach, other_top[:, h] + x[rows], out=reach)
        col[rows] = np.maximum(col[rows], reach)
    return col
