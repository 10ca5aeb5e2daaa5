"""The kernels' cost model (embshard/planner/kernel_model.py): byte counts by hand, the Zipf top share against the exact
discrete sum, the calibration fit recovering known constants, and which tables the choice gives the kernel."""

from __future__ import annotations

import numpy as np
import pytest

from embshard.planner.kernel_model import (
    CALIBRATION_CASES,
    KernelConstants,
    atomic_adds,
    choose_small_tables,
    eligible,
    fit,
    group_backward,
    regroup_bytes,
    regroup_seconds,
    small_table_backward,
    small_table_forward,
    zipf_top_share,
)

ZERO = KernelConstants(0.0, 0.0, 0.0, 0.0)
BW, L2 = 4.0e12, 50 << 20


@pytest.mark.parametrize("rows,alpha", [(10_000, 1.2), (10_000, 1.05), (1000, 0.8), (50_000, 1.0)])
def test_zipf_top_share_close_to_the_discrete_sum(rows, alpha):
    exact = 1.0 / np.sum(np.arange(1, rows + 1, dtype=float) ** -alpha)
    assert zipf_top_share(rows, alpha) == pytest.approx(exact, rel=0.25)
    assert zipf_top_share(rows, 0.0) == pytest.approx(1.0 / rows)
    assert zipf_top_share(rows, alpha + 0.2) > zipf_top_share(rows, alpha)


def test_forward_bytes_by_hand():
    # 8192 bags x 30 ids of a 10k x 16 table (fits L2): ids, offsets, pooled rows out, each distinct row read once.
    n, b, u = 8192 * 30, 8192, 9000
    want = (n * 8 + 8 * b + b * 64 + u * 64) / BW
    assert small_table_forward(n, b, 10_000, 16, u, 0, BW, L2, ZERO) == pytest.approx(want)
    # weighted ids carry 4 bytes more; a table whose rows overflow L2 re-reads rows from memory
    assert small_table_forward(n, b, 10_000, 16, u, 1, BW, L2, ZERO) == pytest.approx(want + n * 4 / BW)
    big_u = 2 * L2 // 64  # distinct rows twice the L2: half the repeated lookups miss it
    reads = big_u + (4 * big_u - big_u) * 0.5
    got = small_table_forward(4 * big_u, b, 10**7, 16, big_u, 0, BW, L2, ZERO)
    assert got == pytest.approx((4 * big_u * 8 + 8 * b + b * 64 + reads * 64) / BW)
    k = KernelConstants(fwd_id_s=1e-11)
    assert small_table_forward(n, b, 10_000, 16, u, 0, BW, L2, k) == pytest.approx(want + n * 1e-11)


def test_backward_parts():
    n, b, r, u = 8192 * 30, 8192, 10_000, 9000
    k = KernelConstants(atomic_sector_s=7e-12, same_row_s=1e-9, sorted_id_s=4e-11)
    atomic, hot = small_table_backward(n, b, r, 16, u, 0, 4, 1.2, BW, k)
    dense, hot_dense = small_table_backward(n, b, r, 16, u, 0, 4, 1.2, BW, k, mode="dense")
    srt, no_chain = small_table_backward(n, b, r, 16, u, 0, 4, 1.2, BW, k, mode="sorted")
    v1, hot_v1 = small_table_backward(n, b, r, 16, u, 0, 4, 1.2, BW, k, dedup=False)
    update = (r * 64 + u * (3 * 64 + 8)) / BW
    assert atomic - update == pytest.approx(dense - r * 64 / BW)
    adds, hot_adds = atomic_adds(n, b, r, 16, 1.2)
    assert hot == hot_dense == pytest.approx(hot_adds * 1e-9) and no_chain == 0
    assert atomic == pytest.approx(adds * 2 * 7e-12 + (n * 8 + 8 * b + b * 64 + 2 * u * 64) / BW + update)
    assert v1 == pytest.approx(n * 2 * 7e-12 + (n * 8 + 8 * b + b * 64 + 2 * u * 64) / BW + update)
    assert hot_v1 == pytest.approx(n * zipf_top_share(r, 1.2) * 1e-9)
    per_id = 8 + 8 + 96 + 12 + 32  # ids, keys and bags written, the sort, sorted keys and positions, bag sectors
    assert srt == pytest.approx(n * 4e-11 + (n * per_id + u * 64 + b * 64) / BW + update)
    assert group_backward([1.0, 2.0], [0.5, 0.25]) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="mode='fast'"):
        small_table_backward(n, b, r, 16, u, 0, 4, 1.2, BW, k, mode="fast")


