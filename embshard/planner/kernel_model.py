"""Cost model of the two kernels, as pure functions the planner can call (numpy arrays or scalars throughout).

Notation as in embshard/planner/cost.py, per shard and step: n ids, b bags, r rows, c columns (fp32: rb = 4c row
bytes), u distinct rows touched, w = 1 if weighted (id bytes i = 8 + 4w), sb optimizer state bytes per row, a the
Zipf skew of the ids, bw the GPU's memory bandwidth (read + write counted, `Topology.hbm_bw`), L2 its L2 bytes.

Small-table kernel (embshard/kernels/small_tables.py), atomic backward:
  forward   = n*fwd_id_s + [n*i + 8b + 4bc + reads*gather(rb)] / bw
              reads = u + (n - u)(1 - min(1, L2 / (u rb))): lookups of rows that miss L2 (as the TBE model)
  backward  = throughput + update per table, and for the group of tables one launch serves: + max over its
              tables of hot
    throughput = adds*sectors(c)*atomic_sector_s + [n*i + 8b + 4bc + 2u rb] / bw
              sectors(c) = ceil(4c / 32): each add moves a row with vector atomics, sector by sector, in L2; the
              touched rows of the gradient buffer go to memory and back (2u rb)
              adds = (n / m) * distinct(m, r, a): the kernel sorts each bag's chunk of m = min(n/b, chunk(c)) ids
              (chunk 32 for rows up to 32 wide, 16 beyond) and adds once per distinct row of the chunk
              (`dedup=False`, the first version: adds = n)
    hot       = (n / m) * (1 - (1 - top)^m) * same_row_s: the adds into the hottest row, one per bag chunk that
              holds it, land on the same addresses one after another (top = top(r, a): its share of the ids, 1/r
              for uniform ids; `dedup=False`: n * top adds). The launch interleaves the programs of its tables
              (as many as fit 16 MB of L2), so the chains of different tables overlap with each other and with the
              other tables' adds: a group pays at most its longest chain once (`group_backward`)
    update    = [r rb + u (3 rb + 2 sb)] / bw: the update kernel scans the gradient buffer, reads and writes the
              touched rows and their state, and zeroes their gradient
  deterministic backward (sorted) = n*sorted_id_s + [n(i + 8) + n*SORT_BYTES_PER_ID + n(12 + 32 (1 + w))
              + u rb + 4bc] / bw + update: one pass writes int32 row keys and bags, a radix sort of int32 keys
              with int64 positions (4 passes of 24 B), then every sorted id reads its key and position and
              gathers its bag (and weight) by sector; the rows are written once; no chain (sorted_id_s: the
              segmented scan's instructions, about 16 warp-instructions per id for 16-wide rows)
  data-parallel dense gradient (`dense_gradients`, the caller all-reduces and updates): throughput and hot as
              above with dense_sector_s per sector (its own kernel), plus zeroing the buffer, r rb / bw, and no
              update.
  fixed: one kernel_s per width group forward, two backward (atomics, update; sorted: six).

What FBGEMM's TBE costs is the planner's CostModel.work (hbm tier): per id it also pays bwd_id_s and 96 B of
sorting, and bwd_row_s per touched row; the small-table kernel has neither, and pays atomics instead. So it wins
when many ids hit few rows (collisions: n >> u) of tables small enough for their rows and gradient rows to stay
in L2 (`eligible`), and loses on large uniform tables where each id touches a new row (atomics and the full
gradient scan r rb buy nothing). `choose_small_tables` compares the two predictions for a group of tables.

Regroup (embshard/collection/regroup_kernel.py), each way, for B rows: bytes = B e (in_cols_read + out_cols) forward and
B e (out_cols + in_cols) backward (+ B e out_cols per extra duplicate); time = bytes / (bw * regroup_efficiency)
+ kernel_s. FBGEMM's permute_multi_embedding, as the planner has it: max(segments * bag_s, bytes / bw).

`embshard calibrate` should time (embshard/kernels/calibrate.py does): the small-table forward and forward +
backward (rowwise adagrad) on CALIBRATION_CASES (16 and 128 wide, uniform and Zipf 1.2 ids), with the default
backward and with the first version's (no dedup, one table after another: its chains add up, which is what pins
same_row_s down); then `fit` gives fwd_id_s, atomic_sector_s, same_row_s (least squares on relative errors,
constants >= 0), and the sorted mode gives sorted_id_s; and the regroup forward + backward on a 16-wide and a
128-wide layout: regroup_efficiency = (bytes / time) / hbm_bw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embshard.planner.access import gather, zipf_hit_rate

SORT_BYTES_PER_ID = 96
SECTOR = 32


@dataclass(frozen=True)
class KernelConstants:
    """Fitted constants of the two kernels (defaults: first estimates for an H100/H200, to be calibrated)."""

    fwd_id_s: float = 10e-12
    """Forward time per id beyond its bytes (seconds)."""
    atomic_sector_s: float = 7e-12
    """Backward time per 32-byte sector of atomic adds (seconds): L2 atomic throughput."""
    same_row_s: float = 1.4e-9
    """Time per add of one row's serialized atomic adds to the same addresses (seconds; 1 x H200: 1.43 ns, from
    the first version's Zipf 1.05 and 1.2 backward, 100 tables' chains in sequence)."""
    sorted_id_s: float = 40e-12
    """Deterministic backward time per id beyond its bytes (seconds): sort, segmented scan."""
    regroup_efficiency: float = 0.85
    """Share of the copy bandwidth the regroup kernel reaches (0-1)."""
    dense_sector_s: float = 7e-12
    """Data-parallel dense gradient (`dense_gradients`): time per 32-byte sector of an id's atomic adds (seconds;
    its own kernel, timed apart from the model-parallel backward: bench/kernels.py's `dense` lines)."""


