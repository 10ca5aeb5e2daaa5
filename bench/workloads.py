"""The embedding-step workloads of the benchmarks (the same as bench/baselines/torchrec_dmp.py's, plus overflow and
mlperf): per workload, (rows, dim, mean ids per bag) per table and the batch per rank. bench/embshard_dmp.py,
bench/floors.py, bench/planner_predict.py, bench/torchrec_mc.py, bench/torchrec_more.py and
bench/torchrec_embshard_plan.py read them from here."""

from __future__ import annotations

WORKLOADS = {
    "uniform26": ([(1_000_000, 128, 10)] * 26, 8192),
    "hetero124": ([(100_000_000, 128, 1)] * 4 + [(5_000_000, 64, 5)] * 20 + [(10_000, 16, 30)] * 100, 8192),
    "overflow": ([(20_000_000, 128, 2)] * 6 + [(1_000_000, 64, 20)] * 10, 8192),
    "tiny": ([(1000, 16, 3)] * 4, 64),
    # the MLPerf DLRM-DCNv2 model's 26 tables (configs/dlrm_dcnv2_mlperf.yaml: rows, 128 wide, its multi-hot sizes as
    # mean ids per bag; tests/test_bench.py checks they match), batch 8192: the end-to-end model's embedding part
    "mlperf": (
        [
            (rows, 128, ids)
            for rows, ids in [
                (40_000_000, 3),
                (39_060, 2),
                (17_295, 1),
                (7_424, 2),
                (20_265, 6),
                (3, 1),
                (7_122, 1),
                (1_543, 1),
                (63, 1),
                (40_000_000, 7),
                (3_067_956, 3),
                (405_282, 8),
                (10, 1),
                (2_209, 6),
                (11_938, 9),
                (155, 5),
                (4, 1),
                (976, 1),
                (14, 1),
                (40_000_000, 12),
                (40_000_000, 100),
                (40_000_000, 27),
                (590_152, 10),
                (12_973, 3),
                (108, 1),
                (36, 1),
            ]
        ],
        8192,
    ),
}


def workload_spec(name: str, rows_scale: float = 1.0) -> list[tuple[int, int, int]]:
    """The workload's (rows, dim, mean ids per bag) per table, rows scaled by `rows_scale` (at least 1)."""
    return [(max(1, int(r * rows_scale)), d, m) for r, d, m in WORKLOADS[name][0]]


def workload_tables(name: str, rows_scale: float = 1.0) -> list:
    """The workload's tables (t0, t1, ...; one feature each, f0, f1, ...)."""
    from embshard.spec.tables import TableConfig

    spec = workload_spec(name, rows_scale)
    return [TableConfig(f"t{i}", r, d, (f"f{i}",), ids_per_bag=m) for i, (r, d, m) in enumerate(spec)]
