"""Per-rank load matrices and the step time they predict.

A load matrix has one column per rank and one row per (phase, resource). A phase is a stretch of the step that
ends at a synchronisation point (an all-to-all or all-reduce waits for every rank), so a phase lasts as long as
its slowest rank's busiest resource, and the step lasts the sum of its phases:

    step_time = sum over phases p of  max over ranks r, rows k in p of  L[k, r]

Comm rows are split by direction (send / receive: links are full duplex) and by link (intra-host / inter-host:
they run side by side), so a row holds one resource's busy time. A rank's own time (reported per rank) is the sum
over phases of its own column's maximum.
"""

from __future__ import annotations

import numpy as np

# Rows of a load matrix.
IN_SEND_I, IN_SEND_X, IN_RECV_I, IN_RECV_X = 0, 1, 2, 3  # ids all-to-all (forward)
FWD = 4  # forward lookup kernels
OUT_RS_SEND, OUT_RS_RECV = 5, 6  # hierarchical table-row-wise: the partial sums' reduce-scatter inside the host
OUT_SEND_I, OUT_SEND_X, OUT_RECV_I, OUT_RECV_X = 7, 8, 9, 10  # pooled embeddings all-to-all (forward)
GRAD_SEND_I, GRAD_SEND_X, GRAD_RECV_I, GRAD_RECV_X = 11, 12, 13, 14  # their gradients all-to-all (backward)
GRAD_AG_SEND, GRAD_AG_RECV = 15, 16  # hierarchical table-row-wise: the gradients back to the blocks in the host
BWD = 17  # backward lookup kernels with the fused optimizer update
ALLREDUCE = 18  # data-parallel gradient all-reduce
DP_UPDATE = 19  # data-parallel optimizer update
NROWS = 20

PHASES = (
    "input all-to-all",
    "forward lookup",
    "output intra-host reduce",
    "output all-to-all",
    "gradient all-to-all",
    "gradient intra-host gather",
    "backward + update",
    "data-parallel all-reduce",
    "data-parallel update",
)
PHASE_START = np.array([IN_SEND_I, FWD, OUT_RS_SEND, OUT_SEND_I, GRAD_SEND_I, GRAD_AG_SEND, BWD, ALLREDUCE, DP_UPDATE])
PHASE_ROWS = [list(range(a, b)) for a, b in zip(PHASE_START, [*PHASE_START[1:], NROWS])]
INPUT, LOOKUP, OUT_REDUCE, OUTPUT, GRADIENT, GRAD_GATHER, BACKWARD, DP_ALLREDUCE, DP_STEP = range(len(PHASES))
"""Indices of the phases in PHASES / PHASE_ROWS."""


def phase_times(loads: np.ndarray) -> np.ndarray:
    """[phases, ranks]: each rank's busiest resource in each phase."""
    return np.maximum.reduceat(loads, PHASE_START, axis=0)


def step_time(loads: np.ndarray) -> float:
    """Predicted step time (seconds) of a load matrix [NROWS, ranks]."""
    return float(np.maximum.reduceat(loads.max(axis=1), PHASE_START).sum())


PHASE_SLICES = [slice(int(a), int(b)) for a, b in zip(PHASE_START, [*PHASE_START[1:], NROWS])]
"""The rows of each phase as slices (PHASE_ROWS' rows, read without a copy)."""
PHASE_OF_ROW = np.repeat(np.arange(len(PHASES)), np.diff([*PHASE_START, NROWS]))
"""[NROWS]: the phase of each row."""


NARROW = 32
"""Widths up to which phase_max_sum reduces all phases in one reduceat (fastest there)."""
GATHERED = 1024
"""Widths up to which phase_max_sum reduces the phases' rows gathered four per phase (fastest there; the loop over
the phases is faster beyond)."""
PHASE_FOUR = np.array([(rows + rows[-1:] * 4)[:4] for rows in PHASE_ROWS]).T.copy()
"""[4, phases]: four rows of each phase (its last row repeated where it has fewer: the maximum is the same)."""


def phase_max_sum(loads: np.ndarray, per_phase: np.ndarray | None = None) -> np.ndarray:
    """[n]: for each column of loads [NROWS, n], the sum over phases of its busiest row in the phase: the same
    numbers as `phase_times(loads).sum(axis=0)` (phases added in order), without reduceat along the rows, which
    is slow for wide matrices. `per_phase` [phases]: added to each phase's maximum before the sum: the same
    numbers as adding it to every row of the phase first (adding one value keeps the order of a phase's rows).
    For two or more columns every width's way gives the same numbers (exact maxima, the phases added one after
    another), so some columns of a matrix get the very numbers the whole matrix would."""
    n = loads.shape[1]
    if 2 <= n <= GATHERED:
        m = phase_maxima(loads)
        if per_phase is not None:
            m += per_phase[:, None]
        # the sum over the phases adds their rows one after another (as below) for two or more columns; a single
        # column would be summed pairwise, in another order
        return m.sum(axis=0)
    out = None
    for p, sl in enumerate(PHASE_SLICES):
        block = loads[sl]
        m = block[0] if len(block) == 1 else np.maximum.reduce(block, axis=0)
        if per_phase is not None and per_phase[p]:
            m = m + per_phase[p]
        out = m.copy() if out is None else np.add(out, m, out=out)
    return out


def phase_maxima(loads: np.ndarray) -> np.ndarray:
    """[phases, n]: each column's busiest row in each phase (`phase_times`' numbers, read the fastest way for the
    width: one reduceat up to NARROW columns, the phases' rows gathered four per phase beyond)."""
    if loads.shape[1] <= NARROW:  # one reduceat
        return np.ascontiguousarray(np.maximum.reduceat(loads, PHASE_START, axis=0))
    four = np.take(loads, PHASE_FOUR, axis=0)  # [4, phases, n]: each phase's maximum in three element-wise calls
    m = np.maximum(four[0], four[1])
    np.maximum(m, four[2], out=m)
    return np.maximum(m, four[3], out=m)


def column_sum(per_phase: list[float]) -> float:
    """The phases' values of one column added one after another, as `phase_max_sum` adds them (numpy's sum of a
    single run of values adds pairwise, in another order)."""
    total = per_phase[0]
    for v in per_phase[1:]:
        total += v
    return total


def per_phase(row_values: np.ndarray) -> np.ndarray | None:
    """[phases]: `row_values` [NROWS] as one value per phase, or None when some phase's rows differ."""
    first = row_values[PHASE_START]
    return first if np.array_equal(row_values, first[PHASE_OF_ROW]) else None


def spread(
    ranks: np.ndarray,
    owner: np.ndarray,
    peer_same: np.ndarray,
    peer_other: np.ndarray,
    world_size: int,
    local_world_size: int,
) -> np.ndarray:
    """Loads [NROWS, world_size] of shards on `ranks` (k of them): shard i puts `owner[i]` on its rank,
    `peer_same[i]` on every other rank of its host and `peer_other[i]` on every rank of the other hosts."""
    hosts = np.asarray(ranks) // local_world_size
    n_hosts = world_size // local_world_size
    same_by_host = np.zeros((n_hosts, NROWS))
    other_by_host = np.zeros((n_hosts, NROWS))
    np.add.at(same_by_host, hosts, peer_same)
    np.add.at(other_by_host, hosts, peer_other)
    rank_host = np.arange(world_size) // local_world_size
    per_rank = same_by_host[rank_host] + other_by_host.sum(axis=0) - other_by_host[rank_host]  # [W, NROWS]
    np.add.at(per_rank, ranks, owner - peer_same)
    return per_rank.T.copy()
