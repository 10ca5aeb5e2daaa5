"""`embshard calibrate`: measure this machine's speeds and write a topology YAML the planner loads
(`embshard plan ... --topology FILE`).

Measured on GPUs: device memory copy (hbm_bw, read + write counted), host<->device copies (printed), row gathers
from host-mapped memory over the host link (uvm_bw), the all-to-all bandwidth between the local GPUs
(intra_host_bw, NCCL, when there are 2 or more), and FBGEMM lookup cost per id (lookup_id_s, with --kernels).
On CPUs: memory copy (ddr_bw), the all-to-all bandwidth between 2 local processes (gloo) and the CPU lookup cost
per id. What cannot be measured here (inter-host links; HBM and UVM on a CPU machine) keeps the preset value and
is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from embshard.planner.topology import GB, Topology


def _timed(fn, iters: int, sync) -> float:
    """Median seconds of fn() over `iters` runs after 2 warm-ups."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_copy(device: str, nbytes: int, iters: int) -> float:
    """Bytes moved per second (read + write) by a large tensor copy on `device`."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), iters, sync)


def measure_host_link(nbytes: int, iters: int) -> dict[str, float]:
    """Pinned host->device and device->host copy bandwidth (bytes/s)."""
    import torch

    host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    sync = torch.cuda.synchronize
    h2d = nbytes / _timed(lambda: dev.copy_(host, non_blocking=True), iters, sync)
    d2h = nbytes / _timed(lambda: host.copy_(dev, non_blocking=True), iters, sync)
    return {"h2d": h2d, "d2h": d2h}


def measure_uvm_gather(rows: int, dim: int, iters: int) -> float | None:
    """Bytes per second of random row gathers by the GPU from host-mapped memory (None if FBGEMM cannot make one)."""
    import torch

    try:
        import fbgemm_gpu  # noqa: F401

        like = torch.zeros(1, device="cuda", dtype=torch.float32)
        table = torch.ops.fbgemm.new_unified_tensor(like, [rows, dim], is_host_mapped=True)
    except Exception:  # noqa: BLE001 - any failure means: not measurable here
        return None
    n = min(rows, 1 << 20)
    idx = torch.randint(0, rows, (n,), device="cuda")
    seconds = _timed(lambda: torch.index_select(table, 0, idx), iters, torch.cuda.synchronize)
    return n * dim * 4 / seconds


LOOKUP_SHAPE = {"tables": 8, "rows": 10_000, "dim": 16, "ids_per_bag": 30}


def measure_lookup(device: str, iters: int) -> tuple[float, int] | None:
    """(seconds, batch) of one FBGEMM TBE forward + backward (row-wise Adagrad) over LOOKUP_SHAPE tables; None if
    FBGEMM is missing."""
    import torch

    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    gpu = device.startswith("cuda")
    loc, comp = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if gpu else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    T, E, D, L = (LOOKUP_SHAPE[k] for k in ("tables", "rows", "dim", "ids_per_bag"))
    B = 4096 if gpu else 512
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(E, D, loc, comp)] * T,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        device=torch.device(device),
    )
    ids = torch.randint(0, E, (T * B * L,), device=device)
    offsets = torch.arange(0, T * B * L + 1, L, device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def step() -> None:
        tbe(ids, offsets).sum().backward()

    return _timed(step, iters, sync), B


def lookup_residual(topo: Topology, seconds: float, batch: int) -> float:
    """Per-id time the cost model's byte counts do not explain: (measured - modelled) / ids, at least 0."""
    from embshard.optim import FusedOptimizerConfig
    from embshard.plan import MemoryTier, ShardingType
    from embshard.planner.cost import CostModel, TableStats
    from embshard.tables import TableConfig

    T, E, D, L = (LOOKUP_SHAPE[k] for k in ("tables", "rows", "dim", "ids_per_bag"))
    bare = replace(topo.with_sizes(1, 1), lookup_id_s=0.0, routed_id_s=0.0)
    model = CostModel(bare, batch, FusedOptimizerConfig("rowwise_adagrad"))
    stats = TableStats.one(TableConfig("calibration", E, D, ("f",), ids_per_bag=L))
    tier = MemoryTier.HBM if topo.is_gpu else MemoryTier.HOST
    wk = model.work(stats, ShardingType.TABLE_WISE, tier, float(E), float(D))
    modelled = T * float(wk.fwd_s + wk.bwd_s)
    return max(0.0, (seconds - modelled) / (T * batch * L))


def _a2a_worker(nbytes: int, iters: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from embshard.distributed import init_distributed

    device = init_distributed()
    world = dist.get_world_size()
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run() -> None:
        dist.all_to_all_single(y, x)

    seconds = torch.tensor([_timed(run, iters, sync)], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"bus_bw": nbytes * (world - 1) / world / float(seconds)}))
    dist.destroy_process_group()


