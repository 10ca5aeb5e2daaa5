"""The sequence benchmark (bench/embshard_ec.py, the twin of bench/baselines/torchrec_ec.py) runs its tiny workload
at world 1 and 2, dedup off and on, uniform and Zipf ids, and prints the RESULT line the seq suite reads (with a
floor per rank); the seq suite interleaves both frameworks and its summary compares each one's best."""

from __future__ import annotations

import argparse

from bench import floors, report
from bench.embshard_ec import parse
from bench.embshard_ec import run as run_bench
from bench.suites import SUITES, Machine

RUNS = [["--dedup"], ["--ids", "zipf"]]


def bench_worker(rank, world, device):
    return [run_bench(parse(["--workload", "tiny", "--steps", "2", "--warmup", "1", *extra]), device) for extra in RUNS]


def test_tiny_workload_at_world_1_and_2(run):
    for world in (1, 2):
        ranks = run(bench_worker, world)
        assert all(r is None for rank in ranks[1:] for r in rank), "only rank 0 returns a RESULT line"
        for extra, line in zip(RUNS, ranks[0]):
            r = report.parse_line(line)
            assert r["framework"] == "embshard" and r["module"] == "ec" and r["world"] == str(world), line
            assert r["dedup"] == str(int("--dedup" in extra)) and r["ids"] == (
                "zipf" if "--ids" in extra else "uniform"
            )
            floor_gb = min(map(float, r["floor_hbm_gb"].split(",")))  # one per rank; floor_ms rounds to 0 on a GPU
            assert float(r["ms_per_step"]) > 0 and float(r["ids_per_s"]) > 0 and floor_gb > 0, line
            for part in ("hbm", "link"):
                assert len(r[f"floor_{part}_gb"].split(",")) == world, line
            if world == 1:
                assert all(float(x) == 0 for x in r["floor_link_gb"].split(",")), "one rank exchanges nothing"


def test_sequence_floor_counts_rows_per_id_and_dedup():
    from types import SimpleNamespace as NS

    t = NS(name="t", num_embeddings=1000, embedding_dim=16, feature_names=("f",), ids_per_bag=50.0,
           data_type=NS(bytes=4))  # fmt: skip
    shard = NS(table="t", sharding_type="table_wise", tier="hbm", shards=[NS(rank=0, num_rows=1000, num_cols=16)])
    plan = NS(world_size=2, tables=[shard])
    plain, dedup = (floors.sequence_bytes([t], plan, 32, dedup=d) for d in (False, True))
    ids = 32 * 50  # per rank
    assert plain["link"][1] == 2 * ids * 16 * 4 + ids * 8  # rows there and gradients back, ids in
    assert dedup["link"][1] < plain["link"][1] * 0.75 and dedup["hbm"][0] < plain["hbm"][0]


def test_seq_suite_interleaves_both_frameworks_and_compares_their_best():
    args = argparse.Namespace(nproc=1, pairs=2, cpu=False, steps=0, warmup=0, out="/tmp/x")
    steps = SUITES["seq"].steps(args, Machine(gpus=1, gpu="H100", gpu_mib=81559, cpus=16))
    labels = [s.label for s in steps]
    assert len(steps) == 16 and labels[0].startswith("TorchRec seq4 uniform") and labels[1].startswith("embshard")
    assert sum("--dedup" in s.argv for s in steps) == 8 and all("--nproc-per-node=1" in s.argv for s in steps)
    cpu = SUITES["seq"].steps(argparse.Namespace(**{**vars(args), "cpu": True, "pairs": 1}), Machine())
    assert not [s.label for s in cpu if s.label.startswith("TorchRec") and "--dedup" in s.argv]  # no CPU kernel
    assert all("tiny" in s.argv for s in cpu) and sum(s.label.startswith("embshard") for s in cpu) == 4
    log = "\n".join(
        f"RESULT framework={fw} module=ec workload=seq4 world=1 ids=uniform dedup={d} ms_per_step={ms}"
        + (" floor_ms=1.5" if fw == "embshard" else "")
        for fw, d, ms in [("torchrec", 0, 12.0), ("torchrec", 1, 9.0), ("embshard", 0, 6.0), ("embshard", 1, 4.5)]
    )
    ((case, text),) = SUITES["seq"].summary(log, args)
    assert case == "seq4 world 1 uniform ids" and "best/best 2.00x (embshard faster)" in text and "floor 1.50" in text
