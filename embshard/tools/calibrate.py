"""`embshard calibrate`: measure this machine's speeds and write a topology YAML the planner loads
(`embshard plan ... --topology FILE`).

Measured on GPUs: device memory copy (hbm_bw, read + write counted), host<->device copies (printed), row reads
from host memory over the host link at two row widths (uvm_bw and uvm_row_s: 128- and 512-byte rows of 512 MiB
tables; with --uvm-large-gib also a table beyond the translation reach, uvm_page_s), the all-to-all bandwidth
between the local GPUs (intra_host_bw, NCCL, when there are 2 or more), and FBGEMM's TBE lookups, forward and
backward apart, at two row widths (16 and 128 columns) and two access patterns (tiny tables read from L2, large
ones from HBM): the time per id and per touched row beyond what the cost model's byte counts explain
(fwd_id_s, fwd_byte_s, bwd_id_s, bwd_byte_s, bwd_row_s; least squares over the cases), and embshard's own
kernels (embshard/kernels/calibrate.py: the small-table kernel's small_fwd_id_s, small_atomic_sector_s,
small_same_row_s, small_sorted_id_s and the Triton regroup's regroup_efficiency; needs Triton). On CPUs: memory
copy (ddr_bw), the all-to-all bandwidth between 2 local processes (gloo) and the same lookup fit on the CPU
kernels. What cannot be measured here (inter-host links; HBM, UVM and the GPU kernels' constants on a CPU
machine) keeps the preset value and is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from embshard.planner.kernel_model import CalibrationCase, nonneg_lstsq
from embshard.planner.topology import Topology
from embshard.planner.units import GB, GIB, KERNEL_FIELDS


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


def measure_uvm_row(table_bytes: int, dim: int, iters: int) -> float | None:
    """Seconds per random row read by the GPU from a `table_bytes` table of fp32 rows `dim` wide in host memory
    (FBGEMM's managed UVM tensor, as its TBEs use; None if FBGEMM cannot make one)."""
    import torch

    rows = max(1, table_bytes // (dim * 4))
    try:
        import fbgemm_gpu  # noqa: F401

        like = torch.zeros(1, device="cuda", dtype=torch.float32)
        table = torch.ops.fbgemm.new_unified_tensor(like, [rows, dim], is_host_mapped=False)
        table.zero_()  # place every page in host memory and map it before timing
    except Exception:  # noqa: BLE001 - any failure means: not measurable here
        return None
    n = min(rows, 1 << 20)
    idx = torch.randint(0, rows, (n,), device="cuda")
    seconds = _timed(lambda: torch.index_select(table, 0, idx), iters, torch.cuda.synchronize)
    return seconds / n


def fit_uvm(t128: float, t512: float) -> tuple[float, float]:
    """(uvm_bw, uvm_row_s) from the seconds per row read of 128- and 512-byte rows: t = uvm_row_s + rb / uvm_bw
    (both row sizes are whole 64-byte sectors). If the two do not give a positive slope and intercept, the
    512-byte rate alone: (512 / t512, 0)."""
    slope = (t512 - t128) / 384.0
    if slope > 0 and t128 - 128 * slope >= 0:
        return 1.0 / slope, t128 - 128 * slope
    return 512.0 / t512, 0.0


# ---- FBGEMM lookups ---------------------------------------------------------------------------------------------
GPU_CASES = (
    CalibrationCase("16-wide, 10k rows (L2)", 16, 10_000, 16, 30, 8192),
    CalibrationCase("16-wide, 1M rows (HBM)", 8, 1_000_000, 16, 10, 16384),
    CalibrationCase("128-wide, 1M rows (HBM)", 8, 1_000_000, 128, 10, 16384),
)
CPU_CASES = (
    CalibrationCase("16-wide, 2k rows", 4, 2_000, 16, 30, 256),
    CalibrationCase("16-wide, 200k rows", 4, 200_000, 16, 10, 512),
    CalibrationCase("128-wide, 200k rows", 4, 200_000, 128, 10, 512),
)


def measure_lookup(case: CalibrationCase, device: str, iters: int) -> tuple[float, float] | None:
    """(forward, backward) seconds per call of one FBGEMM TBE (row-wise Adagrad fused into the backward) over the
    case's tables with uniform random ids (`case.alpha` must be 0); None if FBGEMM is missing."""
    import torch

    from embshard.kernels.calibrate import queued_seconds

    if case.alpha != 0:
        raise ValueError(f"TBE calibration case {case.name!r} has alpha {case.alpha}: its ids are uniform, set alpha 0")
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
    T, E, D, L, B = case.tables, case.rows, case.dim, case.ids_per_bag, case.batch
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(E, D, loc, comp)] * T,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        device=torch.device(device),
    )
    ids = torch.randint(0, E, (T * B * L,), device=device)
    offsets = torch.arange(0, T * B * L + 1, L, device=device)
    grad = torch.ones(B, T * D, device=device)

    def forward() -> None:
        with torch.no_grad():
            tbe(ids, offsets)

    def step() -> None:
        tbe(ids, offsets).backward(grad)

    fwd = queued_seconds(forward, iters, device)
    both = queued_seconds(step, iters, device)
    return fwd, max(both - fwd, 0.0)


