"""embshard on the benchmark workloads of bench/baselines/torchrec_dmp.py (TorchRec), timed the same way.

Run with torchrun, one process per GPU (gloo on CPU for a smoke test):
    torchrun --nproc-per-node=2 -m bench.embshard_dmp --workload uniform26
    torchrun --nproc-per-node=2 -m bench.embshard_dmp --workload hetero124 --plan small-dp
Workloads (rows, dim, mean ids per bag), batch per rank 8192 (tiny: 64; mlperf: the 26 tables of
configs/dlrm_dcnv2_mlperf.yaml, the end-to-end model's embedding part), ids uniform, row-wise Adagrad, bag
lengths uniform in [0, 2 x mean]: the same as the TorchRec baseline script. Step = forward, backward with the
fused optimizer (`values().sum().backward()`), no pipelining. Prints ms/step, samples/s and peak GPU memory, and
one line `RESULT framework=embshard bench=emb workload=... ms_per_step=... predicted_ms=... floor_hbm_gb=...`
(bench/report.py reads it; the floor fields are the bytes each rank moves per step, bench/floors.py).
--mem-at 100,5000 also records the GPU memory allocated after those timed steps (a long run: no growth).
--build-only stops after printing the plan and build time; --profile-build prints a cProfile of the build (rank
0); --rows-scale 0.01 scales every table's rows (a big workload's build profiled on CPUs); --seed 0 builds the
initial weights as training runs do (embshard.lookup.init_rows), instead of drawing them on the device.

--ids raw: every table is a raw-id table (ids: raw, capacity = its rows, --eviction lru|lfu; docs/raw_ids.md): the
same step with the ids mapped to rows on the device. --ids both builds a static and a raw-id collection of the same
tables and times them interleaved (--rounds rounds of --steps steps each, static then raw) on the same batches.
--id-space K draws the ids from K x rows values (raw tables: K > 1 admits and evicts every step; static tables get
them modulo rows); --batches N cycles N distinct batches. With --ids raw|both the RESULT lines say bench=rawids,
ids=static|raw, id_space, rounds (median ms_per_step; `python -m bench.run rawids` runs it).
    torchrun --nproc-per-node=1 -m bench.embshard_dmp --workload uniform26 --ids both --rounds 3 --steps 20

--plan: `simple` (all table-wise, greedy), `small-dp` (tables <= 10k rows data-parallel, the rest table-wise),
`planner` (embshard.planner on the detected GPUs; --hbm-gib caps the GPU memory it may plan for, which is how
`overflow` is made not to fit), or a saved plan file. With the planner, the line also carries the predicted
step time and peak GPU memory, to compare with the measured ones: planned and predicted with the batch counts the
run uses (PlannerSettings.batch_counts: --counts host or device; both: host, and the device line carries the same
plan's prediction with device counts, which charges the step's host sync).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench import floors
from bench.timing import host_bound, interleaved_ms, result_line
from bench.workloads import WORKLOADS, workload_spec, workload_tables


def trace_steps(step: Callable[[int], None], n: int, sync: Callable[[], None], rank: int, out: str, name: str):
    """`n` steps under torch.profiler (host and GPU activity; every rank runs them, rank 0 records): prints the
    operators by self host time per step and the host's waits on the GPU; writes a Chrome trace into `out`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    prof = profile(activities=acts)
    with prof if rank == 0 else contextlib.nullcontext():
        for i in range(n):
            step(i)
        sync()
    if rank != 0:
        return
    ev = prof.key_averages()
    print(f"trace of {n} steps, rank 0, operators by self host time (the profiler slows the host):")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80))
    waits = ("Synchronize", "item", "tolist", "_local_scalar", "cudaMemcpy", "EventSynchronize", "StreamWait")
    per = {e.key: (e.count / n, e.self_cpu_time_total / n / 1e3) for e in ev if any(w in e.key for w in waits)}
    print("host waits per step (count, self ms):", {k: (round(c, 1), round(t, 3)) for k, (c, t) in per.items()})
    runtime = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
    driver = sum(e.count for e in ev if e.key in ("cuLaunchKernel", "cuLaunchKernelEx"))  # Triton's among them
    print(f"kernel launches per step: {(runtime + driver) / n:.0f} ({runtime / n:.0f} through the CUDA runtime)")
    if out:
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"trace_embshard_{name}.json"))