def test_atomic_adds_by_hand():
    # 30 ids a bag in one chunk: adds = bags x distinct rows among 30 draws; the hottest row once per bag holding it
    n, b, r = 8192 * 30, 8192, 10_000
    p = np.arange(1, r + 1, dtype=float) ** -1.2
    p /= p.sum()
    distinct30 = np.sum(1 - (1 - p) ** 30)  # exact expectation over the rows
    adds, hot = atomic_adds(n, b, r, 16, 1.2)
    assert adds == pytest.approx(b * distinct30, rel=0.05) and adds < 0.75 * n  # Zipf 1.2: ~35% fewer adds
    assert hot == pytest.approx(b * (1 - (1 - zipf_top_share(r, 1.2)) ** 30), rel=1e-9)
    assert hot < 1.01 * b < n * zipf_top_share(r, 1.2) / 6  # the hot chain: once a bag instead of ~6 times
    # uniform ids: nothing to sum (adds ~ n), the chain as before (n / r)
    adds_u, hot_u = atomic_adds(n, b, r, 16, 0.0)
    assert adds_u == pytest.approx(n, rel=2e-3) and hot_u == pytest.approx(n / r, rel=2e-3)
    # bags longer than a chunk: chunks of 32 (16 for rows wider than 32 columns); without dedup: one add per id
    _, hot_long = atomic_adds(8192 * 100, 8192, r, 16, 1.2)
    _, hot_wide = atomic_adds(8192 * 100, 8192, r, 64, 1.2)
    assert hot_long == pytest.approx(8192 * 100 / 32 * (1 - (1 - zipf_top_share(r, 1.2)) ** 32))
    assert hot_wide == pytest.approx(8192 * 100 / 16 * (1 - (1 - zipf_top_share(r, 1.2)) ** 16))
    assert atomic_adds(n, b, r, 16, 1.2, dedup=False) == (n, pytest.approx(n * zipf_top_share(r, 1.2)))


def test_fit_recovers_the_constants_that_made_the_times():
    true = KernelConstants(fwd_id_s=12e-12, atomic_sector_s=6e-12, same_row_s=2e-9, sorted_id_s=50e-12)
    distinct, measured, sorted_bwd, chained = [], [], [], []
    for c in CALIBRATION_CASES:
        n, b = c.batch * c.ids_per_bag, c.batch
        u = c.rows * (1 - np.exp(-n / c.rows)) * (0.6 if c.alpha else 1.0)
        fwd = c.tables * small_table_forward(n, b, c.rows, c.dim, u, 0, BW, L2, true)
        s, hot = small_table_backward(n, b, c.rows, c.dim, u, 0, 4, c.alpha, BW, true)
        v1, hot_v1 = small_table_backward(n, b, c.rows, c.dim, u, 0, 4, c.alpha, BW, true, dedup=False)
        srt, _ = small_table_backward(n, b, c.rows, c.dim, u, 0, 4, c.alpha, BW, true, mode="sorted")
        distinct.append(u * c.tables)
        measured.append((float(fwd), c.tables * float(s) + float(hot)))  # the longest chain once
        chained.append(c.tables * float(v1 + hot_v1))  # the first version: every table's chain in turn
        sorted_bwd.append(c.tables * float(srt))
    for extra in ({}, {"chained_bwd": chained}):
        got = fit(CALIBRATION_CASES, distinct, measured, BW, L2, sorted_bwd, **extra)
        for name in ("fwd_id_s", "atomic_sector_s", "same_row_s", "sorted_id_s"):
            assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), (name, extra.keys())