def _bytes_model(topo: Topology, case: CalibrationCase):
    """(forward, backward, ids, touched rows) the cost model gives for a case without its per-id constants."""
    from embshard.planner.cost import CostModel, TableStats, distinct_rows
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import MemoryTier, ShardingType
    from embshard.spec.tables import TableConfig

    bare = replace(
        topo.with_sizes(1, 1),
        fwd_id_s=0.0,
        fwd_byte_s=0.0,
        bwd_id_s=0.0,
        bwd_byte_s=0.0,
        bwd_row_s=0.0,
        routed_id_s=0.0,
        bag_s=0.0,
    )
    model = CostModel(bare, case.batch, FusedOptimizerConfig("rowwise_adagrad"))
    stats = TableStats.one(TableConfig("calibration", case.rows, case.dim, ("f",), ids_per_bag=case.ids_per_bag))
    tier = MemoryTier.HBM if topo.is_gpu else MemoryTier.HOST
    wk = model.work(stats, ShardingType.TABLE_WISE, tier, float(case.rows), float(case.dim))
    n = float(case.batch * case.ids_per_bag)
    u = float(distinct_rows(n, float(case.rows), 0.0))
    T = case.tables
    return T * float(wk.fwd_s), T * float(wk.bwd_s), T * n, T * u, case.dim * 4.0


def fit_lookup(topo: Topology, cases: Sequence[CalibrationCase], measured: Sequence[tuple[float, float]]) -> dict:
    """The per-id constants that best explain the measured (forward, backward) seconds of the cases on top of the
    cost model's bytes: forward n*(fwd_id_s + rb*fwd_byte_s), backward n*(bwd_id_s + rb*bwd_byte_s) +
    u*bwd_row_s (n ids, u touched rows, rb row bytes); least squares on relative errors, each constant >= 0.
    The cases must vary the row width and the share of repeated ids (GPU_CASES, CPU_CASES). A time of 0 (the
    backward is the step's time less the forward's, which a noisy clock can make 0) tells nothing and is left out;
    with no time left, that direction's constants are 0."""
    rows_f, rhs_f, rows_b, rhs_b = [], [], [], []
    for case, (fwd, bwd) in zip(cases, measured):
        f0, b0, n, u, rb = _bytes_model(topo, case)
        if fwd > 0:
            rows_f.append([n / fwd, n * rb / fwd])
            rhs_f.append((fwd - f0) / fwd)
        if bwd > 0:
            rows_b.append([n / bwd, n * rb / bwd, u / bwd])
            rhs_b.append((bwd - b0) / bwd)
    fwd_id, fwd_byte = nonneg_lstsq(np.array(rows_f), np.array(rhs_f)) if rows_f else (0.0, 0.0)
    bwd_id, bwd_byte, bwd_row = nonneg_lstsq(np.array(rows_b), np.array(rhs_b)) if rows_b else (0.0, 0.0, 0.0)
    return {
        "fwd_id_s": float(fwd_id),
        "fwd_byte_s": float(fwd_byte),
        "bwd_id_s": float(bwd_id),
        "bwd_byte_s": float(bwd_byte),
        "bwd_row_s": float(bwd_row),
    }