def zipf_top_share(rows, alpha):
    """Share of the ids that go to the most popular of `rows` rows under Zipf(alpha) (1/rows when alpha is 0):
    the planner's hit rate of a cache of that one row (access.zipf_hit_rate)."""
    rows = np.asarray(rows, dtype=float)
    a = np.asarray(alpha, dtype=float)
    return np.where(a > 0, zipf_hit_rate(1.0, rows, a), 1.0 / np.maximum(rows, 1.0))


def small_table_forward(n, b, rows, cols, u, weighted, hbm_bw, l2_bytes, k: KernelConstants):
    """Forward seconds of one table's lookups in the small-table kernel."""
    rb = 4.0 * np.asarray(cols, dtype=float)
    idb = 8.0 + 4.0 * np.asarray(weighted, dtype=float)
    fit = np.clip(l2_bytes / np.maximum(np.asarray(u, dtype=float) * rb, 1.0), 0.0, 1.0)
    reads = u + (n - u) * (1.0 - fit)
    return n * k.fwd_id_s + (n * idb + 8.0 * b + b * rb + reads * gather(rb, SECTOR)) / hbm_bw


def dedup_chunk(cols):
    """Ids of a bag the atomic backward sorts at once (`_grad_triton.backward_tiles`): 32 for rows up to 32
    wide, 16 beyond."""
    return np.where(np.asarray(cols, dtype=float) <= 32, 32.0, 16.0)


def atomic_adds(n, b, rows, cols, alpha, dedup: bool = True):
    """(atomic adds, adds into the hottest row) of one table's atomic backward: with `dedup`, one add per distinct
    row of each bag chunk of m = min(n / b, chunk) ids (expected distinct rows of m Zipf(alpha) draws, as the
    planner's access model); without, one per id."""
    n = np.asarray(n, dtype=float)
    top = zipf_top_share(rows, alpha)
    if not dedup:
        return n, n * top
    from embshard.planner.access import distinct_rows  # numpy only; imported here: the planner imports this module

    m = np.clip(np.minimum(n / np.maximum(np.asarray(b, dtype=float), 1.0), dedup_chunk(cols)), 1.0, None)
    chunks = n / m
    hot = chunks * -np.expm1(m * np.log1p(-np.minimum(top, 1.0 - 1e-12)))
    return chunks * np.minimum(distinct_rows(m, rows, alpha), m), np.minimum(hot, n * top)


