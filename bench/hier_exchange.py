"""Table-row-wise output exchange, hierarchical against flat, with L ranks per "host" (default 2): bytes moved per
level, milliseconds, and the planner's prediction for both.

    torchrun --nproc-per-node=4 -m bench.hier_exchange                # 4 GPUs as 2 hosts x 2 (NCCL)
    torchrun --nproc-per-node=4 -m bench.hier_exchange --smoke        # CPU smoke test (gloo), tiny sizes
    python -m bench.hier_exchange --smoke --spawn 4                   # the same, processes started here

Workload (table-row-wise only): T tables of R rows x D, one feature each, I ids per bag on average (bag lengths
uniform in [0, 2I]), uniform ids, B samples per rank, fp32 rows, row-wise Adagrad (default 8 x 2,000,000 x 128,
I = 20, B = 8192; --smoke: 4 x 2,000 x 16, I = 4, B = 64). Every table table-row-wise, half of them on each host
(simple_plan); the same plan runs with table_row_wise_exchange flat, then hierarchical. Per exchange:
- bytes: what the output exchange's all-to-alls send per step (forward; the gradients move as many back), to ranks
  of the same host and of other hosts, summed over the ranks, counted from their splits; beside it the planner's
  count (planner/exchange.py `exchange_bytes`);
- exchange ms: the output exchange alone, forward and backward (start_output_dist, wait, backward of its blocks),
  median over the timed steps, slowest rank;
- step ms: the whole embedding step (counts and ids exchanges, lookup, output exchange, backward with the fused
  update), median, slowest rank;
- predicted: the planner's (embshard.planner.predict) step time and output-exchange phases (reduce inside hosts,
  exchange, gradient exchange, gather inside hosts) on the topology: the detected GPU's preset (CPU: the cpu
  preset) with L ranks per host, or --topology FILE; and on "one machine" (inter_host_bw = intra_host_bw, as 4
  GPUs of one host posing as 2 hosts really are).
Rank 0 prints one line per exchange, a `RESULT key=value` line per exchange (bench/report.py's form), then the whole
result as JSON (also to --out FILE). `python -m bench.run hier --out DIR` runs it on 4 GPUs with the world-4
parity tests and fuzz cases of the hierarchical exchange.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from bench.timing import result_line

FULL = dict(tables=8, rows=2_000_000, dim=128, ids=20, batch=8192, steps=20, warmup=5)
SMOKE = dict(tables=4, rows=2000, dim=16, ids=4, batch=64, steps=4, warmup=1)
EXCHANGE_PHASES = ("output intra-host reduce", "output all-to-all", "gradient all-to-all", "gradient intra-host gather")


def count_exchange_bytes(local_world_size: int) -> tuple[dict[str, int], callable]:
    """Count the bytes the output exchange's all-to-alls send to ranks of this rank's host and of other hosts
    (forward only): wraps the all-to-all the exchanges call. Returns (counters, undo)."""
    import embshard.sharding.exchange as flat_module
    import embshard.sharding.hierarchical as hier_module

    counters = {"intra_host": 0, "cross_host": 0}
    original = flat_module.start_all_to_all
    L = local_world_size

    def counted(tensor, input_splits, output_splits, group=None, label="", scoped=True):
        if "pooled" in label:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            me = dist.get_rank()
            for r, n in zip(ranks, input_splits):
                if r != me and n:
                    counters["intra_host" if r // L == me // L else "cross_host"] += int(n) * tensor.element_size()
        return original(tensor, input_splits, output_splits, group, label, scoped)

    flat_module.start_all_to_all = hier_module.start_all_to_all = counted

    def undo() -> None:
        flat_module.start_all_to_all = hier_module.start_all_to_all = original

    return counters, undo


def _batches(tables, batch: int, n: int, seed: int, device: torch.device) -> list:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.cat([torch.randint(0, 2 * int(t.ids_per_bag) + 1, (batch,), generator=gen) for t in tables])
        values = torch.cat(
            [
                torch.randint(0, t.num_embeddings, (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=gen)
                for i, t in enumerate(tables)
            ]
        )
        keys = [t.feature_names[0] for t in tables]
        out.append(KeyedJaggedTensor(keys=keys, values=values.to(device), lengths=lengths.int().to(device)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_median(times: list[float], device: torch.device) -> float:
    """The slowest rank's median, in ms."""
    t = torch.tensor([statistics.median(times) * 1e3], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure(rank: int, world: int, device: torch.device, cfg: dict, local_world_size: int = 2, topology=None) -> dict:
    """Run the benchmark on this rank (every rank of the default group calls it); every rank returns the result."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.planner import Topology, predict, simple_plan
    from embshard.planner.exchange import exchange_bytes
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import MemoryTier, ShardingType
    from embshard.spec.tables import TableConfig

    L = local_world_size
    tables = [
        TableConfig(f"t{i}", cfg["rows"], cfg["dim"], (f"f{i}",), ids_per_bag=cfg["ids"]) for i in range(cfg["tables"])
    ]
    tier = MemoryTier.HBM if device.type == "cuda" else MemoryTier.HOST
    types = dict.fromkeys([t.name for t in tables], ShardingType.TABLE_ROW_WISE)
    base = simple_plan(tables, world, L, types, tier=tier)
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    if topology is None:
        topology = Topology.detect(world, L, device.type) if device.type == "cuda" else Topology.preset("cpu", world, L)
    one_machine = replace(
        topology, inter_host_bw=topology.intra_host_bw, inter_collective_latency_s=topology.collective_latency_s
    )
    batches = _batches(tables, cfg["batch"], cfg["warmup"] + cfg["steps"], seed=rank, device=device)
    result: dict = {"world_size": world, "local_world_size": L, "workload": cfg, "topology": topology.describe()}
    first: dict[str, torch.Tensor] = {}
    for exchange in ("flat", "hierarchical"):
        plan = replace(base, table_row_wise_exchange=exchange)
        ebc = ShardedEmbeddingBagCollection(tables, plan, opt, device=device, seed=0)
        at = next(k for k, s in enumerate(ebc.schemes) if s.name == "table_row_wise")
        scheme = ebc.schemes[at]
        step_s, exchange_s = [], []
        counters, undo = count_exchange_bytes(L)
        counted = dict(counters)
        try:
            for i, kjt in enumerate(batches):
                if i == cfg["warmup"]:
                    counted = dict(counters)
                # The output exchange alone: this batch's ids sent (prefetch), its lookup once, then the exchange.
                handle = ebc.prefetch(kjt)
                inp = handle.inputs[at]
                pooled = scheme.lookup(inp).detach().requires_grad_()
                _sync(device)
                t0 = time.perf_counter()
                blocks = scheme.start_output_dist(pooled, inp.batch_sizes).wait()
                torch.autograd.backward(blocks, [torch.ones_like(b) for b in blocks])
                _sync(device)
                t1 = time.perf_counter()
                out = ebc(kjt)  # the step, on the prefetched ids
                out.values().sum().backward()
                _sync(device)
                t2 = time.perf_counter()
                if i == 0:
                    first[exchange] = out.values().detach().cpu()
                if i >= cfg["warmup"]:
                    exchange_s.append(t1 - t0)
                    step_s.append(t2 - t1)
        finally:
            undo()
        steps = len(batches) - cfg["warmup"]
        sent = torch.tensor(
            [(counters[k] - counted[k]) / (2 * steps) for k in ("intra_host", "cross_host")],  # 2 exchanges a step
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sent)
        report = predict(plan, tables, topology, cfg["batch"], opt, compare_exchanges=False)
        local = predict(plan, tables, one_machine, cfg["batch"], opt, compare_exchanges=False)
        phases = dict(zip(_phase_names(), report.phase_s))
        phases_local = dict(zip(_phase_names(), local.phase_s))
        planner_bytes = exchange_bytes(plan, tables, [cfg["batch"]] * world)[plan.table_row_wise_exchange]
        result[exchange] = {
            "bytes": {"intra_host": float(sent[0]), "cross_host": float(sent[1])},
            "planner_bytes": planner_bytes,
            "exchange_ms": _slowest_median(exchange_s, device),
            "step_ms": _slowest_median(step_s, device),
            "predicted_exchange_ms": sum(phases[p] for p in EXCHANGE_PHASES) * 1e3,
            "predicted_step_ms": report.step_time_s * 1e3,
            "predicted_exchange_ms_one_machine": sum(phases_local[p] for p in EXCHANGE_PHASES) * 1e3,
            "predicted_step_ms_one_machine": local.step_time_s * 1e3,
        }
        del ebc, scheme, pooled, blocks, out, handle, inp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["first_step_outputs_equal"] = bool(torch.equal(first["flat"], first["hierarchical"]))
    return result


def _phase_names() -> tuple[str, ...]:
    from embshard.planner.loads import PHASES

    return PHASES


def _mib(x: float) -> str:
    return f"{x / (1 << 20):.2f} MiB"


def format_result(result: dict) -> str:
    """One line per exchange."""
    lines = [
        f"table-row-wise exchange, {result['world_size']} ranks as {result['world_size'] // result['local_world_size']}"
        f" hosts x {result['local_world_size']}; workload {result['workload']}; topology {result['topology']}"
    ]
    for exchange in ("flat", "hierarchical"):
        r = result[exchange]
        b, p = r["bytes"], r["planner_bytes"]
        lines.append(
            f"{exchange:>12}: bytes/step inside hosts {_mib(b['intra_host'])} (planner {_mib(p['intra_host'])}), "
            f"between hosts {_mib(b['cross_host'])} (planner {_mib(p['cross_host'])}); exchange "
            f"{r['exchange_ms']:.3f} ms (predicted {r['predicted_exchange_ms']:.3f}, one machine "
            f"{r['predicted_exchange_ms_one_machine']:.3f}); step {r['step_ms']:.3f} ms (predicted "
            f"{r['predicted_step_ms']:.3f}, one machine {r['predicted_step_ms_one_machine']:.3f})"
        )
    lines.append(f"first step's outputs equal: {result['first_step_outputs_equal']}")
    return "\n".join(lines)


def result_lines(result: dict) -> list[str]:
    """One `RESULT key=value ...` line per exchange (bench/report.py reads them)."""
    out = []
    for exchange in ("flat", "hierarchical"):
        r = result[exchange]
        fields = {
            "bench": "hier_exchange",
            "exchange": exchange,
            "world": result["world_size"],
            "local_world": result["local_world_size"],
            "intra_mib": f"{r['bytes']['intra_host'] / (1 << 20):.3f}",
            "cross_mib": f"{r['bytes']['cross_host'] / (1 << 20):.3f}",
            "planner_intra_mib": f"{r['planner_bytes']['intra_host'] / (1 << 20):.3f}",
            "planner_cross_mib": f"{r['planner_bytes']['cross_host'] / (1 << 20):.3f}",
            "exchange_ms": f"{r['exchange_ms']:.3f}",
            "step_ms": f"{r['step_ms']:.3f}",
            "predicted_exchange_ms": f"{r['predicted_exchange_ms']:.3f}",
            "predicted_step_ms": f"{r['predicted_step_ms']:.3f}",
            "predicted_exchange_ms_one_machine": f"{r['predicted_exchange_ms_one_machine']:.3f}",
            "predicted_step_ms_one_machine": f"{r['predicted_step_ms_one_machine']:.3f}",
        }
        out.append(result_line(fields))
    return out


def _run(args: argparse.Namespace) -> None:
    from embshard.planner import Topology
    from embshard.runtime.distributed import init_distributed

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(SMOKE if args.smoke else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    topo = Topology.load(args.topology).with_sizes(world, args.local_world_size) if args.topology else None
    result = measure(rank, world, device, cfg, args.local_world_size, topo)
    if rank == 0:
        print(format_result(result))
        print("\n".join(result_lines(result)))
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local-world-size", type=int, default=2, help="ranks per host (default 2)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--spawn", type=int, default=0, help="start this many local processes (no torchrun)")
    ap.add_argument("--topology", default="", help="plan predictions on this `embshard calibrate` file")
    ap.add_argument("--out", default="", help="also write the JSON result here (rank 0)")
    for key in FULL:
        ap.add_argument(f"--{key}", type=int, default=None, help=f"workload: {key} (default {FULL[key]})")
    args = ap.parse_args()
    if args.spawn:
        from embshard.runtime.distributed import spawn_local

        spawn_local(_run, args.spawn, args)
    else:
        _run(args)


if __name__ == "__main__":
    main()
