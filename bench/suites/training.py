"""End-to-end training against TorchRec: the e2e suite (interleaved pairs per precision) and the scaling suite
(weak scaling at 1, 2 and 4 GPUs); compare_summary is also the emb suite's summary."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench import report
from bench.suites.common import (
    E2E_CONFIG,
    Machine,
    Step,
    bandwidth_step,
    last_match,
    nproc,
    py,
    results,
    torchrun,
)

# ---- e2e ------------------------------------------------------------------------------------------------------
TORCHREC_BEST = ["--qcomm", "bf16", "--emb-output", "bf16", "--compile-dense"]
"""With --precision bf16: TorchRec at its best (bench/baselines/README.md): bf16 quantized all-to-all of the pooled
embeddings, bf16 TBE outputs, the dense part compiled."""


def e2e_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    pairs = args.pairs or (1 if args.cpu else 3)
    steps_, warmup = args.steps or (3 if args.cpu else 60), args.warmup or (1 if args.cpu else 20)
    scale = args.scale or (1e-5 if args.cpu else None)
    size, tr_size = [], []
    if scale:  # embshard's --scale multiplies the rows, the baseline's divides them
        size, tr_size = ["--scale", f"{scale:g}"], ["--scale", f"{1 / scale:g}"]
    if args.cpu:
        size, tr_size = size + ["--batch-size", "64"], tr_size + ["--batch-size", "64"]
    timing = ["--steps", str(steps_), "--warmup", str(warmup)]
    tr_law, law = [], []  # the MLPerf law (uniform ids, fixed bags) by default; both frameworks draw the same law
    if args.data_law == "zipf-poisson":
        tr_law = ["--ids", "zipf", "--zipf-alpha", "1.05", "--bag-lengths", "poisson"]
        law = ["data.synthetic.zipf_exponent=1.05", "data.synthetic.bag_lengths=poisson"]
        law.append("planner.settings.zipf_alpha=1.05")  # the planner prices the skew (UVM-cache hits)

    def torchrec(precision: str, best: bool = False) -> Step:
        argv = torchrun(n) + ["bench/baselines/torchrec_dlrm_train.py", *timing, "--precision", precision, *tr_size]
        label = f"TorchRec {precision}" + (" at its best" if best else "")
        argv += TORCHREC_BEST if best else []
        return Step(label, argv + tr_law, timeout=240, needs_gpus=n, exit_after_result_s=45)

    def embshard(tag: str, *extra: str) -> Step:
        argv = py() + ["-m", "bench.train_e2e", "--config", E2E_CONFIG, "--nproc", str(n), *timing, "--eval", *size]
        argv += ["--tag", tag, *extra, *law]
        return Step(f"embshard {tag}", argv, timeout=240, needs_gpus=n, exit_after_result_s=45)

    out = bandwidth_step(args)
    precisions = args.precisions.split(",")
    compile_ = ["--compile", args.compile] if args.compile else []
    for i in range(pairs):
        last = i == pairs - 1
        for p in precisions:
            # bf16 pooled outputs are the default with --precision bf16 (lookup.output_dtype auto); fp32 asked for
            pooled = ["lookup.output_dtype=fp32"] if p == "bf16" and args.bf16_pooled == "fp32" else []
            profile = ["--profile-steps", "3"] if (args.profile or args.timeline) and last else []
            profile += ["--trace", f"/tmp/embshard_trace_{p}.json"] if args.timeline and last else []
            out.append(torchrec(p))
            if p == "bf16" and not args.no_torchrec_best and not args.cpu:  # --emb-output bf16 needs CUDA
                out.append(torchrec(p, best=True))
            if args.cuda_graph != "only":  # the defaults (with bf16: the whole-step graph, compiled dense part)
                # beside the explicit graph run (--cuda-graph also), the plain run is the eager step
                eager = ["training.cuda_graph=false"] + ([] if args.compile else ["training.compile=none"])
                plain = eager if args.cuda_graph == "also" else []
                out.append(embshard(p, "--precision", p, *profile, *pooled, *compile_, *plain))
            if args.cuda_graph:  # the step as one CUDA graph (holding compiled kernels, not reduce-overhead's graphs)
                graph = ["training.cuda_graph=true"] + (profile if args.cuda_graph == "only" else [])
                graph += compile_ if args.compile != "reduce-overhead" else []
                out.append(embshard(f"{p}_graph", "--precision", p, *pooled, *graph))
    if args.timeline:  # the traces stay in /tmp; only the pictures go to the output folder
        for p in precisions:
            argv = py() + [
                "-m",
                "bench.timeline",
                f"/tmp/embshard_trace_{p}.json",
                "--out",
                f"{args.out}/timeline_{p}.png",
            ]
            out.append(Step(f"timeline {p}", argv + ["--steps", "2", "--gaps", "8"], timeout=90))
    if args.variants:  # embshard's other settings, each once
        out.append(embshard("semi_sync_bf16", "--precision", "bf16", "--pipeline", "semi_sync"))
        out += [torchrec("tf32"), embshard("tf32", "--precision", "tf32")]
        out.append(embshard("none_fp32", "--pipeline", "none"))
    if args.loss_steps:
        argv = py() + [
            "-m",
            "bench.loss_curves",
            "--config",
            E2E_CONFIG,
            "--nproc",
            str(n),
            "--steps",
            str(args.loss_steps),
        ]
        argv += ["--out", f"{args.out}/loss_curves.png"] + (["--scale", f"{scale:g}", "--small"] if args.cpu else [])
        out.append(Step("loss curves", argv, timeout=300, needs_gpus=n))
    return out


def compare_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per case: TorchRec and embshard medians, the ratio's median and spread over pairs, and the floor."""
    folder = report.Folder(Path(args.out))
    folder.runs = [r | {"_file": "log"} for r in results(log)]
    for name, pattern in report.BANDWIDTH_LINES.items():
        found = [float(x) for x in pattern.findall(log)]
        if found:
            folder.bandwidth[name] = statistics.median(found) * 1e9
    folder.meta["gpu"] = last_match(log, r'^META .*gpu="([^"]*)"')
    rows = []
    for row in report.rows_of(folder).values():
        ems = [float(r["ms_per_step"]) for r in row.emb]
        text = f"embshard {report.fmt_ms(ems)} ms"
        if row.base:
            text = f"TorchRec {report.fmt_ms([float(r['ms_per_step']) for r in row.base])} ms, " + text
            text += f"; ratio {report.fmt_ratio(row.ratios).replace('**', '')}: {report.verdict(row.ratios)}"
        pred = [float(r["predicted_ms"]) for r in row.emb if "predicted_ms" in r]
        if pred:
            text += f"; predicted {statistics.median(pred):.2f} ms"
        floor = [f for f in (report.floor_terms(r, folder)[0] for r in row.emb) if f is not None]
        if floor:
            text += f"; floor {statistics.median(floor):.2f} ms"
        world = int(row.emb[0].get("world", 1))
        if report.bench_of(row.emb[0]) == "e2e" and all("samples_per_s" in r for r in row.emb):
            per_gpu = statistics.median(float(r["samples_per_s"]) for r in row.emb) / world
            text += f"; {per_gpu / 1e6:.3f} M samples/s per GPU"
        against = f", against TorchRec with {row.theirs}" if row.theirs else ""
        rows.append((report.case_title(row) + against, text))
    return rows or [("results", "no RESULT lines (see the log)")]