def small_table_backward(
    n,
    b,
    rows,
    cols,
    u,
    weighted,
    state_bytes,
    alpha,
    hbm_bw,
    k: KernelConstants,
    mode: str = "atomic",
    dedup: bool = True,
):
    """(seconds, hot chain seconds) of one table's backward in the small-table kernel, fused update included.
    `mode`: "atomic" (default), "sorted" (deterministic: no chain) or "dense" (data-parallel: the dense gradient
    only, no update); `dedup=False`: the atomic backward without the per-bag sums (`Tiles.dedup`). A group's
    backward is `group_backward` of its tables' pairs."""
    rows = np.asarray(rows, dtype=float)
    rb = 4.0 * np.asarray(cols, dtype=float)
    w = np.asarray(weighted, dtype=float)
    idb = 8.0 + 4.0 * w
    update = (rows * rb + u * (3.0 * rb + 2.0 * np.asarray(state_bytes, dtype=float))) / hbm_bw
    if mode == "sorted":
        per_id = idb + 8.0 + SORT_BYTES_PER_ID + 12.0 + SECTOR * (1.0 + w)
        seconds = n * k.sorted_id_s + (n * per_id + u * rb + b * rb) / hbm_bw + update
        return seconds, np.zeros_like(seconds)
    sectors = np.ceil(rb / SECTOR)
    adds, hot_adds = atomic_adds(n, b, rows, np.asarray(cols, dtype=float), alpha, dedup)
    per_sector = k.dense_sector_s if mode == "dense" else k.atomic_sector_s
    throughput = adds * sectors * per_sector + (n * idb + 8.0 * b + b * rb + 2.0 * u * rb) / hbm_bw
    hot = hot_adds * k.same_row_s
    if mode == "dense":
        return throughput + rows * rb / hbm_bw, hot
    if mode != "atomic":
        raise ValueError(f"small_table_backward: mode={mode!r} is unknown: atomic, sorted or dense")
    return throughput + update, hot


def group_backward(seconds, hot) -> float:
    """Backward seconds of the tables one launch serves: the sum of their times plus the longest hot chain (the
    launch interleaves its tables: their chains overlap; counting the longest once is an upper bound)."""
    seconds, hot = np.atleast_1d(seconds), np.atleast_1d(hot)
    return float(seconds.sum() + (hot.max() if hot.size else 0.0))


def eligible(rows, cols, elem_bytes, tier_is_hbm, l2_bytes, max_l2_share: float = 0.5):
    """Tables the small-table kernel can take (fp32 weights in GPU memory) and that suit it: the table and its
    gradient buffer (2 r rb) within `max_l2_share` of the L2, so repeated rows and their atomics stay in L2."""
    rows = np.asarray(rows, dtype=float)
    table = rows * 4.0 * np.asarray(cols, dtype=float)
    return (np.asarray(elem_bytes) == 4) & np.asarray(tier_is_hbm, dtype=bool) & (2 * table <= max_l2_share * l2_bytes)


MARGIN = 0.9
"""The small-table kernel is chosen only where it is predicted below this share of FBGEMM's time."""


def faster_alone(fbgemm_s, small_s, ok, margin: float = MARGIN):
    """Tables where the small-table kernel may run (`ok`, from `eligible`) and its own forward + backward
    (`small_s`, without the hot chain) is below `margin` times FBGEMM's (`fbgemm_s`): the first step of
    `choose_small_tables`, which the planner takes per table before it knows the groups."""
    return np.asarray(ok, dtype=bool) & (np.asarray(small_s, dtype=float) < margin * np.asarray(fbgemm_s, dtype=float))


def choose_small_tables(fbgemm_s, small_s, hot_s, ok, margin: float = MARGIN):
    """Which tables of one group (the tables a rank's lookup of one sharding scheme holds) the small-table kernel
    takes: first each table where it may (`ok`, from `eligible`) and its own forward + backward (`small_s`, without
    the hot chain) is below `margin` times FBGEMM's (`fbgemm_s`, forward + backward); then all of those together
    only if their sum plus the longest hot chain (the chains run side by side in one launch) is still below
    `margin` times what FBGEMM takes for them. The margin keeps near-ties on the well-tested path."""
    fbgemm_s, small_s, hot_s = (
        np.broadcast_to(np.asarray(x, dtype=float), np.shape(small_s)) for x in (fbgemm_s, small_s, hot_s)
    )
    pick = faster_alone(fbgemm_s, small_s, np.broadcast_to(ok, np.shape(small_s)), margin).copy()
    if pick.any() and small_s[pick].sum() + hot_s[pick].max() >= margin * fbgemm_s[pick].sum():
        pick[:] = False
    return pick


def regroup_bytes(batch: int, elem_bytes: int, in_cols: int, used_in_cols: int, out_cols: int, extra_reads: int = 0):
    """(forward, backward) bytes of the regroup kernel: forward reads the used input columns and writes the
    outputs; backward reads the output gradients (`extra_reads` more columns where a column is read again by a
    K-slot sum) and writes every input column (zeros for unused ones)."""
    fwd = batch * elem_bytes * (used_in_cols + out_cols)
    bwd = batch * elem_bytes * (out_cols + in_cols + extra_reads)
    return float(fwd), float(bwd)


