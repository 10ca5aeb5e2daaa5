"""Measurements for `embshard calibrate`: the small-table kernel's and the regroup's constants (cost.py).

`calibrate_kernels(hbm_bw, l2_bytes)` times the small-table kernel (rowwise adagrad; forward, forward + backward
with the default atomic backward, with the first version's (one add per id, one table after another: its hot-row
chains in sequence) and with the sorted backward) on cost.CALIBRATION_CASES and fits fwd_id_s, atomic_sector_s,
same_row_s and sorted_id_s (cost.fit), then times the regroup forward + backward on a 16-wide and a 128-wide
layout and takes the share of `hbm_bw` it reaches (the lower of the two). Returns cost.KernelConstants and prints
one line per case. GPU only; `embshard calibrate` passes its measured copy bandwidth and L2 size.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from embshard.planner.kernel_model import CALIBRATION_CASES, CalibrationCase, KernelConstants, fit, regroup_bytes


def zipf_ids(T: int, n: int, rows: int, alpha: float, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """T x n ids (table-major) in [0, rows): uniform (alpha 0) or Zipf(alpha) by inverse CDF over the rows, the
    popular rows spread by a random permutation per table."""
    if alpha == 0:
        return torch.randint(0, rows, (T * n,), device=device, generator=gen)
    k = torch.arange(1, rows + 1, dtype=torch.float64, device=device)
    cdf = (k**-alpha).cumsum(0)
    cdf /= cdf[-1].clone()
    out = []
    for _ in range(T):
        u = torch.rand(n, dtype=torch.float64, device=device, generator=gen)
        rank = torch.searchsorted(cdf, u).clamp_(max=rows - 1)
        out.append(torch.randperm(rows, device=device, generator=gen)[rank])
    return torch.cat(out)


def queued_seconds(fn: Callable[[], None], iters: int, device: str | torch.device) -> float:
    """Seconds per fn() with `iters` calls queued back to back (CUDA events on GPUs, so host launch overhead
    hides behind the kernels as it does in training; wall clock on the CPU), after 2 warm-ups."""
    for _ in range(2):
        fn()
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_small_table(
    case: CalibrationCase, iters: int, device: str = "cuda"
) -> tuple[float, float, float, int, float]:
    """(forward, backward, sorted backward) seconds per call, the distinct rows the ids touch, and the first
    version's backward (no dedup, one table after another) seconds."""
    from embshard.kernels.layout import Tiles
    from embshard.kernels.small_tables import SmallTableLookup, SmallTableOptions
    from embshard.lookup import LocalShard
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import MemoryTier, Shard
    from embshard.spec.tables import TableConfig

    dev = torch.device(device)
    T, R, D, L, B = case.tables, case.rows, case.dim, case.ids_per_bag, case.batch
    tables = [TableConfig(f"t{i}", R, D, (f"f{i}",)) for i in range(T)]
    tier = MemoryTier.HBM if dev.type == "cuda" else MemoryTier.HOST
    shards = [LocalShard(t, i, Shard(0, 0, R, 0, D), t.feature_names, tier) for i, t in enumerate(tables)]
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = zipf_ids(T, B * L, R, case.alpha, dev, gen)
    distinct = sum(int(torch.unique(ids[t * B * L : (t + 1) * B * L]).numel()) for t in range(T))
    offsets = torch.arange(0, T * B * L + 1, L, device=dev)
    grad = torch.ones(B, T * D, device=dev)
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    times = []
    variants = (SmallTableOptions(), SmallTableOptions(deterministic=True))
    for kernel in (*variants, SmallTableOptions(tiles=Tiles(dedup=False, interleave=1))):
        m = SmallTableLookup(shards, opt, dev, seed=None, kernel=kernel)

        def fwd(m=m) -> None:
            with torch.no_grad():
                m(ids, offsets)

        def step(m=m) -> None:
            m(ids, offsets).backward(grad)

        f = queued_seconds(fwd, iters, dev)
        times.append((f, max(queued_seconds(step, iters, dev) - f, 0.0)))
        del m
    return times[0][0], times[0][1], times[1][1], distinct, times[2][1]