# ---- scaling: weak scaling of the MLPerf model, 1, 2 and 4 GPUs at 8192 samples per GPU -------------------------
SCALING_ONE_GPU_ROWS = 0.5
"""At 1 GPU the MLPerf tables (97 GiB) do not fit one card: every table keeps this fraction of its rows."""


def scaling_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """Per round and precision: TorchRec at 4 GPUs, embshard at 4, embshard at 2 (the pair is TorchRec and
    embshard at 4); after the rounds, embshard at 1 GPU on tables at half their rows, once per precision."""
    pairs = args.pairs or (1 if args.cpu else 2)
    timing = [
        "--steps",
        str(args.steps or (3 if args.cpu else 60)),
        "--warmup",
        str(args.warmup or (1 if args.cpu else 20)),
    ]
    scale = args.scale or (1e-5 if args.cpu else 1.0)
    small = ["--batch-size", "64"] if args.cpu else []
    graph = ["training.cuda_graph=true"] if args.cuda_graph else []

    def torchrec(n: int, p: str) -> Step:
        size = ["--scale", f"{1 / scale:g}"] if scale != 1.0 else []
        argv = torchrun(n) + ["bench/baselines/torchrec_dlrm_train.py", *timing, "--precision", p, *size, *small]
        return Step(
            f"TorchRec {p}, {n} GPUs", argv, timeout=240, needs_gpus=0 if args.cpu else n, exit_after_result_s=45
        )

    def embshard(n: int, p: str, rows: float) -> Step:
        argv = py() + ["-m", "bench.train_e2e", "--config", E2E_CONFIG, "--nproc", str(n), *timing, *small]
        argv += ["--scale", f"{rows:g}"] if rows != 1.0 else []
        argv += ["--tag", f"{p}_x{n}", "--precision", p]  # bf16: bf16 pooled outputs and the graphs by default
        return Step(f"embshard {p}, {n} GPUs", argv + (graph if p == "bf16" else []), timeout=240,
                    needs_gpus=0 if args.cpu else n, exit_after_result_s=45)  # fmt: skip

    out = []
    precisions = args.precisions.split(",")
    for _ in range(pairs):
        for p in precisions:
            out += [torchrec(4, p), embshard(4, p, scale), embshard(2, p, scale)]
    out += [embshard(1, p, scale * SCALING_ONE_GPU_ROWS) for p in precisions]
    return out