def lookup_report(topo: Topology, cases: Sequence[CalibrationCase], measured: Sequence[tuple[float, float]]) -> str:
    """One line per case: measured and modelled time per id, forward and backward."""
    lines = []
    for case, (fwd, bwd) in zip(cases, measured):
        f0, b0, n, u, rb = _bytes_model(topo, case)
        mf = f0 + n * (topo.fwd_id_s + rb * topo.fwd_byte_s)
        mb = b0 + n * (topo.bwd_id_s + rb * topo.bwd_byte_s) + u * topo.bwd_row_s
        lines.append(
            f"  {case.name:26s} {case.ids:>9d} ids: forward {fwd / n * 1e9:.3f} ns/id (model {mf / n * 1e9:.3f}), "
            f"backward {bwd / n * 1e9:.3f} ns/id (model {mb / n * 1e9:.3f})"
        )
    return "\n".join(lines)


# ---- collectives ------------------------------------------------------------------------------------------------
def _a2a_worker(nbytes: int, iters: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from embshard.runtime.distributed import init_distributed

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
    from embshard.runtime.distributed import spawn_local

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a2a.json")
        spawn_local(_a2a_worker, nproc, nbytes, iters, out)
        return json.loads(Path(out).read_text())["bus_bw"]


def _small_kernel(topo: Topology, iters: int, log) -> dict:
    """The small-table kernel's and the regroup's constants measured on this GPU (embshard/kernels/calibrate.py),
    as Topology fields; {} when they cannot be measured (no Triton)."""
    try:
        from embshard.kernels.calibrate import calibrate_kernels

        k = calibrate_kernels(topo.hbm_bw, float(topo.l2_bytes), max(3, iters // 2), log)
    except Exception as e:  # noqa: BLE001 - Triton missing or the kernel failing: the planner keeps its estimates
        log(f"small-table kernel: not measured ({type(e).__name__}: {e}); preset estimates kept")
        return {}
    return {
        "small_fwd_id_s": k.fwd_id_s,
        "small_atomic_sector_s": k.atomic_sector_s,
        "small_same_row_s": k.same_row_s,
        "small_sorted_id_s": k.sorted_id_s,
        "regroup_efficiency": k.regroup_efficiency,
    }


# ---- all of it --------------------------------------------------------------------------------------------------
def calibrate(
    size_mib: int = 256, iters: int = 10, collectives: bool = True, kernels: bool = True, uvm_large_gib: float = 0.0
) -> Topology:
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
        t128 = measure_uvm_row(512 << 20, 32, iters)
        t512 = measure_uvm_row(512 << 20, 128, iters) if t128 is not None else None
        if t128 is None or t512 is None:
            kw["uvm_bw"], kw["uvm_row_s"] = 0.7 * min(link.values()), 0.0
            log("UVM row reads: FBGEMM UVM tensors unavailable; using 0.7 x the pinned copy bandwidth")
        else:
            kw["uvm_bw"], kw["uvm_row_s"] = fit_uvm(t128, t512)
            log(
                f"UVM row reads (512 MiB tables): 128 B rows {t128 * 1e9:.2f} ns, 512 B rows {t512 * 1e9:.2f} ns "
                f"-> {kw['uvm_row_s'] * 1e9:.2f} ns + bytes / {kw['uvm_bw'] / GB:.1f} GB/s per row"
            )
            if uvm_large_gib > 2:
                big = measure_uvm_row(int(uvm_large_gib * GIB), 128, iters)
                if big is not None:
                    share = 1.0 - 2.0 / uvm_large_gib
                    kw["uvm_page_s"] = max(0.0, big - t512) / share
                    measured.append("uvm_page_s")
                    log(
                        f"UVM row reads, {uvm_large_gib:g} GiB table: {big * 1e9:.2f} ns per 512 B row -> "
                        f"{kw['uvm_page_s'] * 1e9:.1f} ns per access beyond the 2 GiB reach"
                    )
            measured.append("uvm_row_s")
        measured.append("uvm_bw")
        n_gpus = torch.cuda.device_count()
        if collectives and n_gpus > 1:
            kw["intra_host_bw"] = measure_all_to_all(n_gpus, nbytes, iters)
            measured.append("intra_host_bw")
            log(f"all-to-all over {n_gpus} GPUs (NCCL): {kw['intra_host_bw'] / GB:.0f} GB/s bus bandwidth per rank")
        else:
            log("all-to-all: one GPU (or --no-collectives): intra_host_bw keeps the preset value")
        props = torch.cuda.get_device_properties(0)
        if getattr(props, "L2_cache_size", 0):
            kw["l2_bytes"] = int(props.L2_cache_size)
            log(f"L2 cache: {kw['l2_bytes'] / (1 << 20):.0f} MiB")
        device, cases = "cuda", GPU_CASES
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
        device, cases = "cpu", CPU_CASES
    if kernels:
        times = []
        for case in cases:
            got = measure_lookup(case, device, max(3, iters // 2))
            if got is None:
                break
            times.append(got)
        if len(times) < len(cases):
            log("lookup cost per id: FBGEMM missing; preset kept")
        else:
            now = replace(topo, **kw)
            kw.update(fit_lookup(now, cases, times))
            measured += ["fwd_id_s", "fwd_byte_s", "bwd_id_s", "bwd_byte_s", "bwd_row_s"]
            log(
                f"FBGEMM lookups beyond the modelled bytes: forward {kw['fwd_id_s'] * 1e9:.3f} ns per id + "
                f"{kw['fwd_byte_s'] * 1e12:.2f} ps per row byte; backward {kw['bwd_id_s'] * 1e9:.3f} ns per id + "
                f"{kw['bwd_byte_s'] * 1e12:.2f} ps per row byte + {kw['bwd_row_s'] * 1e9:.3f} ns per touched row:"
            )
            log(lookup_report(replace(now, **kw), cases, times))
    if kernels and device == "cuda":
        kw.update(_small_kernel(replace(topo, **kw), iters, log))
        measured += [k for k in (*KERNEL_FIELDS, "regroup_efficiency") if k in kw]
    elif kernels:
        log("small-table kernel and regroup: GPU kernels, not measurable here; preset estimates kept")
    log("inter-host links cannot be measured from one host: inter_host_bw keeps the preset value")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return replace(topo, **kw, measured=tuple(measured), source=f"calibrated {stamp} on {topo.device_name}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="embshard calibrate", description=__doc__)
    p.add_argument("--out", default="runs/topology.yaml", help="topology YAML to write (default runs/topology.yaml)")
    p.add_argument("--size-mib", type=int, default=256, help="buffer size of the bandwidth tests (MiB)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per test (median is kept)")
    p.add_argument("--no-collectives", action="store_true", help="skip the multi-process all-to-all test")
    p.add_argument(
        "--no-kernels", action="store_true", help="skip the lookup kernel tests (FBGEMM's and the small-table kernel's)"
    )
    p.add_argument(
        "--uvm-large-gib",
        type=float,
        default=0.0,
        help="also read rows of a table this large in host memory (GiB, > 2; e.g. 10) to measure uvm_page_s",
    )
    args = p.parse_args(argv)
    topo = calibrate(args.size_mib, args.iters, not args.no_collectives, not args.no_kernels, args.uvm_large_gib)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    topo.save(args.out)
    print(f"wrote {args.out}: {topo.describe()}", file=sys.stderr)
    print(f"use it with: embshard plan CONFIG.yaml --world-size N --topology {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
