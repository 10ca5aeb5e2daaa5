"""Memory tiers on one GPU: training throughput per tier (hbm, uvm, uvm_caching) on uniform and Zipf-skewed ids,
and the UVM-cache hit rate against the cache size. Prints markdown tables (with the command, device and date).

    python -m bench.tiers                  # default: 8 tables x 4M rows x 128 fp32 (15.3 GiB), about 2 minutes
    python -m bench.tiers --rows 10000000  # 40 GB of tables (still fits the hbm row on an 80 GB GPU)
    python -m bench.tiers --cpu            # dry run on the CPU (host tier, tiny tables, no cache): checks the script

A step is forward + backward of the sharded module on one rank, with the fused optimizer (rowwise adagrad) in
the backward; the time of `--steps` consecutive steps is taken with CUDA events, `--repeats` times after
`--warmup` steps, and the median reported. Zipf ids: the k-th most popular row has probability about
proportional to k^-s (inverse-CDF sampling of a continuous power law truncated to [1, rows + 1), on the GPU),
and a fixed random permutation of the rows spreads the hot rows over the table. Every tier sees the same
batches. The hit rate is 1 - unique misses / ids looked up over `--measure` steps after `--fill` steps have
filled the cache (ebc.cache_stats()).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace

import torch

from embshard import FusedOptimizerConfig, LookupOptions, ShardingPlan, TableConfig, simple_plan
from embshard.collection.sharded import ShardedEmbeddingBagCollection


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny tables (host tier only)")
    w = p.add_argument_group("workload")
    w.add_argument("--tables", type=int, default=8, help="number of tables (one feature each)")
    w.add_argument("--rows", type=int, default=4_000_000, help="rows per table")
    w.add_argument("--dim", type=int, default=128, help="embedding dimension")
    w.add_argument("--batch", type=int, default=8192, help="samples per step")
    w.add_argument("--ids-per-bag", type=int, default=8, help="ids per bag (every bag has this many)")
    w.add_argument("--dists", default="uniform,zipf1.05,zipf1.2", help="id distributions: uniform or zipf<s>")
    t = p.add_argument_group("tiers")
    t.add_argument("--tiers", default="hbm,uvm,uvm_caching", help="tiers to time, comma-separated")
    t.add_argument("--clf", type=float, default=0.2, help="cache_load_factor of the uvm_caching throughput row")
    t.add_argument("--algo", default="lru", choices=["lru", "lfu"], help="cache replacement policy")
    m = p.add_argument_group("timing")
    m.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    m.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    m.add_argument("--repeats", type=int, default=5, help="timed repeats (the median is reported)")
    h = p.add_argument_group("hit-rate table")
    h.add_argument("--sweep", default="0.01,0.05,0.2", help="cache_load_factor values for the hit-rate table")
    h.add_argument("--fill", type=int, default=30, help="hit-rate table: steps that fill the cache first")
    h.add_argument("--measure", type=int, default=20, help="hit-rate table: steps measured")
    args = p.parse_args(argv)
    if args.cpu:
        args.rows, args.batch, args.tiers, args.sweep = min(args.rows, 20_000), min(args.batch, 256), "host", "0.2"
        args.fill, args.measure = min(args.fill, 3), min(args.measure, 3)
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def zipf_rows(n: int, rows: int, s: float, perm: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """n ids with P(row perm[k-1]) proportional to k^-s, k = 1..rows."""
    u = torch.rand(n, generator=gen, device=perm.device, dtype=torch.float64)
    if abs(s - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1))
    else:
        a = 1.0 - s
        x = (1.0 + u * ((rows + 1) ** a - 1.0)) ** (1.0 / a)
    k = (x.floor().long() - 1).clamp_(0, rows - 1)
    return perm[k]


def make_batches(dist: str, count: int, args, perms: list[torch.Tensor], device) -> list[torch.Tensor]:
    """`count` batches of ids, each feature-major: table 0's B*L ids, then table 1's, ..."""
    gen = torch.Generator(device).manual_seed(1234)
    n = args.batch * args.ids_per_bag
    out = []
    for _ in range(count):
        if dist == "uniform":
            ids = torch.randint(0, args.rows, (args.tables, n), device=device, generator=gen)
        else:
            s = float(dist.removeprefix("zipf"))
            ids = torch.stack([zipf_rows(n, args.rows, s, perms[t], gen) for t in range(args.tables)])
        out.append(ids.flatten())
    return out


def build(tables, tier: str, clf: float, args, device, stats: bool) -> ShardedEmbeddingBagCollection:
    plan = simple_plan(tables, 1, tier=tier)
    plan = ShardingPlan(1, 1, tuple(replace(t, cache_load_factor=clf, cache_algorithm=args.algo) for t in plan.tables))
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    options = LookupOptions(cache_stats=stats)
    return ShardedEmbeddingBagCollection(tables, plan, opt, device=device, seed=None, options=options)


class Runner:
    """Runs training steps of one module on pre-made batches."""

    def __init__(self, ebc, args, features, device) -> None:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        self.ebc, self.features, self.kjt_type = ebc, features, KeyedJaggedTensor
        self.lengths = torch.full((len(features) * args.batch,), args.ids_per_bag, dtype=torch.int32, device=device)
        gen = torch.Generator(device).manual_seed(0)
        self.upstream = torch.randn(args.batch, len(features) * args.dim, device=device, generator=gen)
        self.device = device

    def step(self, ids: torch.Tensor) -> None:
        kjt = self.kjt_type(keys=self.features, values=ids, lengths=self.lengths)
        out = self.ebc(kjt).values()
        (out * self.upstream).sum().backward()

    def time_steps(self, batches: list[torch.Tensor], warmup: int, steps: int, repeats: int) -> float:
        """Median seconds per step."""
        it = iter(batches)
        for _ in range(warmup):
            self.step(next(it))
        per_step = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(steps):
                    self.step(next(it))
                end.record()
                end.synchronize()
                per_step.append(start.elapsed_time(end) / 1000 / steps)
            else:
                t0 = time.perf_counter()
                for _ in range(steps):
                    self.step(next(it))
                per_step.append((time.perf_counter() - t0) / steps)
        return statistics.median(per_step)


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tables = [TableConfig(f"t{i}", args.rows, args.dim, (f"f{i}",)) for i in range(args.tables)]
    features = [f"f{i}" for i in range(args.tables)]
    table_gib = sum(t.weight_bytes for t in tables) / 2**30
    dists = [d for d in args.dists.split(",") if d]
    n_batches = max(args.warmup, args.fill) + args.steps * args.repeats
    n_batches = max(n_batches, args.fill + args.measure if args.sweep else 0)
    t_start = time.perf_counter()
    gen = torch.Generator(device).manual_seed(99)
    perms = [torch.randperm(args.rows, device=device, generator=gen) for _ in tables]
    batches = {d: make_batches(d, n_batches, args, perms, device) for d in dists}
    del perms
    log(f"made {n_batches} batches for {dists} in {time.perf_counter() - t_start:.1f}s")

    throughput = []  # (tier, dist, seconds per step)
    for tier in [t for t in args.tiers.split(",") if t]:
        t0 = time.perf_counter()
        try:
            ebc = build(tables, tier, args.clf, args, device, stats=False)
        except torch.cuda.OutOfMemoryError:
            log(f"{tier}: out of memory building {table_gib:.1f} GiB of tables")
            throughput += [(tier, d, None) for d in dists]
            free(device)
            continue
        log(f"{tier}: built in {time.perf_counter() - t0:.1f}s")
        runner = Runner(ebc, args, features, device)
        warmup = max(args.warmup, args.fill) if tier == "uvm_caching" else args.warmup  # time a filled cache
        for d in dists:
            sec = runner.time_steps(batches[d], warmup, args.steps, args.repeats)
            throughput.append((tier, d, sec))
            log(f"{tier} {d}: {1000 * sec:.2f} ms/step")
        del ebc, runner
        free(device)

    sweep = []  # (clf, cache GiB, dist, hit rate, seconds per step with statistics on)
    for clf in [float(c) for c in args.sweep.split(",") if c]:
        t0 = time.perf_counter()
        tier = "host" if args.cpu else "uvm_caching"
        ebc = build(tables, tier, clf, args, device, stats=True)
        log(f"{tier} clf={clf}: built in {time.perf_counter() - t0:.1f}s")
        runner = Runner(ebc, args, features, device)
        cache_gib = sum(lk.settings.cache_bytes() for s in ebc.schemes for lk in s.lookups if hasattr(lk, "settings"))
        cache_gib /= 2**30
        for d in dists:
            for ids in batches[d][: args.fill]:
                runner.step(ids)
            ebc.reset_cache_stats()
            sec = runner.time_steps(batches[d][args.fill :], 0, args.measure, 1)
            st = list(ebc.cache_stats().values())
            hit = 1 - sum(s["unique_misses"] for s in st) / sum(s["requested"] for s in st) if st else None
            sweep.append((clf, cache_gib, d, hit, sec))
            log(f"clf={clf} {d}: hit rate {'n/a' if hit is None else f'{100 * hit:.1f}%'}")
        del ebc, runner
        free(device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    import fbgemm_gpu

    print("## Memory tiers\n")
    print(f"Command: `python -m bench.tiers {shlex.join(sys.argv[1:] if argv is None else argv)}`  ")
    print(
        f"Device: {name}; torch {torch.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}; "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}; total {time.perf_counter() - t_start:.0f}s  "
    )
    print(
        f"Model: {args.tables} tables x {args.rows:,} rows x {args.dim} fp32 ({table_gib:.1f} GiB), "
        f"batch {args.batch}, "
        f"{args.ids_per_bag} ids per bag, rowwise_adagrad fused; uvm_caching row: cache_load_factor {args.clf} "
        f"({args.algo})\n"
    )
    print(
        f"Training throughput (forward + backward), median of {args.repeats} x {args.steps} steps after "
        f"{args.warmup} warm-up steps ({max(args.warmup, args.fill)} for uvm_caching, to fill the cache)\n"
    )
    print("| tier | ids | ms/step | steps/s | samples/s |")
    print("|---|---|---:|---:|---:|")
    for tier, d, sec in throughput:
        if sec is None:
            print(f"| {tier} | {d} | OOM | | |")
        else:
            print(f"| {tier} | {d} | {1000 * sec:.2f} | {1 / sec:.1f} | {args.batch / sec:,.0f} |")
    if sweep:
        print(
            f"\nUVM-cache hit rate against cache size ({args.algo}; {args.fill} steps fill the cache, then "
            f"{args.measure} steps measured; statistics on)\n"
        )
        print("| cache_load_factor | cache GiB | ids | hit rate | ms/step |")
        print("|---:|---:|---|---:|---:|")
        for clf, gib, d, hit, sec in sweep:
            rate = "n/a" if hit is None else f"{100 * hit:.1f}%"
            print(f"| {clf} | {gib:.2f} | {d} | {rate} | {1000 * sec:.2f} |")


if __name__ == "__main__":
    main()