def scaling_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per precision: samples/s per GPU at 1, 2 and 4 GPUs (median of the runs), 4 GPUs against 2, and the ratio
    to TorchRec at 4 GPUs (median and spread over the pairs bench/report.py makes: each embshard run with the
    TorchRec run of its case before it)."""
    runs = [r for r in results(log) if "samples_per_s" in r and "world" in r]
    folder = report.Folder(Path(args.out))
    folder.runs = [r | {"_file": "log"} for r in runs]
    ratios = {report.case_of(row.emb[0]): row.ratios for row in report.rows_of(folder).values()}
    rows = []
    for p in args.precisions.split(","):
        per_gpu: dict[tuple[str, int], list[float]] = {}
        for r in runs:
            if (r.get("precision") or "fp32") == p:
                key = (r.get("framework", "?"), int(r["world"]))
                per_gpu.setdefault(key, []).append(float(r["samples_per_s"]) / int(r["world"]))
        if not per_gpu:
            continue
        med = {k: statistics.median(v) for k, v in per_gpu.items()}
        text = ", ".join(f"{n} GPUs {med[('embshard', n)]:,.0f}" for n in (1, 2, 4) if ("embshard", n) in med)
        text = f"embshard samples/s per GPU: {text}"
        if ("embshard", 2) in med and ("embshard", 4) in med:
            text += f"; 4 GPUs keep {med[('embshard', 4)] / med[('embshard', 2)]:.1%} of 2 GPUs' per-GPU rate"
        at4 = [r for r in runs if r.get("framework") == "embshard" and r["world"] == "4" and r.get("precision") == p]
        paired = ratios.get(report.case_of(at4[0]), []) if at4 else []
        if paired:
            text += f"; TorchRec at 4 GPUs {med[('torchrec', 4)]:,.0f} per GPU, embshard {report.fmt_ratio(paired)}"
        rows.append((f"weak scaling, {p}", text.replace("**", "")))
    return rows or [("scaling", "no RESULT lines (see scaling.log)")]
