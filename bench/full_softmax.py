"""Sharded full softmax over a row-sharded catalog (1M x 64 on 2 GPUs, batch 8192 per GPU): peak memory and step
time against the materialized softmax, and its loss and gradients against the materialized one.

    torchrun --nproc-per-node 2 -m bench.full_softmax              # 1M x 64, batch 8192 per GPU, about 1 minute
    torchrun --nproc-per-node 2 -m bench.full_softmax --cpu        # dry run on 2 CPU processes (gloo), small sizes

sharded: embshard.retrieval.Catalog.full_softmax_loss (each rank scores the global batch against its row block in
chunks of --chunk-mib; the item rows' gradient goes to the fused optimizer, SGD with lr 1 here). materialized: on
each rank, its local queries against the whole table gathered on the GPU, `logits [B_local, N] = q E^T` and
torch.nn.functional.cross_entropy: the least memory a materialized softmax can take (the global batch would
need W times more); if it does not fit, the table says OOM and gives its logits' size. Memory: peak
torch.cuda.max_memory_allocated() during one forward + backward minus the memory allocated before it, max over
ranks. Time: median of --steps steps (CUDA events). Check: per-query loss, query gradients and item-row gradients
(SGD step with lr 1: rows before - rows after, against the materialized gradient summed over ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from embshard import simple_plan  # noqa: E402
from embshard.retrieval import Catalog, gather_rows, gather_sizes  # noqa: E402
from embshard.spec.optim import FusedOptimizerConfig  # noqa: E402
from embshard.spec.tables import TableConfig  # noqa: E402

GiB = float(1 << 30)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device: torch.device) -> tuple[float, float]:
    """(extra bytes at the peak of fn() over what was allocated before it, milliseconds); bytes 0 on the CPU."""
    sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return float(peak), ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8192, help="queries per GPU")
    ap.add_argument("--chunk-mib", type=float, default=256.0)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of the sharded softmax")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (both methods)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, 20,000 x 16 items, batch 64")
    args = ap.parse_args()
    if args.cpu:
        args.items, args.dim, args.batch, args.steps = 20_000, 16, 64, 2
    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
    table = TableConfig("t_item", args.items, args.dim, ("item",))
    plan = simple_plan([table], world, sharding_types={"t_item": "row_wise"}, tier="hbm" if cuda else "host")
    catalog = Catalog(table, plan, FusedOptimizerConfig("sgd", lr=1.0), device, seed=0, chunk_mib=args.chunk_mib)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    q = (torch.randn(args.batch, args.dim, device=device, generator=gen) * 0.5).requires_grad_(True)
    t = torch.randint(0, args.items, (args.batch,), device=device, generator=gen)
    ((_, _, block),) = catalog.ebc.local_shards()
    before = block.detach().clone()

    def sharded_step():
        loss = catalog.full_softmax_loss(q, t)
        loss.sum().backward()
        return loss.detach()

    out = {}
    mem, _ = measure(lambda: out.setdefault("loss", sharded_step()), device)
    loss_sharded, grad_q = out["loss"], q.grad.clone()
    grad_rows = before - block.detach()  # SGD, lr 1
    times = []
    for _ in range(args.steps):
        q.grad = None
        times.append(measure(sharded_step, device)[1])
    results = {"sharded": (mem, statistics.median(times))}

    # materialized: local queries against the whole (pre-step) table, gathered on the device
    sizes = gather_sizes(before.shape[0], device)
    full = gather_rows(before, sizes)
    logits_bytes = args.batch * args.items * 4
    check = None
    try:
        qm = q.detach().clone().requires_grad_(True)
        em = full.clone().requires_grad_(True)
        del full
        got = {}

        def materialized_step():
            loss = F.cross_entropy(qm @ em.t(), t, reduction="none")
            loss.sum().backward()
            got["loss"] = loss.detach()

        mem_m, _ = measure(materialized_step, device)
        times_m = []
        for _ in range(max(1, args.steps // 2)):
            qm.grad = em.grad = None
            times_m.append(measure(materialized_step, device)[1])
        results["materialized"] = (mem_m, statistics.median(times_m))
        dist.all_reduce(em.grad)
        r0 = catalog.row_offset
        check = (
            float((got["loss"] - loss_sharded).abs().max()),
            float((qm.grad - grad_q).abs().max()),
            float((em.grad[r0 : r0 + grad_rows.shape[0]] - grad_rows).abs().max()),
        )
    except torch.cuda.OutOfMemoryError:
        results["materialized"] = (None, None)
        torch.cuda.empty_cache()
    mems = [None] * world
    dist.all_gather_object(mems, (results, check))
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(
            f"# bench/full_softmax.py: {world} x {name}, {args.items:,} items x {args.dim}, batch {args.batch} per rank"
        )
        print("| method | peak extra memory GiB (max over ranks) | ms/step (rank 0) |")
        print("| --- | ---: | ---: |")
        for method in ("sharded", "materialized"):
            peaks = [m[0][method][0] for m in mems]
            ms = mems[0][0][method][1]
            peak = "OOM" if any(p is None for p in peaks) else f"{max(peaks) / GiB:.3f}"
            print(f"| {method} | {peak} | {'-' if ms is None else f'{ms:.1f}'} |")
        print(f"materialized logits alone: [{args.batch}, {args.items:,}] fp32 = {logits_bytes / GiB:.2f} GiB per rank")
        sharded_peak = max(m[0]["sharded"][0] for m in mems)
        mat = [m[0]["materialized"][0] for m in mems]
        if cuda:
            ref = max(mat) if all(p is not None for p in mat) else 2 * logits_bytes  # OOM: logits + their gradient
            word = "" if all(p is not None for p in mat) else "at most "
            print(f"sharded / materialized peak: {word}{sharded_peak / ref:.2%} (target <= 10%)")
            mat_peak = "oom" if word else f"{ref / GiB:.3f}"
            mat_ms = mems[0][0]["materialized"][1]
            print(
                f"RESULT framework=embshard bench=retrieval items={args.items} dim={args.dim} batch_per_rank={args.batch} "
                f"world={world} sharded_peak_gib={sharded_peak / GiB:.3f} materialized_peak_gib={mat_peak} "
                f"logits_gib={logits_bytes / GiB:.3f} peak_share={sharded_peak / ref:.4f} "
                f"sharded_ms={mems[0][0]['sharded'][1]:.2f} materialized_ms={'nan' if mat_ms is None else f'{mat_ms:.2f}'}"
            )
        checks = [m[1] for m in mems]
        if all(c is not None for c in checks):
            worst = [max(c[i] for c in checks) for i in range(3)]
            print(
                f"max |sharded - materialized|: loss {worst[0]:.2e}, query grad {worst[1]:.2e}, row grad {worst[2]:.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