def sync_debug(step: Callable[[int], None], sync: Callable[[], None], rank: int) -> None:
    """2 steps with torch.cuda's sync debug mode on rank 0: prints every host sync with the Python line that made
    it (the warning's frame)."""
    import warnings

    sync()
    if rank == 0:
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            step(i)
    if rank != 0:
        return
    torch.cuda.set_sync_debug_mode(0)
    sync()
    print(f"host syncs in 2 steps, rank 0: {len(caught)}")
    for w in caught:
        print("  ", str(w.message).splitlines()[0][:160], f"({w.filename}:{w.lineno})")


def make_plan(args, tables, world: int, tier, batch: int, opt):
    """(plan, planner report or None); the planner plans and predicts with the run's primary batch counts
    (--counts; both: host)."""
    from embshard.planner import simple_plan
    from embshard.spec.plan import ShardingPlan, ShardingType

    if args.plan == "simple":
        return simple_plan(tables, world, tier=tier), None
    if args.plan == "small-dp":
        types = {t.name: ShardingType.DATA_PARALLEL for t in tables if t.num_embeddings <= 10_000}
        return simple_plan(tables, world, sharding_types=types, tier=tier), None
    if args.plan == "planner":
        from embshard.planner import PlannerSettings, Topology
        from embshard.planner.policy import search_plan

        # --graph: first among the options the captured step holds (table-wise and data-parallel, no UVM caching)
        counts = "device" if args.counts == "device" else "host"
        settings = PlannerSettings(batch_counts=counts, whole_step_graph=args.graph)
        if args.topology:  # measured by `embshard calibrate` on this machine
            topo = Topology.load(args.topology).with_sizes(world_size=world, hbm_gib=args.hbm_gib or None)
        else:
            topo = Topology.detect(world_size=world).with_sizes(hbm_gib=args.hbm_gib or None)
        return search_plan(tables, topo, batch, opt, None, settings, say=print)
    return ShardingPlan.load(args.plan), None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=WORKLOADS, default="uniform26")
    ap.add_argument("--plan", default="simple")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hbm-gib", type=float, default=0, help="planner: GPU memory per rank to plan for (0: all)")
    ap.add_argument("--topology", default="", help="planner: a topology file from `embshard calibrate`")
    ap.add_argument("--save-plan", default="", help="write the plan used (YAML) to this file (rank 0)")
    ap.add_argument("--no-check-ids", action="store_true", help="skip the per-step id range check")
    ap.add_argument("--mem-probe", action="store_true", help="print the forward and backward transient memory")
    ap.add_argument("--mem-at", default="", help="comma-separated timed steps after which to record allocated memory")
    ap.add_argument("--bench", default="emb", help="the bench name in the RESULT line (emb; soak for long runs)")
    ap.add_argument("--profile-build", action="store_true", help="cProfile of building the module (rank 0)")
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="initial weights from this seed (init_rows, as training "
        "runs build them); default: drawn on the device, not reproducible",
    )
    ap.add_argument("--build-only", action="store_true", help="stop after building the module (build time only)")
    ap.add_argument(
        "--rows-scale", type=float, default=1.0, help="every table's rows x this (CPU runs of big workloads)"
    )
    ap.add_argument("--ids", choices=("static", "raw", "both"), default="static", help="table ids (both: interleaved)")
    ap.add_argument("--eviction", choices=("lru", "lfu"), default="lru", help="raw-id tables' eviction policy")
    ap.add_argument("--id-space", type=float, default=1.0, help="ids drawn from this many x rows distinct values")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    ap.add_argument("--rounds", type=int, default=3, help="--ids both: interleaved rounds of --steps steps each")
    ap.add_argument("--numa-bind", action="store_true", help="run each rank on its GPU's NUMA node's CPUs")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="run each step as one CUDA graph replay (embshard/collection/emb_graph.py: batches padded to a capacity per "
        "feature; host counts only)",
    )
    ap.add_argument(
        "--cprofile", type=int, default=0, help="after the timed steps, a cProfile of N steps on rank 0 (host time)"
    )
    ap.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        help="after the timed steps, N steps under torch.profiler (host and GPU, rank 0): the host's time per "
        "operator and its waits on the GPU (syncs), and with --trace-dir a Chrome trace",
    )
    ap.add_argument("--trace-dir", default="", help="--trace-steps: write rank 0's Chrome trace here")
    ap.add_argument(
        "--no-gc",
        action="store_true",
        help="after the warm-up, freeze the objects alive then and turn Python's automatic garbage collection off "
        "(a collection pauses the host for milliseconds in a process with many objects)",
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="after the timed steps, 2 steps with torch.cuda's sync debug mode (rank 0): prints every host sync "
        "with the code that made it",
    )
    ap.add_argument(
        "--host-time",
        type=int,
        default=0,
        help="after the timed steps, N steps each alone (synchronized before): the host's time to launch one and "
        "its whole time (medians, rank 0): a launch time near the step's means the step waits for the host",
    )
    ap.add_argument(
        "--counts",
        choices=("host", "device", "both"),
        default="host",
        help="each step's batch counts: host (counted from the batch's CPU copy before the step and gathered over a "
        "CPU group, as embshard's training pipeline does: no GPU sync in the step), device (the forward gathers "
        "them on the GPUs and syncs once), both (interleaved; RESULT lines for host)",
    )
    args = ap.parse_args()
    if args.ids != "static" and args.bench == "emb":
        args.bench = "rawids"

    from bench.numa import numa_setup
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.runtime import comm
    from embshard.runtime.distributed import init_distributed
    from embshard.sharding.exchange import parse_counts
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import MemoryTier

    numa_setup(bind=args.numa_bind)  # one line per rank: the GPU's node and where the process runs
    dev = init_distributed()
    cuda = dev.type == "cuda"
    rank, ws = dist.get_rank(), dist.get_world_size()
    spec, batch = workload_spec(args.workload, args.rows_scale), WORKLOADS[args.workload][1]
    tables = workload_tables(args.workload, args.rows_scale)
    raw_tables = (
        [dataclasses.replace(t, ids="raw", eviction=args.eviction) for t in tables] if args.ids != "static" else []
    )
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    t0 = time.time()
    planned = raw_tables if args.ids != "static" else tables  # both: one plan raw-id tables can use
    plan, report = make_plan(args, planned, ws, MemoryTier.HBM if cuda else MemoryTier.HOST, batch, opt)
    plan_s = time.time() - t0
    kinds_run = {"static": ["static"], "raw": ["raw"], "both": ["static", "raw"]}[args.ids]
    profiler = None
    if args.profile_build:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.time()
    ebcs = {
        k: ShardedEmbeddingBagCollection(raw_tables if k == "raw" else tables, plan, opt, device=dev, seed=args.seed)
        for k in kinds_run
    }
    if cuda:
        torch.cuda.synchronize()
    build_s = time.time() - t0
    if profiler is not None:
        profiler.disable()
        if rank == 0:
            import pstats

            print(f"build profile, rank 0 ({build_s:.1f} s; GPU work inside the calls that wait for it):")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    built_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    builds: list = [None] * ws  # each rank's build time: rank 0 may wait inside its build for a slower rank
    dist.all_gather_object(builds, build_s)
    if rank == 0:
        kinds: dict[str, int] = {}
        for tp in plan.tables:
            kinds[f"{tp.sharding_type.value}/{tp.tier.value}"] = (
                kinds.get(f"{tp.sharding_type.value}/{tp.tier.value}", 0) + 1
            )
        each = ", ".join(f"{b:.1f}" for b in builds)
        print(
            f"plan {plan_s:.2f} s, build {build_s:.1f} s ({', '.join(ebcs)}; ranks {each}); plan: {kinds}", flush=True
        )
        if args.save_plan:
            plan.save(args.save_plan)
        # The plan this run measures, for `bench/planner_predict.py --refit` (one line of JSON).
        print(f"PLAN workload={args.workload} json={json.dumps(json.loads(plan.to_json()), separators=(',', ':'))}")
    if args.build_only:
        dist.destroy_process_group()
        return

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator(device=dev).manual_seed(rank)

    def make_batch() -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        """(static batch, raw batch): the same bags; ids drawn from id_space x rows values, the static table's
        modulo rows (with --id-space 1 both get the same ids)."""
        lengths, values = [], []
        for r, _, mean in spec:
            le = torch.randint(0, 2 * mean + 1, (batch,), device=dev, generator=gen, dtype=torch.int32)
            lengths.append(le)
            values.append(torch.randint(0, max(1, int(r * args.id_space)), (int(le.sum()),), device=dev, generator=gen))
        keys = [f"f{i}" for i in range(len(spec))]
        raw = torch.cat(values)
        static = torch.cat([v % r for v, (r, _, _) in zip(values, spec)]) if args.id_space > 1 else raw
        return tuple(
            KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.cat(lengths)) for v in (static, raw)
        )

    batches = [make_batch() for _ in range(args.batches)]
    # Host counts: each batch's counts row made from its CPU copy once, before the timed steps (the training
    # pipeline makes it in its host thread while earlier batches train), with the id range check when asked.
    host_group = dist.new_group(backend="gloo") if cuda and args.counts != "device" else None
    rows = {}
    if args.counts != "device":
        for kind, ebc in ebcs.items():
            rows[kind] = []
            for b in batches:
                kjt = b[kind == "raw"]
                cpu = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().cpu(), lengths=kjt.lengths().cpu())
                rows[kind].append(ebc.host_counts(cpu, check=not args.no_check_ids))
    primary = "device" if args.counts == "device" else "host"
    graphs = {}
    if args.graph:
        from embshard.collection.emb_graph import EmbeddingStepGraph

        if args.counts != "host":
            raise SystemExit("--graph sizes each step from the host's counts: use --counts host")
        graphs = {k: EmbeddingStepGraph(ebc, lambda out: out.values().sum(), capture=cuda) for k, ebc in ebcs.items()}
    labels = list(ebcs) + ([f"{k}@device" for k in ebcs] if args.counts == "both" else [])

    def step(label: str, i: int) -> None:
        if torch._C._autograd._profiler_enabled():  # bench/timeline.py finds the steps by this annotation
            with torch.profiler.record_function("## train step ##"):
                return _step(label, i)
        return _step(label, i)

    def _step(label: str, i: int) -> None:
        kind, _, mode = label.partition("@")
        kjt = batches[i % len(batches)][kind == "raw"]
        ebc = ebcs[kind]
        if (mode or primary) == "host":
            # the step's agreement: every rank's counts row over the CPU group (host only, no GPU sync)
            row = rows[kind][i % len(batches)].clone()
            row[2] = ebc.next_prefetch_step
            table = comm.start_all_gather(row, host_group, "bench counts all-gather").wait(host=True).numpy()
            if kind in graphs:
                graphs[kind].step(kjt, parse_counts(table))
                return
            handle = ebc.prefetch(kjt, counts=parse_counts(table))
            ebc(kjt, prefetched=handle).values().sum().backward()
        else:
            ebc(kjt, check_ids=not args.no_check_ids).values().sum().backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for label in labels:
        for i in range(5):
            step(label, i)
    sync()
    if cuda and args.mem_probe:  # where the step's transient memory goes: forward vs backward
        for kind, ebc in ebcs.items():
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = ebc(batches[0][kind == "raw"], check_ids=not args.no_check_ids).values()
            sync()
            fwd = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            out.sum().backward()
            sync()
            bwd = torch.cuda.max_memory_allocated() - base
            if rank == 0:
                print(
                    f"memory probe ({kind}): forward +{fwd / 2**30:.2f} GiB, backward +{bwd / 2**30:.2f} GiB over "
                    f"{base / 2**30:.2f}"
                )
    if args.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    comm.barrier()
    warm_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    mem_at = sorted({int(x) for x in args.mem_at.split(",") if x})
    allocated: dict[int, float] = {}

    def step_and_record(kind: str, i: int) -> None:
        step(kind, i)
        if i + 1 in mem_at:
            sync()
            allocated[i + 1] = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0

    rounds = args.rounds if len(labels) > 1 else 1
    times = interleaved_ms(labels, rounds, args.steps, step_and_record, sync, before=comm.barrier)
    if args.cprofile:  # where the host's time goes in a step (each rank runs the steps; rank 0 records them)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        sync()
        if rank == 0:
            prof.enable()
        for i in range(args.cprofile):
            step(labels[0], i)
        sync()
        if rank == 0:
            prof.disable()
            print(f"host profile of {args.cprofile} {labels[0]} steps, rank 0:")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.trace_steps:
        trace_steps(lambda i: step(labels[0], i), args.trace_steps, sync, rank, args.trace_dir, args.workload)
    if args.sync_debug and cuda:
        sync_debug(lambda i: step(labels[0], i), sync, rank)
    alone = {label: host_bound(lambda i, label=label: step(label, i), args.host_time, sync) for label in labels}
    alone = {k: v for k, v in alone.items() if v is not None}
    mine = torch.tensor([allocated.get(k, float("nan")) for k in mem_at], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(ws)]
    dist.all_gather_object(everyone, mine)
    # peak allocated, the caching allocator's retries (a retry frees cached blocks: a device sync) and its peak
    # reserved memory, each the max over ranks
    stats = torch.cuda.memory_stats() if cuda else {}
    marks = [stats.get(k, 0) for k in ("allocated_bytes.all.peak", "num_alloc_retries", "reserved_bytes.all.peak")]
    marks_t = torch.tensor([float(m) for m in marks], device=dev)
    dist.all_reduce(marks_t, op=dist.ReduceOp.MAX)
    peak, retries, reserved = marks_t[0], int(marks_t[1]), float(marks_t[2])
    raw_stats = ebcs["raw"].raw_id_stats(gather=True) if "raw" in ebcs else {}
    if rank == 0:
        mem = (
            f"; peak GPU memory {peak.item() / 2**30:.2f} GiB (max over ranks; rank 0: {built_gib:.2f} after build, "
            f"{warm_gib:.2f} after warm-up); reserved {reserved / 2**30:.2f} GiB, allocator retries {retries}"
            if cuda
            else ""
        )
        for label in labels:
            kind, _, mode = label.partition("@")
            ms = statistics.median(times[label])
            if mode:  # the other counts mode, interleaved with the primary: one line, no RESULT
                pred = ""
                if report is not None:  # the same plan, predicted with device counts (the step's host sync)
                    from embshard.planner import PlannerSettings, predict

                    other = predict(
                        plan, planned, report.topology, batch, opt, settings=PlannerSettings(batch_counts=mode)
                    ).step_time_s
                    pred = f"; predicted {other * 1e3:.2f} ms/step ({other * 1e3 / ms:.2f}x measured)"
                print(
                    f"embshard {args.workload} world={ws} ids={kind} counts={mode}: {ms:.2f} ms/step (rounds: "
                    f"{', '.join(f'{t:.2f}' for t in times[label])}); counts={primary}: "
                    f"{statistics.median(times[kind]):.2f} ms/step{pred}",
                    flush=True,
                )
                continue
            pred = ""
            if report is not None:
                pred = (
                    f"; predicted {report.step_time_s * 1e3:.2f} ms/step ({report.step_time_s * 1e3 / ms:.2f}x "
                    f"measured), predicted peak {report.peak_hbm / 2**30:.2f} GiB"
                )
            if label in alone:
                launch, whole = alone[label]
                print(f"{label} step alone (median of {args.host_time}, rank 0): host launches it in {launch:.2f} ms, "
                      f"it ends after {whole:.2f} ms", flush=True)  # fmt: skip
            ids = "" if args.ids == "static" else f" ids={kind}"
            rounds = f" (rounds: {', '.join(f'{t:.2f}' for t in times[kind])})" if len(times[kind]) > 1 else ""
            ids += f" counts={primary}"
            print(
                f"embshard {args.workload} world={ws} plan={args.plan}{ids} check_ids={not args.no_check_ids}: "
                f"{ms:.2f} ms/step{rounds}, {ws * batch / ms * 1e3:,.0f} samples/s{mem}{pred}",
                flush=True,
            )
            if kind in graphs:
                g = graphs[kind]
                print(f"{kind}: one CUDA graph a step ({g.captures} captures, {g.replays} replays, capacity "
                      f"{int(g.capacity.sum()):,} ids)", flush=True)  # fmt: skip
            fields = [
                f"framework=embshard bench={args.bench} workload={args.workload} world={ws} batch_per_rank={batch}",
                f"plan={os.path.basename(args.plan)} hbm_gib={args.hbm_gib:g} steps={args.steps} ms_per_step={ms:.3f}",
                f"counts={primary}",
                f"samples_per_s={ws * batch / ms * 1e3:.0f} peak_gib={peak.item() / 2**30:.2f}",
            ]
            if args.ids != "static":
                fields.append(
                    f"ids={kind} id_space={args.id_space:g} eviction={args.eviction} rounds={len(times[kind])}"
                )
            if args.ids != "static":  # EMBSHARD_RAWID_GRAPH: whether the raw-id map's step replays a graph
                from embshard.rawids.graph import graph_choice

                fields.append(f"map_graph={int(graph_choice())}")
            if kind == "raw":
                tot = {k: sum(v[k] for v in raw_stats.values()) for k in ("admitted", "evicted", "resident")}
                fields.append(" ".join(f"{k}={v}" for k, v in tot.items()))
            if report is not None:
                fields.append(
                    f"predicted_ms={report.step_time_s * 1e3:.3f} predicted_peak_gib={report.peak_hbm / 2**30:.2f}"
                )
            for j, k in enumerate(mem_at):  # max over ranks
                fields.append(f"allocated_gib_step{k}={max(float(e[j]) for e in everyone):.4f}")
            if kind in graphs:
                fields.append("graph=1")
            fields.append(floors.fields(floors.embedding_bytes(tables, plan, batch)))
            print(result_line(fields), flush=True)
    for g in graphs.values():
        g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
