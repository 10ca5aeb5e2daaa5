"""Suites of one script each: retrieval (the sharded full softmax), ckpt (checkpoints), loader (the Parquet
loader), kernels (Triton kernels against FBGEMM), tiers (memory tiers) and bandwidth (`embshard calibrate`)."""

from __future__ import annotations

import argparse
import re

from bench import report
from bench.suites.common import (
    CKPT_DIR,
    LOADER_DIR,
    PYTEST_LINE,
    ROOT,
    TOPOLOGY_FILE,
    Machine,
    Step,
    bandwidth_step,
    cuda_env,
    last_match,
    nproc,
    py,
    pytest,
    results,
    torchrun,
)


# ---- retrieval, ckpt, loader ----------------------------------------------------------------------------------
def retrieval_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = torchrun(2) + ["-m", "bench.full_softmax"] + (["--cpu"] if args.cpu else [])
    return [Step("full softmax, 1M x 64 items, 2 ranks", argv, timeout=300, needs_gpus=2)]


def retrieval_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log, "retrieval"):
        text = (f"sharded peak {r['sharded_peak_gib']} GiB vs materialized {r['materialized_peak_gib']} GiB "
                f"(logits alone {r['logits_gib']} GiB): {float(r['peak_share']):.1%}; "
                f"{r['sharded_ms']} vs {r['materialized_ms']} ms/step")  # fmt: skip
        rows.append((f"{r['items']} x {r['dim']}, {r['world']} ranks", text))
    parity = last_match(log, r"^(max \|sharded - materialized\|.*)$")
    return rows + ([("parity", parity)] if parity else []) or [("retrieval", "no RESULT line (see retrieval.log)")]


def ckpt_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    scale = args.ckpt_scale or (0.0005 if args.cpu else 0.1)
    argv = torchrun(n) + ["-m", "bench.checkpoint_bench", "--dir", CKPT_DIR, "--scale", f"{scale:g}"]
    out = [Step(f"checkpoint_bench, {n} ranks, scale {scale:g}", argv, timeout=420, needs_gpus=n)]
    if not args.cpu:
        argv = pytest("tests/checkpoint")
        out.append(Step("checkpoint tests on the GPUs", argv, cuda_env(args), timeout=240))
    return out


def ckpt_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log, "ckpt"):
        text = (f"{r['gb']} GB: dd {r['dd_gbs']} GB/s, sync save {r['sync_save_gbs']} GB/s, async save "
                f"blocks {r['async2_blocking_s']} s (first {r['async1_blocking_s']} s), commits at "
                f"{r['async2_commit_gbs']} GB/s; verify {r.get('verify_gbs', '-')} GB/s; reload "
                f"{r['reload_gbs']} GB/s (unchecked {r.get('reload_unchecked_gbs', '-')}), parity "
                f"{r['reload_parity']}; peak RSS {r['peak_rss_gib']} GiB")  # fmt: skip
        rows.append((f"{r['world']} ranks, scale {r['scale']}", text))
    tests = last_match(log, PYTEST_LINE)
    return rows + ([("tests/checkpoint", tests)] if tests else []) or [("ckpt", "no RESULT line (see ckpt.log)")]


def loader_workers(args: argparse.Namespace, m: Machine) -> str:
    if args.loader_workers:
        return args.loader_workers
    if args.cpu:
        return "0,1"
    counts = [0] + [w for w in (8, 16, 32) if w <= m.cpus]
    return ",".join(str(w) for w in counts)


def loader_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = py() + ["-m", "bench.loader", "--data-dir", LOADER_DIR, "--workers", loader_workers(args, m)]
    if args.cpu:
        argv += ["--rows", "20000", "--seconds", "1", "--layouts", "multihot-packed,onehot"]
    else:
        argv += ["--rows", "1000000", "--seconds", "8"]
    return [Step(f"loader, workers {loader_workers(args, m)}", argv, timeout=540)]


def loader_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    best: dict[str, dict[str, str]] = {}
    for r in results(log, "loader"):
        cur = best.get(r["layout"])
        if cur is None or float(r["samples_per_s"]) > float(cur["samples_per_s"]):
            best[r["layout"]] = r
    rows = []
    for layout, r in best.items():
        text = (f"{float(r['samples_per_s']) / 1e6:.3f} M samples/s with {r['workers']} workers "
                f"({r['cpus']} CPUs), peak RSS {r['peak_rss_gib']} GiB")  # fmt: skip
        rows.append((f"{r['framework']} {layout}", text))
    return rows or [("loader", "no RESULT lines (see loader.log)")]


# ---- kernels, tiers, profile, bandwidth (one GPU unless said) --------------------------------------------------
def kernels_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    cpu = ["--cpu", "--small"] if args.cpu else []
    env = {"CUDA_VISIBLE_DEVICES": "0"} if not args.cpu else {}
    check_env = env | {"PYTHONPATH": str(ROOT / "tests")}  # --check imports the tests' reference kernels
    return [
        Step(
            "kernels --check",
            py() + ["-m", "bench.kernels", "--check", *cpu],
            check_env,
            timeout=240,
            needs_gpus=1,
        ),
        Step("kernels", py() + ["-m", "bench.kernels", *cpu], env, timeout=330, needs_gpus=1),
        Step("cross_entropy", py() + ["-m", "bench.cross_entropy"] + (["--cpu"] if args.cpu else []), env, timeout=200),
    ]


def kernels_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    check = last_match(log, r"^(ALL PASS|\d+ FAILED)$") or "no check line"
    bw = last_match(log, r"^(copy bandwidth: .*)$")
    return [("parity check", check)] + ([("bandwidth", bw)] if bw else [])


def tiers_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = py() + ["-m", "bench.tiers"] + (["--cpu"] if args.cpu else ["--rows", "2000000"])
    env = {"CUDA_VISIBLE_DEVICES": "0"} if not args.cpu else {}
    return [Step("tiers", argv, env, timeout=300, needs_gpus=1)]


def tiers_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    found = re.findall(r"^\| (hbm|uvm|uvm_caching) \| (\S+) \| ([\d.]+) \|", log, re.M)
    text = ", ".join(f"{tier} {ids} {ms} ms" for tier, ids, ms in found)
    return [("ms/step by tier and ids", text or "no table (see tiers.log)")]


def bandwidth_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    if args.cpu:
        argv = py() + ["-m", "embshard.cli", "calibrate", "--out", TOPOLOGY_FILE, "--iters", "3", "--no-kernels"]
        return [Step("bandwidth (embshard calibrate, CPU)", argv, timeout=150)]
    return bandwidth_step(argparse.Namespace(**{**vars(args), "no_bandwidth": False}))


def bandwidth_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for name, pattern in report.BANDWIDTH_LINES.items():
        found = pattern.findall(log)
        if found:
            rows.append((report.BANDWIDTH_NAMES[name], f"{float(found[-1]):,.1f} GB/s"))
    return rows or [("bandwidth", "no bandwidth line (see bandwidth.log)")]
