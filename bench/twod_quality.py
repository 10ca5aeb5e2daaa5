"""Held-out AUC of 2D sharding: periodic replica sync (every N steps) against exact sync and against no 2D.

Each variant is one `embshard train` run of the same config, seed and data (configs/dlrm_synthetic.yaml by
default: synthetic clicks from a hidden model, so AUC measures what the model learned), on `--nproc` ranks in
sharding groups of `--group-size`:

    none        no 2D: every rank in one sharding group (the reference)
    exact       2D, replica_sync exact: the same update every step as `none` (AUC equal up to float rounding)
    periodic_N  2D, replica_sync periodic every N steps: each group trains on its own batches, averaged every N

Prints one line per variant (held-out loss and AUC at the end, the last logged training throughput, wall time) and checks: PASS when exact's AUC is
within `--exact-tol` of none's (it trains the same model), and reports how far each periodic variant falls below
exact (no verdict: that is the trade the setting makes). Writes `twod_quality.json` under --out.

    python -m bench.twod_quality --out /tmp/twod                    # CPU: 4 processes, groups of 2 (minutes)
    python -m bench.twod_quality --out /tmp/twod --nproc 8 --group-size 4 --steps 2000 --every 1 10 100  # 8 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"^train step\s+\d+\s+loss\s+[0-9.]+\s+([0-9.]+)\s+samples/s", re.M)
EVAL = re.compile(r"^eval\s+step\s+(\d+)\s+loss\s+([0-9.]+)\s+auc\s+([0-9.]+)", re.M)


def run_variant(args: argparse.Namespace, twod: list[str]) -> dict:
    """One `embshard train` run; its last held-out loss and AUC, and its wall time."""
    cmd = [sys.executable, "-m", "embshard.cli", "train", args.config, "--nproc", str(args.nproc)]
    cmd += [
        f"schedule.steps={args.steps}",
        f"schedule.batch_size={args.batch_size}",
        "schedule.eval_every=0",
        "schedule.eval_at_start=false",
        f"data.synthetic.eval_batches={args.eval_batches}",
        "checkpoint.dir=null",
        "logging.tensorboard_dir=null",
        "logging.progress_bar=false",
        f"seed={args.seed}",
        *twod,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        return {"ok": False, "error": (res.stdout + res.stderr)[-2000:], "wall_s": wall}
    found = EVAL.findall(res.stdout)
    if not found:
        return {"ok": False, "error": "no eval line in the output", "wall_s": wall}
    step, loss, auc = found[-1]
    same = "replicas identical" in res.stdout if twod else True
    speeds = SPEED.findall(res.stdout)
    speed = float(speeds[-1]) if speeds else None  # the last logged window's training throughput
    return {
        "ok": True,
        "step": int(step),
        "loss": float(loss),
        "auc": float(auc),
        "wall_s": wall,
        "samples_per_s": speed,
        "identical": same,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for twod_quality.json")
    p.add_argument("--config", default="configs/dlrm_synthetic.yaml")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--every", type=int, nargs="+", default=[1, 10, 50], help="periodic sync intervals to try")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact-tol", type=float, default=0.005, help="largest |AUC(exact) - AUC(none)| that passes")
    args = p.parse_args(argv)
    variants = {"none": [], "exact": [f"sharding.group_size={args.group_size}", "sharding.replica_sync=exact"]}
    for n in args.every:
        variants[f"periodic_{n}"] = [
            f"sharding.group_size={args.group_size}",
            "sharding.replica_sync=periodic",
            f"sharding.replica_sync_every={n}",
        ]
    results = {}
    for name, twod in variants.items():
        r = results[name] = run_variant(args, twod)
        if r["ok"]:
            speed = f"{r['samples_per_s']:.0f} samples/s" if r["samples_per_s"] is not None else "no throughput line"
            print(
                f"RESULT twod_quality {name}: auc {r['auc']:.4f} loss {r['loss']:.4f} {speed} wall {r['wall_s']:.1f} s"
            )
        else:
            print(f"FAIL twod_quality {name}: the run failed:\n{r['error']}")
    ok = all(r["ok"] for r in results.values())
    if ok:
        gap = abs(results["exact"]["auc"] - results["none"]["auc"])
        verdict = "PASS" if gap <= args.exact_tol else "FAIL"
        ok = verdict == "PASS"
        print(f"{verdict} twod_quality exact vs none: |AUC difference| {gap:.4f} (at most {args.exact_tol})")
        for name, r in results.items():
            if not r["identical"]:
                ok = False
                print(f"FAIL twod_quality {name}: the replicas differ at the end of the run")
            if name.startswith("periodic"):
                print(f"RESULT twod_quality {name}: AUC {r['auc'] - results['exact']['auc']:+.4f} against exact")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "twod_quality.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
