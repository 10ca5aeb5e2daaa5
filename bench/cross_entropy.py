"""Fused cross-entropy against eager and torch.compile on one GPU: forward + backward time and peak extra memory,
against the roofline (logits read once forward, read and written once backward, at the measured copy bandwidth).

    python -m bench.cross_entropy                     # N=16384: C=32768 fp32 and C=131072 bf16, about 1 minute
    python -m bench.cross_entropy --cpu               # dry run on the CPU (small shapes, no compile): checks the script

Each method runs `loss = cross_entropy(logits, target); torch.autograd.grad(loss, logits)` (mean reduction, every
row a valid target). fused: embshard.kernels.fused_cross_entropy with the in-place backward (the gradient is
written into the logits' buffer, so the logits hold gradient values after the first run: the timing does not
depend on them). eager: torch.nn.functional.cross_entropy. compile: the same under torch.compile. Time: median
of --reps runs timed with CUDA events after --warmup runs. Memory: torch.cuda.max_memory_allocated() during one
run minus the memory allocated before it (the logits already exist), over the logits' size; the returned gradient
counts (eager and compile allocate it, fused writes it in place). Copy bandwidth: a device-to-device copy of a
buffer of the logits' size, 2 x bytes / time (read + write). Roofline: 3 x logits bytes / copy bandwidth.
--sweep also times the fused kernels with other launch settings (block, warps) and reports the best.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F

from bench.timing import event_ms
from embshard.kernels.cross_entropy import LaunchConfig, default_launch, fused_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def extra_memory(fn, device: torch.device) -> float | None:
    """Peak bytes allocated during fn() beyond what was allocated before it (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return float(peak)


def copy_bandwidth(nbytes: int, device: torch.device, reps: int) -> float:
    """Bytes per second moved (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src), 3, reps, device)
    return 2 * nbytes / (ms * 1e-3)


def methods(impl: str, compile_: bool, launch: LaunchConfig | None):
    def fused(x, t):
        return torch.autograd.grad(fused_cross_entropy(x, t, inplace_backward=True, impl=impl, launch=launch), x)[0]

    def eager(x, t):
        return torch.autograd.grad(F.cross_entropy(x, t), x)[0]

    out = {"fused": fused, "eager": eager}
    if compile_:
        ce = torch.compile(F.cross_entropy)

        def compiled(x, t):
            return torch.autograd.grad(ce(x, t), x)[0]

        out["compile"] = compiled
    return out


def sweep_launches(C: int, dtype: torch.dtype) -> list[LaunchConfig]:
    blocks = [b for b in (1024, 2048, 4096, 8192, 16384) if b <= max(1024, C)]
    return [LaunchConfig(b, w) for b in blocks for w in (4, 8, 16) if b // (32 * w) >= 4]


def bench_case(N: int, C: int, dtype: torch.dtype, impl: str, device: torch.device, args) -> list[tuple]:
    """Rows (C, dtype, method, ms, x roofline, extra memory / logits bytes, roofline ms) of one shape."""
    nbytes = N * C * dtype.itemsize
    bw = copy_bandwidth(nbytes, device, args.reps)
    roof_ms = 3 * nbytes / bw * 1e3
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(N, C, device=device, generator=gen) * 2).to(dtype).requires_grad_(True)
    t = torch.randint(0, C, (N,), device=device, generator=gen)
    want = F.cross_entropy(x.float(), t).item()
    got = fused_cross_entropy(x, t, impl=impl).float().item()  # before any in-place backward
    print(f"C={C} {dtype}: fused loss {got:.6f}, eager fp32 loss {want:.6f}, copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for label, fn in methods(impl, device.type == "cuda", None).items():
        ms = event_ms(lambda fn=fn: fn(x, t), args.warmup, args.reps, device)
        mem = extra_memory(lambda fn=fn: fn(x, t), device)
        rows.append((C, dtype, label, ms, ms / roof_ms, None if mem is None else mem / nbytes, roof_ms))
    if args.sweep and device.type == "cuda":
        tried = [
            (event_ms(lambda c=c: methods(impl, False, c)["fused"](x, t), 2, args.reps, device), c)
            for c in sweep_launches(C, dtype)
        ]
        ms, best = min(tried, key=lambda p: p[0])
        print(f"  sweep: default {default_launch(C, dtype)}; best {best} at {ms:.3f} ms ({ms / roof_ms:.2f}x roofline)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384, help="rows (tokens, queries)")
    ap.add_argument("--cases", default="32768:fp32,131072:bf16", help="comma-separated C:dtype (fp32, bf16)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernels with other launch settings")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: N=64, C=512 and 1024, torch path")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cases = [(int(c), DTYPES[d]) for c, d in (x.split(":") for x in args.cases.split(","))]
    N = args.n
    if device.type == "cpu":
        N, cases, args.reps = 64, [(512, torch.float32), (1024, torch.bfloat16)], 3
    impl = "torch" if device.type == "cpu" else "auto"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# bench/cross_entropy.py on {name}, torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    rows = []
    for C, dtype in cases:
        rows += bench_case(N, C, dtype, impl, device, args)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print(f"N = {N}; forward + backward, median of {args.reps}; roofline = 3 x logits bytes / copy bandwidth")
    print("| C | dtype | method | ms | x roofline | extra memory (x logits) | target |")
    print("| ---: | --- | --- | ---: | ---: | ---: | --- |")
    for C, dtype, label, ms, ratio, mem, roof in rows:
        mem_s = "n/a (cpu)" if mem is None else f"{mem:.3f}"
        ok = ""
        if label == "fused" and mem is not None:
            ok = "met" if ratio <= 1.25 and mem <= 1.05 else "NOT met"
            ok += f" (<= 1.25x of {roof:.3f} ms, <= 1.05x memory)"
        print(f"| {C} | {str(dtype).replace('torch.', '')} | {label} | {ms:.3f} | {ratio:.2f} | {mem_s} | {ok} |")


if __name__ == "__main__":
    main()
