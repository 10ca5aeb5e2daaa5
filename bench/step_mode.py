"""The step mode on GPUs: `training.precision=bf16` alone takes the fastest step, and the other settings do what they say.

    python -m bench.step_mode --out DIR [--nproc 2] [--scale 0.05] [--steps 30] [--warmup 10] [--cases a,b]

Runs bench/train_e2e.py on the MLPerf config (configs/dlrm_dcnv2_mlperf.yaml, tables at --scale of their rows) once
per case, each in its own processes, and checks the step-mode line it prints (embshard/training/mode.py) and its
RESULT line (whole_step, cuda_graph, compile, pooled) against what the case expects:

    default     --precision bf16 alone: the whole step as one CUDA graph, bf16 pooled outputs, the compiled dense part
                (the line gives the planner's predictions of the graph's plan and the eager step's)
    explicit    the four settings that used to be needed (lookup.output_dtype=bf16 training.cuda_graph=true
                training.compile=default): the same mode
    eager       bf16 with training.cuda_graph=false training.compile=none: the eager step (for debugging)
    row_wise    bf16 with every table row-wise (planner.settings.sharding_types=[row_wise]): the dense step's graph,
                and the line names why the whole step is not captured and the setting that would allow it
    fp32        --precision fp32: the eager step, fp32 pooled outputs, the line says bf16 is what makes it fast

Prints `PASS case ms_per_step=...` or `FAIL case: why` per case, then `ALL PASS` or the count of failures, and
writes each case's output to DIR/<case>.log and the lines to DIR/step_mode.txt. Exit status 1 on any failure."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.verdict import finish

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
FAST = "step: whole-step CUDA graph, bf16 pooled outputs, compiled dense (auto; the planner's choice: predicted "
"""training.cuda_graph auto: the planner prices the graph's plan against the eager step's and says so (2 GPUs, no
hot table: the graph's)."""

CASES: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    # case: (train_e2e arguments, RESULT fields expected, texts expected in the output)
    "default": (["--precision", "bf16"], {"whole_step": "1", "compile": "default", "pooled": "bf16"}, [FAST]),
    "explicit": (
        ["--precision", "bf16", "lookup.output_dtype=bf16", "training.cuda_graph=true", "training.compile=default"],
        {"whole_step": "1", "compile": "default", "pooled": "bf16"},
        ["step: whole-step CUDA graph, bf16 pooled outputs, compiled dense ("],
    ),
    "eager": (
        ["--precision", "bf16", "training.cuda_graph=false", "training.compile=none"],
        {"whole_step": "0", "cuda_graph": "0", "compile": "none", "pooled": "bf16"},
        ["step: eager, bf16 pooled outputs (auto)"],
    ),
    "row_wise": (
        ["--precision", "bf16", "planner.settings.sharding_types=[row_wise]"],
        {"whole_step": "0", "cuda_graph": "1", "compile": "default", "pooled": "bf16"},
        ["step: dense-step CUDA graph, bf16 pooled outputs, compiled dense (auto; whole-step graph off: the plan has"],
    ),
    "fp32": (
        ["--precision", "fp32"],
        {"whole_step": "0", "cuda_graph": "0", "compile": "none", "pooled": "fp32"},
        [
            "step: eager, fp32 pooled outputs (auto; CUDA graphs off: training.precision is fp32",
            "training.precision=bf16",
        ],
    ),
}


def check(case: str, out: str, returncode: int) -> tuple[bool, str]:
    """(passed, the line to print) of one case's run."""
    _argv, fields_expected, texts = CASES[case]
    if returncode != 0:
        return False, f"FAIL {case}: exit status {returncode}; last lines: {' | '.join(out.splitlines()[-5:])}"
    result = next((ln for ln in out.splitlines() if ln.startswith("RESULT framework=embshard")), None)
    if result is None:
        return False, f"FAIL {case}: no RESULT line"
    fields = dict(kv.split("=", 1) for kv in result.split()[1:] if "=" in kv)
    wrong = {k: (fields.get(k), v) for k, v in fields_expected.items() if fields.get(k) != v}
    missing = [t for t in texts if t not in out]
    mode = next((ln for ln in out.splitlines() if ln.startswith("step: ")), "(no step line)")
    if wrong or missing:
        return False, f"FAIL {case}: RESULT fields (got, expected) {wrong}; missing texts {missing}; printed: {mode}"
    return (
        True,
        f"PASS {case} ms_per_step={fields.get('ms_per_step')} samples_per_s={fields.get('samples_per_s')}: {mode}",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the logs and step_mode.txt (created)")
    ap.add_argument("--nproc", type=int, default=2, help="GPUs (one process each)")
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of every table's rows")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (the captures happen here)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("note: no CUDA GPU here: the cases expect the GPUs' step modes, so the CPU's runs fail them", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines, failures = [], 0
    for case in args.cases.split(","):
        extra = CASES[case][0]
        cmd = [sys.executable, "-m", "bench.train_e2e", "--config", CONFIG, "--nproc", str(args.nproc),
               "--scale", f"{args.scale:g}", "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--tag", f"step_mode_{case}", *extra]  # fmt: skip
        t0 = time.time()
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            out, code = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            out, code = f"{e.stdout or ''}{e.stderr or ''}", -1
        (out_dir / f"{case}.log").write_text(" ".join(cmd) + "\n" + out)
        passed, line = check(case, out, code)
        failures += not passed
        line += f" ({time.time() - t0:.0f} s)"
        print(line, flush=True)
        lines.append(line)
    return finish(lines, failures, out_dir / "step_mode.txt")


if __name__ == "__main__":
    sys.exit(main())