def regroup_layout(n_keys: int, width: int, seed: int = 0):
    """(keys, dims, groups): 3 blocks of `n_keys` keys `width` wide in all; two groups, 90% of the keys shuffled
    (the rest unused) and a third of those again (duplicates)."""
    g = torch.Generator().manual_seed(seed)
    names = [f"k{i}" for i in range(n_keys)]
    cut = [0, max(1, n_keys // 3), max(2, 2 * n_keys // 3), n_keys]
    keys = [names[cut[i] : cut[i + 1]] for i in range(3)]
    dims = [[width] * len(k) for k in keys]
    order = [names[i] for i in torch.randperm(n_keys, generator=g).tolist()]
    used = order[: n_keys - max(1, n_keys // 10)]
    return keys, dims, {"all": used, "dup": used[: max(1, len(used) // 3)]}


def measure_regroup(n_keys: int, width: int, batch: int, iters: int, device: str = "cuda") -> tuple[float, float]:
    """(seconds, bytes) of the regroup kernel's forward + backward (fp32) on `regroup_layout(n_keys, width)`."""
    from embshard.collection.regroup_kernel import KernelRegroup  # upward: times the regroup the collection runs

    keys, dims, groups = regroup_layout(n_keys, width)
    used = groups["all"]
    rg = KernelRegroup(keys, dims, groups)
    blocks = [torch.randn(batch, sum(d), device=device, requires_grad=True) for d in dims]
    grads = [torch.randn(batch, w, device=device) for w in rg.out_dims]

    def step() -> None:
        out = rg(blocks)
        torch.autograd.grad(list(out.values()), blocks, grads)

    out_cols = sum(rg.out_dims)
    fwd, bwd = regroup_bytes(batch, 4, n_keys * width, len(used) * width, out_cols)
    return queued_seconds(step, iters, torch.device(device)), fwd + bwd


def calibrate_kernels(
    hbm_bw: float, l2_bytes: float, iters: int = 10, log: Callable[[str], None] = print
) -> KernelConstants:
    """Measure and fit the kernels' constants on this GPU (module docstring)."""
    measured, distinct, sorted_bwd, chained = [], [], [], []
    for case in CALIBRATION_CASES:
        f, b, s, u, v1 = measure_small_table(case, iters)
        measured.append((f, b))
        distinct.append(float(u))
        sorted_bwd.append(s)
        chained.append(v1)
        n = case.ids
        log(
            f"  small tables {case.name:28s} {n:>9d} ids: forward {f / n * 1e9:.3f} ns/id, backward {b / n * 1e9:.3f} "
            f"ns/id (sorted {s / n * 1e9:.3f}, first version {v1 / n * 1e9:.3f})"
        )
    k = fit(CALIBRATION_CASES, distinct, measured, hbm_bw, l2_bytes, sorted_bwd, chained)
    shares = []
    for n_keys, width in ((1500, 16), (100, 128)):
        seconds, nbytes = measure_regroup(n_keys, width, 16384, iters)
        shares.append(nbytes / seconds / hbm_bw)
        log(f"  regroup {n_keys} keys x {width} fp32: {seconds * 1e3:.3f} ms, {100 * shares[-1]:.0f}% of copy")
    k = KernelConstants(k.fwd_id_s, k.atomic_sector_s, k.same_row_s, k.sorted_id_s, min(1.0, min(shares)))
    log(
        f"small-table kernel: {k.fwd_id_s * 1e12:.1f} ps/id forward, {k.atomic_sector_s * 1e12:.1f} ps per atomic "
        f"sector, {k.same_row_s * 1e9:.2f} ns per id on one row, sorted {k.sorted_id_s * 1e12:.1f} ps/id; regroup "
        f"at {100 * k.regroup_efficiency:.0f}% of copy"
    )
    return k