def measure_all_to_all(nproc: int, nbytes: int, iters: int) -> float:
    """All-to-all bus bandwidth per rank (bytes/s each way) between `nproc` local processes (NCCL or gloo)."""
    from embshard.distributed import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a2a.json")
        spawn_local(_a2a_worker, nproc, nbytes, iters, out)
        return json.loads(Path(out).read_text())["bus_bw"]


def calibrate(size_mib: int = 256, iters: int = 10, collectives: bool = True, kernels: bool = True) -> Topology:
    """Measure what this machine allows; returns the detected topology with the measured fields replaced."""
    import torch

    topo = Topology.detect()
    nbytes = size_mib << 20
    measured: list[str] = []
    kw: dict = {}
    log = print
    if torch.cuda.is_available():
        kw["hbm_bw"] = measure_copy("cuda", nbytes, iters)
        measured.append("hbm_bw")
        log(f"GPU memory copy: {kw['hbm_bw'] / GB:.0f} GB/s (read + write)")
        link = measure_host_link(nbytes, iters)
        log(f"host->GPU {link['h2d'] / GB:.1f} GB/s, GPU->host {link['d2h'] / GB:.1f} GB/s (pinned copies)")
        uvm = measure_uvm_gather(1 << 22, 32, iters)
        if uvm is None:
            kw["uvm_bw"] = 0.7 * min(link.values())
            log("UVM row gathers: FBGEMM host-mapped tensors unavailable; using 0.7 x the pinned copy bandwidth")
        else:
            kw["uvm_bw"] = uvm
            log(f"UVM row gathers (128 B rows): {uvm / GB:.1f} GB/s")
        measured.append("uvm_bw")
        n_gpus = torch.cuda.device_count()
        if collectives and n_gpus > 1:
            kw["intra_host_bw"] = measure_all_to_all(n_gpus, nbytes, iters)
            measured.append("intra_host_bw")
            log(f"all-to-all over {n_gpus} GPUs (NCCL): {kw['intra_host_bw'] / GB:.0f} GB/s bus bandwidth per rank")
        else:
            log("all-to-all: one GPU (or --no-collectives): intra_host_bw keeps the preset value")
        device = "cuda"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, topo.local_world_size)))
        kw["ddr_bw"] = measure_copy("cpu", nbytes, iters)
        measured.append("ddr_bw")
        log(f"host memory copy: {kw['ddr_bw'] / GB:.1f} GB/s (read + write, {torch.get_num_threads()} threads)")
        log("no GPU: GPU memory (hbm_bw) and host-link (uvm_bw) speeds cannot be measured here; presets kept")
        if collectives:
            kw["intra_host_bw"] = measure_all_to_all(2, min(nbytes, 64 << 20), max(3, iters // 2))
            measured.append("intra_host_bw")
            log(f"all-to-all between 2 processes (gloo): {kw['intra_host_bw'] / GB:.2f} GB/s per rank")
        device = "cpu"
    if kernels:
        got = measure_lookup(device, max(3, iters // 2))
        if got is None:
            log("lookup cost per id: FBGEMM missing; preset kept")
        else:
            seconds, batch = got
            n = LOOKUP_SHAPE["tables"] * LOOKUP_SHAPE["ids_per_bag"] * batch
            kw["lookup_id_s"] = lookup_residual(replace(topo, **kw), seconds, batch)
            measured.append("lookup_id_s")
            log(
                f"FBGEMM lookup forward + backward: {seconds * 1e3:.3f} ms for {n} ids ({seconds / n * 1e9:.2f} ns "
                f"per id; {kw['lookup_id_s'] * 1e9:.2f} ns per id beyond the modelled bytes)"
            )
    log("inter-host links cannot be measured from one host: inter_host_bw keeps the preset value")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return replace(topo, **kw, measured=tuple(measured), source=f"calibrated {stamp} on {topo.device_name}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="embshard calibrate", description=__doc__)
    p.add_argument("--out", default="topology.yaml", help="topology YAML to write (default topology.yaml)")
    p.add_argument("--size-mib", type=int, default=256, help="buffer size of the bandwidth tests (MiB)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per test (median is kept)")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-process all-to-all test")
    p.add_argument("--no-kernels", action="store_true", help="skip the FBGEMM lookup test")
    args = p.parse_args(argv)
    topo = calibrate(args.size_mib, args.iters, not args.no_collectives, not args.no_kernels)
    topo.save(args.out)
    print(f"wrote {args.out}: {topo.describe()}", file=sys.stderr)
    print(f"use it with: embshard plan CONFIG.yaml --world-size N --topology {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
