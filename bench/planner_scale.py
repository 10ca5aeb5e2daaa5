"""Planner speed at scale: embshard plans 1,000 mixed tables for 64 GPUs (8 hosts x 8 H100) on one CPU core, and
TorchRec's EmbeddingShardingPlanner plans the same (or, when it runs past --torchrec-timeout, a smaller case that
both plan: 100 tables on 8 GPUs).

    python -m bench.planner_scale [--tables 1000] [--world-size 64] [--repeats 3] [--torchrec-timeout 120]
    python -m bench.planner_scale --tables 10000 --world-size 512 --skip-torchrec
    python -m bench.planner_scale --tables 10000 --world-size 512 --skip-torchrec --group-sizes   # with 2D's search

Models beyond 1,000 tables per 64 GPUs are generated to fit (mixed_tables: rows scaled with the world size;
batch_size: fewer samples per GPU with more features). Prints `seconds=<embshard planning time>` first (the
fastest of --repeats plans: the machine may be shared), then one line per planner and case with the CPU time
the planning process used (fastest repeat: on a busy machine the wall time also counts other processes), the
predicted step time, the planner's peak memory (tracemalloc: Python and numpy allocations of one more plan)
and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import time

BATCH = 4096


REFERENCE_TABLES, REFERENCE_WORLD = 1000, 64  # the reference case: 1,000 tables on 64 GPUs, batch BATCH


def row_scale(n: int, world_size: int) -> float:
    """Factor on the rows of the huge and large tables so that a model of n tables on world_size GPUs needs about
    as much memory per GPU as the reference case (never above 1: fewer tables per GPU keep their sizes)."""
    return min(1.0, (world_size / REFERENCE_WORLD) / (n / REFERENCE_TABLES))


def batch_size(n: int) -> int:
    """Samples per GPU per step: BATCH up to 1,000 tables (one feature each), then fewer in proportion (a multiple
    of 64, at least 256), so a sample's ids and pooled rows stay as large as in the reference case. At BATCH, every
    GPU's own batch of 10,000 features would hold 33 GiB of pooled rows and ids: no plan could fit."""
    if n <= REFERENCE_TABLES:
        return BATCH
    return max(256, BATCH * REFERENCE_TABLES // n // 64 * 64)


def mixed_tables(n: int, seed: int = 0, world_size: int = REFERENCE_WORLD):
    """n tables: ~5% huge (50-200M rows), ~30% large (1-20M), the rest small (100-200k), varied widths and ids. The
    huge and large tables' rows are scaled by row_scale(n, world_size) (1 for the reference case and smaller
    models), so the model fits the GPUs at any size."""
    from embshard.spec.tables import TableConfig

    rng = random.Random(seed)
    scale = row_scale(n, world_size)
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.05:
            rows, dim, ids = rng.choice([50_000_000, 100_000_000, 200_000_000]), rng.choice([64, 128, 256]), 1
            rows = int(rows * scale)
        elif kind < 0.35:
            rows, dim, ids = rng.randint(1_000_000, 20_000_000), rng.choice([32, 64, 128]), rng.choice([1, 5, 10])
            rows = int(rows * scale)
        else:
            rows, dim, ids = rng.randint(100, 200_000), rng.choice([8, 16, 32, 64]), rng.choice([1, 10, 30, 50])
        out.append(TableConfig(f"t{i}", rows, dim, (f"f{i}",), ids_per_bag=ids))
    return out


def embshard_seconds(
    n: int, world: int, local: int, repeats: int = 3, group_sizes: bool = False
) -> tuple[float, float, list[float], float]:
    """(fastest planning seconds of `repeats`, predicted step ms, every repeat's seconds, fastest CPU seconds of
    the process: what the planner itself used, whatever else the machine ran) of embshard's planner; with
    `group_sizes`, of its search over 2D sharding's group sizes (planner/twod.py: the step with replica sync)."""
    from embshard.planner import Topology, plan_with_report
    from embshard.planner.twod import plan_at_scale

    tables, batch = mixed_tables(n, world_size=world), batch_size(n)
    topo = Topology.preset("h100", world, local)
    plan_with_report(mixed_tables(20, seed=1), Topology.preset("h100", 8), BATCH)  # warm-up (first numpy calls)
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        if group_sizes:
            scale = plan_at_scale(tables, topo, batch)
            step_s = scale.best.step_s
            print(scale.summary(), flush=True)
        else:
            step_s = plan_with_report(tables, topo, batch)[1].step_time_s
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(times), step_s * 1e3, times, min(cpu)


def embshard_peak_mib(n: int, world: int, local: int) -> float:
    """Peak memory (MiB) Python and numpy allocate while planning (tracemalloc; one more, untimed, run)."""
    import tracemalloc

    from embshard.planner import Topology, plan_with_report

    tables, topo = mixed_tables(n, world_size=world), Topology.preset("h100", world, local)
    tracemalloc.start()
    plan_with_report(tables, topo, batch_size(n))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def torchrec_child(n: int, world: int, local: int) -> None:
    """Runs in a subprocess: TorchRec's planner on the same tables (meta-device EBC), prints its seconds."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from bench.torchrec_planner import torchrec_inputs

    ebc, constraints = torchrec_inputs(mixed_tables(n, world_size=world))
    t0 = time.perf_counter()
    topo = Topology(world_size=world, local_world_size=local, compute_device="cuda", hbm_cap=80 * 1024**3)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch_size(n), constraints=constraints)
    planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    print(f"torchrec_seconds={time.perf_counter() - t0:.3f}", flush=True)


def torchrec_seconds(n: int, world: int, local: int, timeout: float) -> float | None:
    """TorchRec's planning time, or None if it ran past `timeout` seconds (or failed)."""
    cmd = [sys.executable, "-m", "bench.planner_scale", "--torchrec-child", str(n), str(world), str(local)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `bench` is a package
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return None
    for line in out.stdout.splitlines():
        if line.startswith("torchrec_seconds="):
            return float(line.split("=")[1])
    print(f"torchrec planner failed:\n{out.stderr[-2000:]}", file=sys.stderr)
    return None


def one_core() -> None:
    """Run on one CPU core, with one thread in numpy's libraries (before numpy is imported)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"


def main() -> None:
    one_core()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tables", type=int, default=1000)
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--local-world-size", type=int, default=8)
    p.add_argument("--torchrec-timeout", type=float, default=120.0, help="seconds before TorchRec's run is stopped")
    p.add_argument("--repeats", type=int, default=3, help="timed plans; the fastest is reported (shared machines)")
    p.add_argument("--skip-torchrec", action="store_true")
    p.add_argument(
        "--group-sizes", action="store_true", help="time the search over 2D sharding's group sizes (plan_at_scale)"
    )
    p.add_argument("--torchrec-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torchrec_child:
        torchrec_child(*args.torchrec_child)
        return
    n, W, lws = args.tables, args.world_size, args.local_world_size
    seconds, step_ms, times, cpu = embshard_seconds(n, W, lws, args.repeats, args.group_sizes)
    peak = embshard_peak_mib(n, W, lws)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"seconds={seconds:.3f}")
    print(
        f"embshard tables={n} world_size={W} batch={batch_size(n)} seconds={seconds:.3f} (fastest of "
        f"{', '.join(f'{t:.3f}' for t in times)}; one core) cpu_seconds={cpu:.3f} predicted_step_ms={step_ms:.2f} "
        f"peak_planner_mib={peak:.0f} (tracemalloc) maxrss_mib={maxrss:.0f} (process)"
    )
    if args.skip_torchrec:
        return
    tr = torchrec_seconds(n, W, lws, args.torchrec_timeout)
    if tr is not None:
        print(f"torchrec tables={n} world_size={W} seconds={tr:.3f} (embshard {tr / seconds:.0f}x faster)")
        return
    print(f"torchrec tables={n} world_size={W} seconds>{args.torchrec_timeout:.0f} (stopped)")
    small_n, small_w = 100, 8
    ours, *_ = embshard_seconds(small_n, small_w, small_w, args.repeats)
    tr = torchrec_seconds(small_n, small_w, small_w, args.torchrec_timeout)
    tr_text = f"{tr:.3f}" if tr is not None else f">{args.torchrec_timeout:.0f} (stopped)"
    print(f"torchrec tables={small_n} world_size={small_w} seconds={tr_text}")
    print(f"embshard tables={small_n} world_size={small_w} seconds={ours:.3f}")


if __name__ == "__main__":
    main()
