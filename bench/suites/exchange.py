"""The interop suite (TorchRec's runtime on embshard's plan) and the hier suite (table-row-wise's hierarchical
exchange, 4 GPUs as 2 hosts x 2)."""

from __future__ import annotations

import argparse
import re
import statistics

from bench import report
from bench.suites.common import (
    INTEROP_DIR,
    PYTEST_LINE,
    Machine,
    Step,
    cuda_env,
    last_match,
    nproc,
    pytest,
    results,
    step_blocks,
    torchrun,
)


def interop_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """The interop tests (TorchRec's DMP on CPU processes, under this machine's torchrec), the three migration steps
    of examples/torchrec on the GPUs sharing one folder, then TorchRec's runtime on its own plan against TorchRec's
    runtime on embshard's plan (bench/torchrec_embshard_plan.py), interleaved pairs per workload."""
    out = [] if args.interop_no_tests else [Step("tests/interop", pytest("tests/interop"), timeout=300)]
    if args.interop_examples:
        for step in ("step1_plan", "step2_train", "step3_export"):
            argv = torchrun(2) + [f"examples/torchrec/{step}.py", "--out", INTEROP_DIR]
            out.append(Step(step, argv, timeout=240, needs_gpus=2))
    n = nproc(args, m)
    steps_ = str(args.steps or (5 if args.cpu else 100))
    hbm = args.torchrec_hbm_gib or m.gpu_gib or 16
    workloads = {"tiny": []} if args.cpu else {"hetero124": ["--hbm-gib", f"{hbm:g}"], "overflow": ["--hbm-gib", "16"]}
    for i in range(args.pairs or (1 if args.cpu else 3)):
        for w, size in workloads.items():
            for plan in ("torchrec", "embshard"):
                argv = torchrun(n) + ["-m", "bench.torchrec_embshard_plan", "--plan", plan, "--workload", w, *size]
                best = ["--force", "small-dp"] if plan == "torchrec" and w == "hetero124" else []
                argv += best + ["--steps", steps_] + (["--numa-bind"] if args.numa_bind else [])
                out.append(Step(f"{plan} plan {w} (pair {i + 1})", argv, timeout=300, needs_gpus=n))
    return out


def interop_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    timed: dict[str, dict[str, list[float]]] = {}
    predicted: dict[str, list[float]] = {}
    for label, text in step_blocks(log):
        plan = re.match(r"(torchrec|embshard) plan (\S+) \(pair", label)
        if plan:
            ms = [float(r["ms_per_step"]) for r in results(text) if r.get("framework") == "torchrec"]
            if ms:
                timed.setdefault(plan[2], {}).setdefault(plan[1], []).append(ms[-1])
            predicted.setdefault(plan[2], []).extend(float(x) for x in re.findall(r"predicted ([\d.]+) ms/step", text))
            continue
        found = re.findall(r"^((?:TorchRec trained|embshard trained|held-out loss).*)$", text, re.M) or re.findall(
            PYTEST_LINE, text, re.M
        )
        rows.append((label, found[-1] if found else "see interop.log"))
    for workload, by_plan in timed.items():
        own, ours = by_plan.get("torchrec", []), by_plan.get("embshard", [])
        text = f"TorchRec's plan {report.fmt_ms(own)} ms, embshard's plan {report.fmt_ms(ours)} ms"
        ratios = [a / b for a, b in zip(own, ours)]
        if ratios:
            text += f"; embshard's plan faster by {report.fmt_ratio(ratios).replace('**', '')}"
        if predicted.get(workload):
            text += f"; embshard predicted {statistics.median(predicted[workload]):.2f} ms (its own runtime)"
        rows.append((f"TorchRec runtime, {workload}", text))
    return rows


# ---- hier: table-row-wise's hierarchical exchange, 4 GPUs as 2 hosts x 2 ------------------------------------------
def hier_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """bench/hier_exchange.py (flat against hierarchical exchange, 4 ranks as 2 hosts x 2), then the world-4 parity
    tests of tests/sharding/test_sharding_types.py and 100 world-4 fuzz cases with the hierarchical scenario."""
    gpus = 4
    bench = torchrun(4) + ["-m", "bench.hier_exchange"] + (["--smoke"] if args.cpu else [])
    tests = pytest("tests/sharding/test_sharding_types.py", "-k")
    tests.append("world4")
    fuzz = pytest("tests/test_fuzz.py", "-k", "parity or hierarchical")
    fuzz_env = dict(cuda_env(args), EMBSHARD_FUZZ_WORLDS="4", EMBSHARD_FUZZ_CASES="20" if args.cpu else "100")
    return [
        Step("hier_exchange, 4 ranks as 2 hosts x 2", bench, timeout=300, needs_gpus=gpus),
        Step("world-4 parity tests (2 hosts x 2)", tests, cuda_env(args), timeout=400, needs_gpus=gpus),
        Step("world-4 fuzz cases", fuzz, fuzz_env, timeout=400, needs_gpus=gpus),
    ]


def hier_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log, "hier_exchange"):
        text = (f"{r['intra_mib']} MiB inside hosts, {r['cross_mib']} between (planner {r['planner_intra_mib']}, "
                f"{r['planner_cross_mib']}); exchange {r['exchange_ms']} ms (predicted "
                f"{r['predicted_exchange_ms']}, one machine {r['predicted_exchange_ms_one_machine']}); step "
                f"{r['step_ms']} ms (predicted {r['predicted_step_ms']})")  # fmt: skip
        rows.append((f"{r['exchange']} exchange", text))
    for label, block in step_blocks(log):
        if label.startswith("world-4"):
            rows.append((label, last_match(block, PYTEST_LINE) or "no pytest summary line"))
    return rows or [("hier", "no RESULT line (see hier.log)")]
