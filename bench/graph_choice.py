"""Was `training.cuda_graph: auto`'s choice right? The plan auto takes against the other one, measured on GPUs.

    python -m bench.graph_choice --out DIR --nproc 8 [--scale 1.0] [--rounds 2] [--steps 40] [--warmup 15]

With training.precision bf16 on GPUs the planner prices the whole-step CUDA graph's plan (table-wise, column-wise and
data-parallel tables, as one replay) against the eager step's (every option, the host's floor), each with the dense
part, and takes the faster (docs/planner.md, "Graph or eager, by predicted step"); the MLPerf-shaped model is
predicted faster eager at 1, 4 and 8 H100s and graphed at 2 (where the eager step's plan is the graph's). This trains configs/dlrm_dcnv2_mlperf.yaml (tables at --scale of their rows) with
bench/train_e2e.py, in interleaved rounds, three ways:

    auto     --precision bf16 alone: the planner's choice (its step line gives both predictions)
    graph    + training.cuda_graph=true: the whole-step graph's plan, replayed
    eager    + training.graph_scope=dense: the eager step's plan, with the dense step's graph (how auto runs it)

and prints per way the median ms a step, then `PASS choice ...` when auto's runs measure at most --slack above the
way it did not take (`FAIL` otherwise: the planner's prices of the two steps need a look, e.g. the host floor's constants or
the column blocks' price: bench/cw_block_cost.py), with the predicted and measured ms of both. Every run's output goes
to DIR/<way>_<round>.log, the lines to DIR/graph_choice.txt; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench.verdict import finish

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
WAYS = {"auto": [], "graph": ["training.cuda_graph=true"], "eager": ["training.graph_scope=dense"]}
RESULT = re.compile(r"^RESULT framework=embshard .*", re.M)
CHOICE = re.compile(r"predicted ([0-9.]+) ms a step (with the whole-step CUDA graph|eager)[^0-9]*([0-9.]+) ms")


def run_way(way: str, k: int, args: argparse.Namespace, out: Path) -> tuple[float | None, str]:
    """(ms a step, the step line) of one run; None when it failed (its log says why)."""
    cmd = [sys.executable, "-m", "bench.train_e2e", "--config", CONFIG, "--nproc", str(args.nproc),
           "--scale", f"{args.scale:g}", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", "bf16", "--tag", f"graph_choice_{way}", *WAYS[way]]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        text, code = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"{e.stdout or ''}{e.stderr or ''}", -1
    (out / f"{way}_{k}.log").write_text(" ".join(cmd) + "\n" + text)
    step = next((ln for ln in text.splitlines() if ln.startswith("step: ")), "(no step line)")
    result = RESULT.search(text)
    if code != 0 or result is None:
        return None, step
    fields = dict(kv.split("=", 1) for kv in result.group(0).split()[1:] if "=" in kv)
    return float(fields["ms_per_step"]), step


def predictions(step_line: str) -> dict[str, float]:
    """The planner's predicted ms of the graph's plan and the eager step's, read from auto's step line."""
    m = CHOICE.search(step_line)
    if m is None:
        return {}
    first = "graph" if m.group(2).startswith("with") else "eager"
    second = "eager" if first == "graph" else "graph"
    return {first: float(m.group(1)), second: float(m.group(3))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--nproc", type=int, default=8, help="GPUs (one process each)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of every table's rows")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the three ways")
    p.add_argument("--steps", type=int, default=40, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps first (captures included)")
    p.add_argument("--slack", type=float, default=0.05, help="PASS when auto's way is at most this much slower")
    p.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    steps: dict[str, str] = {}

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    for k in range(args.rounds):
        for way in WAYS:
            ms, step = run_way(way, k, args, out)
            steps[way] = step
            if ms is None:
                say(f"FAIL {way} round {k}: the run failed ({out / f'{way}_{k}.log'}); {step}")
                continue
            times[way].append(ms)
            say(f"INFO {way} round {k}: {ms:.3f} ms a step; {step}")
    medians = {w: statistics.median(t) for w, t in times.items() if t}
    took = "eager" if "whole-step graph off" in steps.get("auto", "") else "graph"
    other = "eager" if took == "graph" else "graph"
    predicted = predictions(steps.get("auto", ""))
    failures = sum(line.startswith("FAIL") for line in lines)
    if "auto" in medians and other in medians:
        ok = medians["auto"] <= medians[other] * (1 + args.slack)
        failures += not ok
        pred = ", ".join(f"{w} {v:.2f}" for w, v in predicted.items()) or "none in the step line"
        forced = ", ".join(f"{w} {medians[w]:.3f}" for w in ("graph", "eager") if w in medians)
        say(
            f"{'PASS' if ok else 'FAIL'} choice on {args.nproc} GPUs: auto took the {took} step, measured "
            f"{medians['auto']:.3f} ms a step; forced: {forced} (the forced {took} step may plan otherwise: auto "
            f"also replays the eager search's plan where the graph holds it); predicted (with the dense part) {pred}"
        )
    else:
        failures += 1
        say(f"FAIL choice on {args.nproc} GPUs: no measurement of both ways ({sorted(medians)})")
    return finish(lines, failures, out / "graph_choice.txt")


if __name__ == "__main__":
    sys.exit(main())
