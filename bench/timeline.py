"""Draw the pipeline's timeline from a torch.profiler Chrome trace: one lane per CUDA stream (kernels coloured by
kind: matmul, embedding, sparse ops, NCCL, copy, other) and the host's step annotations, over the last --steps
training steps.

    python -m bench.timeline trace_bf16.json --out timeline_bf16.png [--steps 2]

The trace comes from `bench/train_e2e.py --profile-steps K --trace FILE` (its steps are annotated
"## train step ##"). Prints, per stream, the kernel time and the share of the drawn window it is busy; with
--gaps US, every idle stretch of the busiest stream of at least US microseconds in the window: the kernels before
and after it and what the other streams run meanwhile (where the compute stream waits, and on what); with
--listing FILE, every kernel of the window in start order (start ms, duration ms, stream, name); with --top N, the
N kernel names with the most time in the window.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

KINDS = {  # kind -> colour
    "matmul": "#1f77b4",
    "embedding": "#2ca02c",
    "sparse ops": "#98df8a",
    "nccl": "#d62728",
    "copy": "#9467bd",
    "other": "#7f7f7f",
}


def kind_of(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if any(k in n for k in ("gemm", "cutlass", "sm90_", "sm80_", "wgmma", "xmma", "cublas")):
        return "matmul"
    if "embedding" in n or "split_" in n or "tbe" in n:
        return "embedding"
    if any(k in n for k in ("permute", "bucketize", "jagged", "cumsum", "bounds_check", "regroup", "segment")):
        return "sparse ops"
    return "other"


def lane_key(e: dict) -> tuple:
    """(process, stream) of a trace event: its lane in the timeline."""
    return e.get("pid"), e.get("args", {}).get("stream", e.get("tid"))


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--out", required=True, help="PNG file")
    ap.add_argument("--steps", type=int, default=2, help="draw the last N annotated steps")
    ap.add_argument("--gaps", type=float, default=0, help="print the busiest stream's idle stretches of >= US us")
    ap.add_argument("--listing", help="write every kernel of the window, in start order, to this text file")
    ap.add_argument("--tail-ms", type=float, default=0, help="draw the last MS of GPU activity (traces without steps)")
    ap.add_argument("--top", type=int, default=0, help="print the N kernels (by name) with the most time in the window")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in load(args.trace) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e.get("name") == "## train step ##" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])  # fmt: skip
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit(f"{args.trace}: no GPU kernels in the trace (a CPU run?)")
    if args.tail_ms:
        hi = max(e["ts"] + e["dur"] for e in kernels)
        lo = hi - args.tail_ms * 1e3
    elif steps:
        lo = steps[-args.steps]["ts"] if len(steps) >= args.steps else steps[0]["ts"]
        hi = max(e["ts"] + e["dur"] for e in kernels)
    else:
        lo, hi = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    kernels = [e for e in kernels if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    # one lane per (device, stream)
    lanes = sorted({lane_key(e) for e in kernels}, key=str)
    lane_of = {k: i for i, k in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(16, 1.0 + 0.6 * (len(lanes) + 1)))
    busy = collections.Counter()
    for e in kernels:
        lane = lane_of[lane_key(e)]
        start, dur = (e["ts"] - lo) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(start, dur)], (lane + 0.1, 0.8), color=KINDS[kind_of(e["name"])], linewidth=0)
        busy[lane] += dur
    host = len(lanes)
    for s in steps:
        if s["ts"] + s["dur"] >= lo:
            ax.broken_barh([((s["ts"] - lo) / 1e3, s["dur"] / 1e3)], (host + 0.1, 0.8), color="#ffbb78", linewidth=0.5,
                           edgecolor="k")  # fmt: skip
            ax.axvline((s["ts"] - lo) / 1e3, color="k", linewidth=0.5, linestyle=":")
    ax.set_yticks([i + 0.5 for i in range(len(lanes) + 1)])
    ax.set_yticklabels([f"GPU {p} stream {s}" for p, s in lanes] + ["host: train step"])
    ax.set_xlabel("ms")
    ax.set_xlim(0, (hi - lo) / 1e3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KINDS.values()]
    ax.legend(handles, list(KINDS), ncol=len(KINDS), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title(f"{args.trace}: last {min(args.steps, len(steps)) or 'all'} steps", pad=28)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    window = (hi - lo) / 1e3
    for (p, s), i in lane_of.items():
        print(f"GPU {p} stream {s}: kernels {busy[i]:.2f} ms of {window:.2f} ms ({busy[i] / window:.0%})")
    print(f"timeline: {args.out}")
    if args.listing:
        with open(args.listing, "w") as f:
            for e in sorted(kernels, key=lambda e: e["ts"]):
                f.write(f"{(e['ts'] - lo) / 1e3:9.3f} {e['dur'] / 1e3:7.3f} s{lane_key(e)[1]} {e['name'][:110]}\n")
    if args.top:
        print_top(kernels, args.top)
    if args.gaps:
        print_gaps(kernels, lane_of, max(busy, key=busy.get), lo, args.gaps)


def print_top(kernels: list[dict], n: int) -> None:
    """The `n` kernel names with the most GPU time in the window: total ms, launches, mean us."""
    total, count = collections.Counter(), collections.Counter()
    for e in kernels:
        total[e["name"][:90]] += e["dur"] / 1e3
        count[e["name"][:90]] += 1
    print(f"top kernels by time (all lanes, {sum(total.values()):.2f} ms, {sum(count.values())} launches):")
    for name, ms in total.most_common(n):
        print(f"  {ms:8.3f} ms {count[name]:6d} x {ms / count[name] * 1e3:8.1f} us  {name}")


def print_gaps(kernels: list[dict], lane_of: dict, lane: int, lo: float, min_us: float) -> None:
    """The idle stretches of `lane` of at least `min_us`, with their neighbours and the other lanes' kernels."""
    key = {id(e): lane_of[lane_key(e)] for e in kernels}
    mine = sorted((e for e in kernels if key[id(e)] == lane), key=lambda e: e["ts"])
    total = 0.0
    for before, after in zip(mine, mine[1:]):
        a, b = before["ts"] + before["dur"], after["ts"]
        if b - a < min_us:
            continue
        total += b - a
        print(
            f"idle {(b - a):7.1f} us at {(a - lo) / 1e3:8.3f} ms: after {before['name'][:60]!r}, before {after['name'][:60]!r}"
        )
        for e in kernels:
            if key[id(e)] != lane and e["ts"] < b and e["ts"] + e["dur"] > a:
                print(f"    other stream {key[id(e)]}: {(e['ts'] - lo) / 1e3:8.3f} +{e['dur']:.1f} us {e['name'][:70]}")
    print(f"idle stretches of >= {min_us:g} us: {total / 1e3:.3f} ms in all")


if __name__ == "__main__":
    main()
