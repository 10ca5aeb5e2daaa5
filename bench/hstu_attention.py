"""The HSTU layers' attention layouts (embshard/models/hstu_attention.py): jagged tile pairs against the padded
reference, forward + backward of the dense part (HSTUDense: 2 layers), on the CPU or a GPU.

    python -m bench.hstu_attention --out DIR              # a GPU when one is visible, else the CPU
    python -m bench.hstu_attention --out DIR --cpu        # the CPU (small sizes: 1 thread, a few repeats)

On a GPU first: `PASS`/`FAIL no host sync` (a forward + backward of the jagged layout with the lengths given on
the host, under torch's sync debug mode "error"). Then for each case (batch, lengths uniform in [lo, hi], width,
tile): parity (outputs and the input and parameter gradients of the jagged layout against the padded one, fp32,
with the time bias: `PASS`/`FAIL` lines; the largest difference over the largest value of each tensor, at most
1e-5 on the CPU and 1e-4 on a GPU, whose matmuls may use other summation orders), then the shortest time of a
forward + backward of each layout (the two taken in turn): `TIME case: padded X ms jagged Y ms (Z x; score
entries ...)`. Writes the lines to DIR/hstu_attention.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.verdict import finish
from embshard.models.sequential import HSTUDense

CPU_CASES = [
    (64, 5, 21, 32, 64),
    (64, 5, 21, 32, 8),
    (64, 5, 21, 32, 16),
    (32, 5, 201, 32, 64),
    (32, 5, 201, 32, 32),
    (32, 150, 201, 32, 64),
]
GPU_CASES = [
    (1024, 5, 51, 64, 64),
    (1024, 5, 201, 64, 64),
    (1024, 5, 201, 64, 128),
    (256, 10, 1001, 64, 128),
    (256, 500, 1001, 64, 128),
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def case(B: int, lo: int, hi: int, D: int, tile: int, device: torch.device, reps: int) -> list[str]:
    g = torch.Generator().manual_seed(B + hi)
    lengths = torch.randint(lo, hi + 1, (B,), generator=g).to(device)
    N = int(lengths.sum())
    items = torch.randn(N, D, generator=g).to(device)
    context = torch.randn(B, 8, generator=g).to(device)
    weights = torch.randn(N, D, generator=g).to(device)
    times = (torch.cumsum(torch.randint(0, 10**5, (N,), generator=g), 0) + 10**9).to(device)
    models = {}
    for att in ("padded", "jagged"):
        torch.manual_seed(0)
        models[att] = HSTUDense(D, 8, 2, 2, hi, attention=att, tile=tile, time_bias=True).to(device)
    models["jagged"].load_state_dict(models["padded"].state_dict())
    name = f"B={B} lengths {lo}..{hi} D={D} tile={tile}"
    out, grads = {}, {}
    for att, m in models.items():
        x = items.clone().requires_grad_(True)
        y = m(x, lengths, context, times)
        (y * weights).sum().backward()  # random weights: sum(y * y) of a LayerNorm's output has ~0 gradient
        out[att] = y.detach()
        grads[att] = [x.grad, *[p.grad for p in m.parameters()]]
    tol = 1e-5 if device.type == "cpu" else 1e-4
    pairs = [(a, b) for a, b in zip(grads["jagged"], grads["padded"], strict=True) if b is not None]
    err = max(
        float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in [(out["jagged"], out["padded"]), *pairs]
    )
    lines = [f"{'PASS' if err <= tol else 'FAIL'} parity {name}: largest difference over the largest value {err:.2e}"]
    runs: dict[str, list[float]] = {att: [] for att in models}
    xs = {att: items.clone().requires_grad_(True) for att in models}
    for i in range(reps + 2):  # the layouts in turn, so that other work on the machine hits both alike
        for att, m in models.items():
            sync(device)
            t0 = time.perf_counter()
            m(xs[att], lengths, context, times).sum().backward()
            sync(device)
            if i >= 2:  # 2 warm-up steps
                runs[att].append((time.perf_counter() - t0) * 1e3)
    ms = {att: min(r) for att, r in runs.items()}
    pad_work = B * int(lengths.max()) ** 2
    T = tile if int(lengths.max()) > tile else int(lengths.max())  # one tile: laid out padded
    tiles = (lengths + T - 1) // T
    jag_work = int((tiles * (tiles + 1) // 2).sum()) * T * T
    lines.append(
        f"TIME {name}: padded {ms['padded']:.2f} ms jagged {ms['jagged']:.2f} ms "
        f"({ms['padded'] / ms['jagged']:.2f} x; score entries padded {pad_work:,} jagged {jag_work:,})"
    )
    return lines


def no_host_sync(device: torch.device) -> str:
    """PASS/FAIL line: a forward + backward of the jagged layout (time bias on) given the lengths on the host makes
    no host sync (torch's sync debug mode set to error; GPU only)."""
    torch.manual_seed(0)
    model = HSTUDense(16, 3, 2, 2, 100, attention="jagged", tile=16, time_bias=True).to(device)
    lengths = torch.tensor([1, 101, 7, 0, 40, 33], device=device)
    N = int(lengths.sum())
    items, context = torch.randn(N, 16, device=device), torch.randn(6, 3, device=device)
    times = torch.cumsum(torch.randint(0, 10**6, (N,), device=device), 0)
    host = lengths.cpu().numpy()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(items, lengths, context, times, host).sum().backward()
    except RuntimeError as e:
        return f"FAIL no host sync in the jagged forward + backward: {str(e).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "PASS no host sync in the jagged forward + backward (lengths given on the host)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for hstu_attention.txt")
    p.add_argument("--cpu", action="store_true", help="the CPU even when a GPU is visible")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(1)
    where = torch.cuda.get_device_name(0) if gpu else "CPU (1 thread)"
    lines = [f"device: {where}"]
    print(lines[0], flush=True)
    if gpu:
        lines.append(no_host_sync(device))
        print(lines[-1], flush=True)
    for c in GPU_CASES if gpu else CPU_CASES:
        for line in case(*c, device=device, reps=10 if gpu else 5):
            print(line, flush=True)
            lines.append(line)
    failed = sum(line.startswith("FAIL") for line in lines)
    return finish(lines, failed, Path(args.out) / "hstu_attention.txt")


if __name__ == "__main__":
    sys.exit(main())
