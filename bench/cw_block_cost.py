"""One column block's training step on one GPU against the planner's price: does a narrower block cost less?

    python -m bench.cw_block_cost --out DIR          # 1 GPU: t_cat_20's block at 8 GPUs (40M rows, 6.55M ids)
    python -m bench.cw_block_cost --out DIR --cpu    # dry run on the CPU (small table, no verdict)

Why: at 8 GPUs the whole-step graph's plan of the MLPerf-shaped model cuts t_cat_20 (40M rows x 128, 100 ids a
sample) into column blocks, and each block's rank looks up every id of the global batch (8 x 8192 x 100 = 6.55M ids,
about 6.0M distinct rows). The cost model prices a block's step mostly per id and per touched row (the backward's
chain of dependent loads per row, bwd_row_s), whatever its width: on the H100 preset a 32-wide block costs 5.3 ms
against the whole table's 9.6 ms, so more blocks barely shorten the busiest rank and the graph's plan (6.71 ms) stays
slower than the eager step's row-wise plan (5.10 ms), which `training.cuda_graph: auto` then takes (docs/planner.md,
Hot tables). If narrow blocks cost less than that on the GPU, the graph's plans at 8 GPUs are priced too high.

What: for each width d (--widths), a table of --rows x d holding every id of a batch of --batch bags of --ids-per-bag
ids (one rank: the block's whole load), forward and backward with row-wise Adagrad, as
  column_wise   one column block (the runtime's exact row-wise Adagrad update across blocks; what the graph's plan
                runs), and
  table_wise    the same table whole (FBGEMM's fused backward),
timed with CUDA events (median of --repeats runs of --steps steps after --warmup), beside the planner's price of the
same plan (`predict` on the h100 preset, world size 1, the GPUs' step: `gpu_step_time_s`). One line per case:
`PASS cw_block column_wise d=32 measured X ms predicted Y ms (ratio R)` when measured and predicted agree within
--tolerance (either way), else FAIL; then, per sharding, each width's time over the 128-wide one's, measured and
predicted (the question above). `ALL PASS` or `N FAILED` at the end (exit status 1), every line also in
DIR/cw_block_cost.txt.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.verdict import finish

CASES = ("column_wise", "table_wise")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--cpu", action="store_true", help="dry run on the CPU (small table, host tier, no verdict)")
    p.add_argument("--rows", type=int, default=40_000_000, help="table rows (t_cat_20's)")
    p.add_argument("--batch", type=int, default=8 * 8192, help="bags a step: the global batch of 8 GPUs x 8192")
    p.add_argument("--ids-per-bag", type=int, default=100, help="ids per bag (t_cat_20's)")
    p.add_argument("--widths", default="128,64,32,16", help="block widths, comma-separated (multiples of 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
    p.add_argument("--tolerance", type=float, default=1.5, help="PASS when measured / predicted is within this factor")
    args = p.parse_args(argv)
    if args.cpu:
        args.rows, args.batch = min(args.rows, 20_000), min(args.batch, 64)
        args.warmup, args.steps, args.repeats = 1, 1, 1
    return args


def init(cpu: bool) -> torch.device:
    """A one-process group (the exact column-wise update swaps row norms over it); the device to compute on."""
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible: run on a GPU, or pass --cpu for a dry run")
    from embshard.runtime.distributed import init_distributed

    return init_distributed(cpu=cpu)


def predicted_s(table, plan, batch: int, optimizer, cpu: bool) -> float:
    """The planner's price of one step of `plan` (the GPUs' time, no host floor: the step is timed on the GPU)."""
    from embshard.planner import PlannerSettings, Topology
    from embshard.planner.predict import predict

    topo = Topology.preset("cpu" if cpu else "h100", world_size=1)
    settings = PlannerSettings(pooled_bytes=4, batch_counts="device", whole_step_graph=not cpu)
    return predict(plan, [table], topo, batch, optimizer, settings=settings).gpu_step_time_s


def time_case(ebc, args, device) -> float:
    """Median seconds of one forward + backward of `ebc` on fresh uniform ids (every bag --ids-per-bag long)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator(device).manual_seed(7)
    n = args.batch * args.ids_per_bag
    lengths = torch.full((args.batch,), args.ids_per_bag, dtype=torch.int32, device=device)
    count = args.warmup + args.steps * args.repeats
    batches = [torch.randint(0, args.rows, (n,), device=device, generator=gen) for _ in range(min(count, 4))]

    def step(i: int) -> None:
        kjt = KeyedJaggedTensor(keys=["f"], values=batches[i % len(batches)], lengths=lengths)
        out = ebc(kjt).values()
        out.float().sum().backward()

    for i in range(args.warmup):
        step(i)
    runs = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(args.steps):
                step(i)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / args.steps)
        else:
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i)
            runs.append((time.perf_counter() - t0) / args.steps)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    from embshard import FusedOptimizerConfig, TableConfig, simple_plan
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = init(args.cpu)
    optimizer = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    tier = "host" if args.cpu else "hbm"
    widths = [int(w) for w in args.widths.split(",") if w]
    lines = [
        f"INFO {args.rows} rows, {args.batch} bags of {args.ids_per_bag} ids a step ({args.batch * args.ids_per_bag} "
        f"ids), rowwise_adagrad, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}"
    ]
    print(lines[-1], flush=True)
    times: dict[tuple[str, int], tuple[float, float]] = {}
    failures = 0
    for case in CASES:
        for d in widths:
            table = TableConfig("t", args.rows, d, ("f",), ids_per_bag=args.ids_per_bag)
            plan = simple_plan([table], 1, sharding_types={"t": case}, tier=tier, column_shards=1)
            want = predicted_s(table, plan, args.batch, optimizer, args.cpu)
            try:
                ebc = ShardedEmbeddingBagCollection([table], plan, optimizer, device=device, seed=None)
                got = time_case(ebc, args, device)
            except torch.cuda.OutOfMemoryError:
                failures += 1
                lines.append(f"FAIL cw_block {case} d={d}: out of memory (try --rows smaller)")
                print(lines[-1], flush=True)
                continue
            finally:
                ebc = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            times[case, d] = (got, want)
            ratio = got / want
            ok = 1 / args.tolerance <= ratio <= args.tolerance
            verdict = "DRY" if args.cpu else ("PASS" if ok else "FAIL")
            failures += verdict == "FAIL"
            lines.append(
                f"{verdict} cw_block {case} d={d} measured {got * 1e3:.3f} ms predicted {want * 1e3:.3f} ms "
                f"(ratio {ratio:.2f})"
            )
            print(lines[-1], flush=True)
    for case in CASES:
        base = times.get((case, max(widths)))
        if base is None:
            continue
        parts = [
            f"d={d} {times[case, d][0] / base[0]:.2f} (predicted {times[case, d][1] / base[1]:.2f})"
            for d in widths
            if (case, d) in times
        ]
        lines.append(f"INFO {case}: each width's step over the {max(widths)}-wide one's, measured: " + ", ".join(parts))
        print(lines[-1], flush=True)
    return finish(lines, failures, out / "cw_block_cost.txt")


if __name__ == "__main__":
    sys.exit(main())