def regroup_seconds(nbytes, hbm_bw: float, kernel_s: float, k: KernelConstants):
    """Seconds of one regroup launch moving `nbytes`."""
    return np.asarray(nbytes, dtype=float) / (hbm_bw * k.regroup_efficiency) + kernel_s


# ---- calibration fit --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationCase:
    """One calibration shape: `tables` tables of rows x dim, batch bags of `ids_per_bag` ids, uniform (alpha 0) or
    Zipf(`alpha`); the small-table kernel's fit here and the TBE fit of `embshard calibrate` both time these."""

    name: str
    tables: int
    rows: int
    dim: int
    ids_per_bag: int
    batch: int
    alpha: float = 0.0

    @property
    def ids(self) -> int:
        """Ids per call."""
        return self.tables * self.batch * self.ids_per_bag


CALIBRATION_CASES = (
    CalibrationCase("16-wide 10k rows, uniform", 100, 10_000, 16, 30, 8192, 0.0),
    CalibrationCase("16-wide 10k rows, Zipf 1.2", 100, 10_000, 16, 30, 8192, 1.2),
    CalibrationCase("128-wide 20k rows, uniform", 16, 20_000, 128, 10, 8192, 0.0),
    CalibrationCase("128-wide 20k rows, Zipf 1.2", 16, 20_000, 128, 10, 8192, 1.2),
)


def nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares a x = b with x >= 0 (drops a column whose coefficient comes out negative and refits)."""
    keep = list(range(a.shape[1]))
    while keep:
        x, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if np.all(x >= 0):
            out = np.zeros(a.shape[1])
            out[keep] = x
            return out
        keep.pop(int(np.argmin(x)))
    return np.zeros(a.shape[1])


def fit(
    cases: Sequence[CalibrationCase],
    distinct: Sequence[float],
    measured: Sequence[tuple[float, float]],
    hbm_bw: float,
    l2_bytes: float,
    sorted_bwd: Sequence[float] | None = None,
    chained_bwd: Sequence[float] | None = None,
) -> KernelConstants:
    """Constants that explain the measured (forward, backward) seconds of the cases (rowwise adagrad, 4 bytes of
    state a row) on top of the modelled bytes; `distinct[i]`: distinct rows the case's ids touch (all tables).
    `measured` backward: the default kernel (its tables' chains overlap: the longest counts once);
    `chained_bwd`: the first version's backward (one add per id, one table after another: every table's chain
    in turn); `sorted_bwd`: the deterministic backward. Least squares on relative errors, constants >= 0."""
    zero = KernelConstants(0.0, 0.0, 0.0, 0.0)
    rows_f, rhs_f, rows_b, rhs_b, rows_s, rhs_s = [], [], [], [], [], []
    for j, (c, u, (fwd, bwd)) in enumerate(zip(cases, distinct, measured)):
        T = c.tables
        n, b, ut = float(c.batch * c.ids_per_bag), float(c.batch), float(u) / T  # per table
        f0 = T * float(small_table_forward(n, b, c.rows, c.dim, ut, 0, hbm_bw, l2_bytes, zero))
        rows_f.append([T * n / fwd])
        rhs_f.append((fwd - f0) / fwd)
        b0 = T * float(small_table_backward(n, b, c.rows, c.dim, ut, 0, 4, 0.0, hbm_bw, zero)[0])
        sectors = np.ceil(4.0 * c.dim / SECTOR)
        adds, hot = (float(x) for x in atomic_adds(n, b, c.rows, c.dim, c.alpha))
        rows_b.append([T * adds * sectors / bwd, hot / bwd])
        rhs_b.append((bwd - b0) / bwd)
        if chained_bwd is not None:
            v1 = chained_bwd[j]
            rows_b.append([T * n * sectors / v1, T * n * float(zipf_top_share(c.rows, c.alpha)) / v1])
            rhs_b.append((v1 - b0) / v1)
        if sorted_bwd is not None:
            s0 = T * float(small_table_backward(n, b, c.rows, c.dim, ut, 0, 4, 0.0, hbm_bw, zero, "sorted")[0])
            rows_s.append([T * n / sorted_bwd[j]])
            rhs_s.append((sorted_bwd[j] - s0) / sorted_bwd[j])
    (fwd_id,) = nonneg_lstsq(np.array(rows_f), np.array(rhs_f))
    atomic, same = nonneg_lstsq(np.array(rows_b), np.array(rhs_b))
    sorted_id = nonneg_lstsq(np.array(rows_s), np.array(rhs_s))[0] if rows_s else KernelConstants().sorted_id_s
    return KernelConstants(float(fwd_id), float(atomic), float(same), float(sorted_id))
