"""The serve suite: embshard's Predictor (FBGEMM's inference TBE) against TorchRec's quantized EmbeddingBagCollection
(bench/serve_latency.py: same weights, same dense model, interleaved on the same batches; the scores compared first)
and the held-out AUC of each exported table type (bench/serve_quality.py: fp32, fp16, int8, int4)."""

from __future__ import annotations

import argparse
import re

from bench import runs
from bench.suites.common import Machine, Step, py

SIDES = (
    ("embshard", "embshard"),
    ("TorchRec", "torchrec"),
    ("embshard eager", "embshard_eager"),
    ("embshard fp16 dense", "embshard_fp16dense"),
    ("embshard compiled dense", "embshard_compiled"),
    ("embshard over every GPU", "embshard_sharded"),
)
"""(name in the summary, `side=` of bench/serve_latency.py's RESULT lines)."""


def serve_device(args: argparse.Namespace, m: Machine) -> str:
    """Where the predictors run: --device, else cpu under --cpu or without GPUs, else cuda."""
    return args.device or ("cpu" if args.cpu or m.gpus == 0 else "cuda")


def serve_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """Latency and throughput (one process; with 2+ GPUs it also spreads the tables over them), then quality.
    --cpu: a few small tables, few repetitions and a short training run."""
    device = serve_device(args, m)
    gpus = 1 if device == "cuda" else 0
    small_latency = ["--tables", "4", "--rows", "2000", "--reps", "5"] if args.cpu else []
    small_quality = ["--steps", "30", "--eval-batches", "4"] if args.cpu else []
    latency = py() + ["-m", "bench.serve_latency", "--out", f"{args.out}/serve_latency", "--device", device]
    quality = py() + ["-m", "bench.serve_quality", "--out", f"{args.out}/serve_quality", "--device", device]
    return [
        Step(f"serve latency, embshard against TorchRec, int8 on {device}", latency + small_latency, timeout=420,
             needs_gpus=gpus),
        Step(f"serve quality, AUC per table type on {device}", quality + small_quality, timeout=420, needs_gpus=gpus),
    ]  # fmt: skip


def _lines(log: str, bench: str) -> list[dict[str, str]]:
    """The fields of the RESULT lines `RESULT BENCH key=value ... [PASS|FAIL]` of one script (the verdict, if any,
    as `verdict`)."""
    out = []
    for line in log.splitlines():
        if not line.startswith(f"RESULT {bench} "):
            continue
        r = runs.parse_line(line)
        if r is not None:
            last = line.split()[-1]
            out.append(r | ({"verdict": last} if last in ("PASS", "FAIL") else {}))
    return out


def _rate(r: dict[str, str]) -> float:
    """Samples per second of a throughput field (`12345/s`)."""
    return float(r["throughput"].removesuffix("/s"))


def serve_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The checks (PASS / FAIL lines); per batch size embshard's and TorchRec's p50 and p99 latency (ms) with
    TorchRec's p50 over embshard's (> 1: embshard faster), at 8192 the throughputs; per table type the AUC, its
    change from fp32 and the size ratio."""
    rows = []
    checks = re.findall(r"^(PASS|FAIL) (serve_\w+.*)$", log, re.M)
    failed = [text for word, text in checks if word == "FAIL"]
    if checks:
        text = f"{len(checks) - len(failed)} PASS, {len(failed)} FAIL" + (": " + "; ".join(failed) if failed else "")
        rows.append(("checks", text))
    latency = _lines(log, "serve_latency")
    by = {(r.get("side"), r.get("batch")): r for r in latency}
    batches = sorted({r.get("batch", "0") for r in latency}, key=lambda b: int(b) if b.isdigit() else 0)
    for batch in batches:
        sides = [(name, by.get((side, batch))) for name, side in SIDES]
        sides = [(name, r) for name, r in sides if r is not None]
        mine, theirs = by.get(("embshard", batch)), by.get(("torchrec", batch))
        first = sides[0][1]
        parts = []
        if "throughput" in first:
            parts += [f"{name} {_rate(r):,.0f} samples/s" for name, r in sides]
            if mine and theirs:
                parts.append(f"embshard/TorchRec {_rate(mine) / _rate(theirs):.2f}x")
        else:
            parts += [f"{name} p50 {float(r['p50_ms']):.3f} ms, p99 {float(r['p99_ms']):.3f} ms" for name, r in sides]
            if mine and theirs:
                ratio = float(theirs["p50_ms"]) / float(mine["p50_ms"])
                parts.append(f"TorchRec/embshard p50 {ratio:.2f}x ({'embshard' if ratio > 1 else 'TorchRec'} faster)")
        rows.append((f"batch {batch}, {first.get('dtype', '?')} on {first.get('device', '?')}", "; ".join(parts)))
    for r in _lines(log, "serve_quality"):
        text = (f"AUC {float(r['auc']):.5f} ({float(r['delta_auc']):+.5f} from fp32), tables "
                f"{float(r['size_ratio']):.2f}x smaller")  # fmt: skip
        rows.append((f"quality {r.get('dtype', '?')}", text + (f": {r['verdict']}" if "verdict" in r else "")))
    return rows or [("serve", "no RESULT lines (see serve.log)")]
