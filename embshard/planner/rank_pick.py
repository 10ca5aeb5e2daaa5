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
    blocked: np.ndarray,
    hbm_free: np.ndarray,
) -> tuple[int, float, np.ndarray] | None:
    """(the rank first by (bound to 1 ns, own time, most free GPU memory, lowest rank) among the ranks not
    `blocked` [W] (None: every rank is), its bound in ns, rounded, and every rank's own time [W]) for a block
    whose own loads on each rank are `own` [NROWS, W], with `busiest` [phases] the current phase times and
    `phase_add` [phases] (or None) what the placement adds to every rank's phases."""
    own_phase = loads.phase_maxima(own)
    own_t = np.add.reduce(
        own_phase, axis=0
    )  # two or more columns: the phases added one after another (phase_max_sum's)
    bound = np.maximum(own_phase, busiest[:, None], out=own_phase)
    if phase_add is not None:
        bound += phase_add[:, None]
    key = np.add.reduce(bound, axis=0)
    key *= 1e9
    np.rint(key, out=key)
    key[blocked] = np.inf
    least = float(np.minimum.reduce(key))
    if least == np.inf:
        return None
    ties = (key == least).nonzero()[0]
    if len(ties) > 1:
        t = own_t[ties]
        ties = ties[t == np.minimum.reduce(t)]
        if len(ties) > 1:
            free = hbm_free[ties]
            ties = ties[free == np.maximum.reduce(free)]
    return int(ties[0]), least, own_t


def column_step(column: np.ndarray, phase_add: np.ndarray | None) -> float:
    """Step time of one rank's new loads `column` [NROWS] (each row's new maximum over the ranks), with
    `phase_add` added to each phase: the number `loads.phase_max_sum` gives for that column of a matrix."""
    per_phase = np.maximum.reduceat(column, loads.PHASE_START)
    if phase_add is not None:
        per_phase += phase_add
    return loads.column_sum(per_phase.tolist())


def others(
    loads_m: np.ndarray, rows: np.ndarray, q: int, lws: int, row_max: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """For the rows `rows` of the loads `loads_m` [NROWS, W] (each row's maximum `row_max` [NROWS]): the largest
    load of rank q's host's other ranks, and of the other hosts' ranks (None on one host). A row whose maximum
    lies outside q's host has it as the other hosts' largest; the others are read."""
    W = loads_m.shape[1]
    h0 = q // lws * lws
    h1 = h0 + lws
    host = loads_m[rows, h0:h1]
    if W == lws:
        host[:, q - h0] = -np.inf
        return np.maximum.reduce(host, axis=1), None
    top = row_max[rows]
    inside = np.maximum.reduce(host, axis=1) >= top  # the row's maximum is (also) on q's host
    host[:, q - h0] = -np.inf
    same = np.maximum.reduce(host, axis=1)
    if not np.logical_or.reduce(inside):
        return same, top
    read = loads_m[rows[inside]]
    other = np.maximum.reduce(read[:, h1:] if h0 == 0 else read[:, :h0], axis=1)
    if 0 < h0 and h1 < W:
        np.maximum(other, np.maximum.reduce(read[:, h1:], axis=1), out=other)
    top = top.copy()
    top[inside] = other
    return same, top


def column(
    own_q: np.ndarray,
    row_max: np.ndarray,
    rows: np.ndarray | None,
    a: np.ndarray,
    x: np.ndarray,
    stats: tuple[np.ndarray, np.ndarray | None] | None,
) -> np.ndarray:
    """[NROWS]: each row's new maximum with a block on one rank (its column of the matrix that
    State._best_single evaluates for every rank, the same numbers): the rank's own new loads `own_q`, the row's
    current maximum, and in `rows` (the rows the block loads on other ranks) the largest of its host's other
    ranks plus `a` and of the other hosts' ranks plus `x` (`stats`, from `others`)."""
    col = np.maximum(own_q, row_max)
    if rows is not None:
        same, other = stats
        reach = same + a[rows]
        if other is not None:
            np.maximum(reach, other + x[rows], out=reach)
        col[rows] = np.maximum(col[rows], reach)
    return col


def add_peers(
    new: np.ndarray,
    own: np.ndarray,
    rows: np.ndarray,
    a: np.ndarray,
    x: np.ndarray,
    stats: tuple,
    row_max: np.ndarray,
    hosts: int,
    lws: int,
) -> None:
    """Raise `new` [NROWS, W] (the rows' new maxima for a block on each rank) in `rows` by what the block
    loads on the other ranks: on rank q of host h a row's other ranks reach the top of h's other ranks plus
    `a` (same host) and the top of the other hosts plus `x`. For every rank but the busiest of its host (per row)
    the top of h's other ranks is h's top; for the busiest it is h's second. `stats` ([m, H] each: per host its
    top, second, the other hosts' top or None on one host, its busiest rank: State._host_stats); `own`: each
    rank's own new loads; `row_max`: each row's current maximum."""
    host_top, second, other_top, top_pos = stats
    a_r, x_r = a[rows, None], x[rows, None]
    e_most = host_top + a_r  # [m, H]: ranks that are not their host's busiest
    e_top = second + a_r  # the host's busiest rank
    if other_top is not None:
        reach = other_top + x_r
        np.maximum(e_most, reach, out=e_most)
        np.maximum(e_top, reach, out=e_top)
    first, end = int(rows[0]), int(rows[-1]) + 1
    span = end - first == len(rows)  # consecutive rows: read and written in place
    sub = new[first:end] if span else new[rows]
    by_host = sub.reshape(len(rows), hosts, lws)  # a view: each host's ranks take its e_most
    np.maximum(by_host, e_most[:, :, None], out=by_host)
    r_idx = np.arange(len(rows))[:, None]
    at_top = np.maximum(own[rows[:, None], top_pos], row_max[rows][:, None])
    sub[r_idx, top_pos] = np.maximum(at_top, e_top, out=at_top)
    if not span:
        new[rows] = sub