def test_choice_gives_the_kernel_small_collision_heavy_tables_only():
    k = KernelConstants()
    rows = np.array([10_000, 10_000, 1_000_000])
    cols = np.array([16, 16, 128])
    ok = eligible(rows, cols, np.array([4, 2, 4]), np.array([True, True, True]), L2)
    assert ok.tolist() == [True, False, False]  # fp16 weights and a 512 MB table are not for it
    n, b = 8192 * 30, 8192
    u = np.array([5000, 5000, 240_000])
    fwd = small_table_forward(n, b, rows, cols, u, 0, BW, L2, k)
    bwd, hot = small_table_backward(n, b, rows, cols, u, 0, 4, 1.2, BW, k)
    fbgemm = np.full(3, 2.49e-3 / 100)  # measured: 100 such 10k x 16 tables (Zipf 1.2) in 2.49 ms on a GPU
    # a group of 100 hot small tables, one fp16 table and one large table: the kernel takes the 100
    idx = np.array([0] * 100 + [1, 2])
    pick = choose_small_tables(fbgemm[idx], (fwd + bwd)[idx], hot[idx], ok[idx])
    assert pick.tolist() == [True] * 100 + [False, False]
    assert not choose_small_tables(fbgemm[idx] / 100, (fwd + bwd)[idx], hot[idx], ok[idx]).any()  # FBGEMM faster
    # one such table alone: its hottest row's chain of atomics (once per bag) is shorter than FBGEMM's whole step
    # for it, and the kernel takes it; the first version's chain (once per id, ~51,000 adds) was longer
    assert hot[0] < 0.5 * fbgemm[0] and choose_small_tables(fbgemm[:1], (fwd + bwd)[:1], hot[:1], ok[:1]).all()
    bwd_v1, hot_v1 = small_table_backward(n, b, rows, cols, u, 0, 4, 1.2, BW, k, dedup=False)
    assert hot_v1[0] > fbgemm[0] and not choose_small_tables(fbgemm[:1], (fwd + bwd_v1)[:1], hot_v1[:1], ok[:1])


def test_regroup_bytes_and_time():
    fwd, bwd = regroup_bytes(16384, 4, in_cols=1600, used_in_cols=1440, out_cols=1920, extra_reads=480)
    assert fwd == 16384 * 4 * (1440 + 1920) and bwd == 16384 * 4 * (1920 + 1600 + 480)
    k = KernelConstants(regroup_efficiency=0.8)
    assert regroup_seconds(fwd, BW, 5e-6, k) == pytest.approx(fwd / (0.8 * BW) + 5e-6)


@pytest.mark.usefixtures("torch_kernels_on_cpu")
def test_calibration_measurements_run():
    # The timing helpers of embshard calibrate, on tiny shapes on the CPU (torch paths): they return sane numbers.
    from embshard.kernels.calibrate import measure_regroup, measure_small_table
    from embshard.planner.kernel_model import CalibrationCase

    case = CalibrationCase("tiny", 3, 50, 8, 4, 16, 1.2)
    fwd, bwd, srt, distinct, v1 = measure_small_table(case, iters=1, device="cpu")
    assert fwd > 0 and bwd >= 0 and srt >= 0 and v1 >= 0 and 3 <= distinct <= 150
    seconds, nbytes = measure_regroup(6, 16, 8, iters=1, device="cpu")
    # 6 keys: 5 used (forward reads 5 x 16 columns), outputs 5 + 1 duplicate keys; backward writes all 6
    assert seconds > 0 and nbytes == 8 * 4 * ((5 * 16 + 6 * 16) + (6 * 16 + 6 * 16))
