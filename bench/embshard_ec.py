"""embshard's ShardedEmbeddingCollection on the workloads of bench/baselines/torchrec_ec.py (TorchRec's
EmbeddingCollection under DistributedModelParallel), timed the same way.

Run with torchrun, one process per GPU (gloo on CPU for a smoke test):
    torchrun --nproc-per-node=1 -m bench.embshard_ec --workload seq4 [--dedup] [--ids zipf]
    torchrun --nproc-per-node=2 -m bench.embshard_ec --workload tiny            # CPU smoke test
Workloads (rows, dim, mean history length), as the baseline: seq4 = (20M, 128, 100) + (5M, 128, 100) + (100k, 128,
100) + (1000, 128, 100), batch 1024 per rank; tiny = 4 x (1000, 16, 5), batch 32. One feature per table; lengths
1 + Poisson(mean - 1) capped at --max-len, ids uniform or Zipf(--zipf-alpha) scattered over the rows, drawn by the
same generator (seed 1000 + rank) in the same order as the baseline, so both time the same batches. Step =
forward (a JaggedTensor of rows per feature), loss = sum of squares of every row, backward with row-wise Adagrad
(lr 0.01) fused into it; no pipelining. `--dedup`: every table's ids exchanged and looked up once per step
(ShardedEmbeddingCollection(dedup=True); the baseline's `EmbeddingCollectionSharder(use_index_dedup=True)`).
`--step graph`: the whole step (forward, loss, backward with the fused update) as one CUDA graph replay
(embshard/collection/sequence_graph.py: batches padded to a capacity); `eager`: the collection's forward and
backward; `auto` (default): graph where the collection allows it (CUDA, no dedup), else eager. Both take each
batch's counts from the host (`ShardedEmbeddingCollection.host_counts` of the CPU batch, as a data pipeline gives
them): no host sync in the step.
`--plan planner` (default: embshard.planner on the detected devices, pricing dedup when it is on), `simple`
(table-wise, greedy) or a saved plan file.

Rank 0 prints the plan, the step time, and the physical floor: the bytes each rank looks up and exchanges per
step (bench/floors.py sequence_bytes) over the planner's bandwidths for the device, then one line
RESULT framework=embshard module=ec workload=... world=... batch_per_rank=... ids=... dedup=... ms_per_step=...
ids_per_s=... peak_gib=... floor_ms=... floor_hbm_gb=... floor_link_gb=...
(the baseline's fields first; `python -m bench.run seq` compares the two).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import time

import torch
import torch.distributed as dist

from bench import floors
from bench.timing import timed_ms

WORKLOADS = {  # the baseline's (bench/baselines/torchrec_ec.py)
    "seq4": ([(20_000_000, 128, 100), (5_000_000, 128, 100), (100_000, 128, 100), (1000, 128, 100)], 1024),
    "tiny": ([(1000, 16, 5)] * 4, 32),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="seq4")
    ap.add_argument("--ids", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--zipf-alpha", type=float, default=1.05)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--dedup", action="store_true", help="ShardedEmbeddingCollection(dedup=True)")
    ap.add_argument("--step", choices=["auto", "graph", "eager"], default="auto", help="graph: one CUDA graph replay")
    ap.add_argument("--plan", default="planner", help="planner, simple, or a saved plan file")
    ap.add_argument("--hbm-gib", type=float, default=0, help="planner: GPU memory per rank to plan for (0: all)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    if args.max_len < 1 or args.steps < 1 or args.warmup < 0:
        ap.error(f"--max-len {args.max_len}, --steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def make_plan(args: argparse.Namespace, tables, world: int, batch: int, opt, cuda: bool, graph: bool):
    """(The sharding plan of the run (--plan), the planner's predicted step in ms or None): `graph` prices the step
    as one CUDA graph replay (the planner's whole_step_graph), else as an eager step."""
    from embshard.planner import PlannerSettings, Topology, plan_with_report, simple_plan
    from embshard.spec.plan import MemoryTier, ShardingPlan

    if args.plan == "simple":
        return simple_plan(tables, world, tier=MemoryTier.HBM if cuda else MemoryTier.HOST), None
    if args.plan == "planner":
        topo = Topology.detect(world_size=world, device_type="cuda" if cuda else "cpu")
        topo = topo.with_sizes(hbm_gib=args.hbm_gib or None)
        settings = PlannerSettings(sequence_dedup=args.dedup, whole_step_graph=graph)
        plan, report = plan_with_report(tables, topo, batch, opt, settings=settings)
        return plan, report.step_time_s * 1e3
    return ShardingPlan.load(args.plan), None


def floor_ms(parts: dict[str, list[float]], cuda: bool, world: int) -> float:
    """The slowest rank's bytes over the planner's bandwidths for this device (GPU memory, all-to-all), ms."""
    from embshard.planner import Topology

    topo = Topology.detect(world_size=world, device_type="cuda" if cuda else "cpu")
    mem_bw = topo.hbm_bw if cuda else topo.ddr_bw
    return max(h / mem_bw + link / topo.intra_host_bw for h, link in zip(parts["hbm"], parts["link"])) * 1e3


def run(args: argparse.Namespace, dev: torch.device) -> str | None:
    """Plan, build and time the workload on the default process group's ranks; rank 0 prints the plan, times and
    floor, and returns the RESULT line (other ranks: None)."""
    cuda = dev.type == "cuda"
    rank, ws = dist.get_rank(), dist.get_world_size()
    from torchrec import KeyedJaggedTensor

    from embshard import FusedOptimizerConfig, TableConfig
    from embshard.collection.sequence import ShardedEmbeddingCollection
    from embshard.collection.sequence_graph import SequenceStepGraph, refusal
    from embshard.sharding.exchange import parse_counts

    spec, batch = WORKLOADS[args.workload]
    tables = [
        TableConfig(f"t{i}", r, d, (f"f{i}",), pooling="none", ids_per_bag=float(mean))
        for i, (r, d, mean) in enumerate(spec)
    ]
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    t0 = time.time()
    want_graph = cuda and not args.dedup and args.step != "eager"
    plan, predicted = make_plan(args, tables, ws, batch, opt, cuda, want_graph)
    model = ShardedEmbeddingCollection(tables, plan, opt, device=dev, dedup=args.dedup)
    build_s = time.time() - t0
    if rank == 0:
        kinds = collections.Counter()
        for tp in plan.tables:
            kind = f"{tp.sharding_type.value}/{tp.tier.value}"
            kinds[kind] += 1
            print(f"  plan {tp.table}: {kind} ranks {sorted({s.rank for s in tp.shards})}")
        print(f"plan+build {build_s:.1f} s; plan: {dict(kinds)}")

    gen = torch.Generator().manual_seed(1000 + rank)  # the baseline's draws, in its order

    def ids(n: int, rows: int) -> torch.Tensor:
        if args.ids == "uniform":
            return torch.randint(0, rows, (n,), generator=gen)
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        a = 1.0 - args.zipf_alpha
        k = (((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a) if abs(a) > 1e-9 else torch.exp(u * math.log(rows + 1.0))
        return ((k.floor().long() - 1).clamp(0, rows - 1) * 2654435761) % rows

    def make_batch() -> KeyedJaggedTensor:
        lengths, values = [], []
        for r, _, mean in spec:
            le = (1 + torch.poisson(torch.full((batch,), float(mean - 1)), generator=gen)).clamp(max=args.max_len)
            le = le.to(torch.int32)
            lengths.append(le)
            values.append(ids(int(le.sum()), r))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(spec))], values=torch.cat(values), lengths=torch.cat(lengths)
        )
        row = model.host_counts(kjt).to(dev)  # the host's counts of the CPU batch, gathered from every rank
        rows = [torch.zeros_like(row) for _ in range(ws)]
        dist.all_gather(rows, row)
        return kjt.to(dev), parse_counts(torch.stack(rows).cpu().numpy())

    batches = [make_batch() for _ in range(4)]
    n_ids = sum(int(b.values().numel()) for b, _ in batches) / len(batches)

    def loss_of(out) -> torch.Tensor:
        return sum(jt.values().float().square().sum() for jt in out.values())

    why = refusal(model) if cuda else "the CPU has no CUDA graphs"
    if args.step == "graph" and why is not None:
        raise SystemExit(f"--step graph: {why}")
    graph = SequenceStepGraph(model, loss_of) if want_graph and why is None else None
    if graph is None and want_graph:
        predicted = None  # priced as a graph, run eager

    def step(i: int) -> None:
        kjt, counts = batches[i % 4]
        if graph is not None:
            graph.step(kjt, counts)
            return
        loss_of(model(kjt, counts=counts)).backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        for i in range(max(args.warmup, 2 if graph is not None else 0)):  # a graph captures in its first step
            step(i)
    except RuntimeError as e:
        if graph is None or args.step == "graph":
            raise
        print(f"rank {rank}: the step's graph failed ({e}); timing the eager step", flush=True)
        graph, predicted = None, None
        for i in range(args.warmup):
            step(i)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    sync()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms = float(t) / args.steps * 1e3
    if graph is not None:
        graph.close()  # before the process group goes (a live graph holding collectives hangs its teardown)
    loss = loss_alone_ms(model, batches, loss_of, args.steps, sync)
    if rank == 0:
        mem = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0
        mean_len = n_ids / (batch * len(spec))
        sized = [TableConfig(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, pooling="none",
                             ids_per_bag=mean_len) for t in tables]  # fmt: skip
        parts = floors.sequence_bytes(sized, plan, batch, dedup=args.dedup)
        floor = floor_ms(parts, cuda, ws)
        mode = "graph" if graph is not None else "eager"
        print(f"embshard EC {args.workload} world={ws} dedup={args.dedup} step={mode}: {ms:.2f} ms/step, "
              f"{n_ids:,.0f} ids per rank-step, peak {mem:.1f} GiB"
              + (f"; without the loss ({loss:.2f} ms alone) {ms - loss:.2f} ms, the planner's embedding part "
                 f"{predicted:.2f} ms ({(ms - loss) / predicted - 1:+.0%})" if predicted else ""))  # fmt: skip
        print(f"floor {floor:.3f} ms/step (per rank GB: looked up {[round(v / 1e9, 4) for v in parts['hbm']]}, "
              f"exchanged {[round(v / 1e9, 4) for v in parts['link']]}); measured / floor {ms / floor:.1f}x")  # fmt: skip
        line = (f"RESULT framework=embshard module=ec workload={args.workload} world={ws} batch_per_rank={batch} "
                f"ids={args.ids} dedup={int(args.dedup)} step={mode} ms_per_step={ms:.3f} ids_per_s={ws * n_ids / ms * 1e3:.0f} "
                f"peak_gib={mem:.2f} floor_ms={floor:.4f} predicted_ms={predicted or 0:.4f} loss_ms={loss:.4f} "
                f"{floors.fields(parts)}")  # fmt: skip
        print(line)
        return line
    return None


def loss_alone_ms(model, batches, loss_of, steps: int, sync) -> float:
    """The benchmark's loss alone, forward and backward, on rows of the step's shapes (each feature's rows of the
    first batch, leaves of their own), ms: what the step spends beyond the collection's own work (the planner prices
    the embedding part)."""
    with torch.no_grad():
        out = model(*batches[0])
    view = {
        f: type(jt)(values=jt.values().detach().clone().requires_grad_(), lengths=jt.lengths()) for f, jt in out.items()
    }
    leaves = [jt.values() for jt in view.values()]
    torch.autograd.grad(loss_of(view), leaves)  # warm
    return timed_ms(lambda _i: torch.autograd.grad(loss_of(view), leaves), steps, sync)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    run(args, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
