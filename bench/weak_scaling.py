"""Weak scaling on one host, measured against the planner's prediction: the MLPerf-shaped bf16 job
(configs/dlrm_dcnv2_mlperf.yaml, 8192 samples per GPU) trained on 2, 4 and 8 GPUs (as many as the machine has),
each with the plan `embshard train` makes (hot tables split: docs/planner.md, "Hot tables and 2D sharding").

    python -m bench.weak_scaling --out DIR [--world-sizes 2,4,8] [--steps 60]

Per world size: the planner's prediction on this machine (Topology.detect: the busiest rank's lookups over a
balanced rank's, the embedding step, the step with the dense model, samples/s per GPU), then bench/train_e2e.py's
measured ms/step and samples/s. PASS/FAIL lines: the busiest rank's predicted lookups at W within 1.2 x the
2-GPU plan's; the measured samples/s per GPU at each W kept at >= --keep (0.65: what TorchRec keeps at 4 x H100)
of the 2-GPU figure. Writes DIR/weak_scaling.md (the table) and DIR/train_W.log.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
OVERRIDES = ["lookup.output_dtype=bf16"]
RESULT = re.compile(r"^RESULT .*ms_per_step=([0-9.]+).*samples_per_s=([0-9.]+)", re.M)


def predict(world: int) -> tuple[float, float, float]:
    """(busiest rank's lookups over a balanced rank's, predicted step ms, predicted samples/s per GPU) of the plan
    `embshard plan` makes for `world` GPUs of this machine."""
    from embshard.planner.policy import search_plan
    from embshard.planner.topology import Topology
    from embshard.planner.twod import plan_at_scale
    from embshard.tools import plan_scale
    from embshard.tools.plan_inputs import training_planner_input_and_config

    inp, cfg = training_planner_input_and_config(CONFIG, [*OVERRIDES, "training.precision=bf16"])
    topo = Topology.detect(world, world)
    sp = plan_at_scale(
        inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, inp.settings, plan_scale.dense_spec(cfg),
        search=plan_scale.search_for(search_plan, inp),
    )  # fmt: skip
    print(sp.summary(), flush=True)
    return max(sp.busy_shares(inp.tables)), sp.best.step_s * 1e3, sp.samples_per_s_per_gpu


def measure(world: int, steps: int, out: Path) -> tuple[float, float]:
    """(ms/step, samples/s per GPU) of bench/train_e2e.py on `world` local GPUs."""
    cmd = [sys.executable, "-m", "bench.train_e2e", "--config", CONFIG, "--nproc", str(world), "--steps", str(steps),
           "--precision", "bf16", *OVERRIDES]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"train_{world}.log").write_text(run.stdout + run.stderr)
    m = RESULT.search(run.stdout)
    if run.returncode or m is None:
        print(f"FAIL train_e2e on {world} GPUs: exit {run.returncode}, see {out / f'train_{world}.log'}")
        return float("nan"), float("nan")
    return float(m.group(1)), float(m.group(2)) / world


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--keep", type=float, default=0.65)
    args = p.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = torch.cuda.device_count()
    worlds = [w for w in (int(x) for x in args.world_sizes.split(",")) if w <= n]
    if len(worlds) < 2:
        print(f"FAIL weak scaling needs at least 2 of {args.world_sizes} GPUs; this machine has {n}")
        sys.exit(1)
    rows = ["| GPUs | busiest rank (pred.) | step ms pred. | M samples/s/GPU pred. | ms/step meas. | "
            "M samples/s/GPU meas. | kept of the first |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    first_busy = first_meas = None
    ok = True
    for w in worlds:
        busy, step_ms, pred = predict(w)
        ms, meas = measure(w, args.steps, out)
        first_busy = first_busy or busy
        first_meas = first_meas or meas
        kept = meas / first_meas
        for name, good, text in (
            ("lookups", busy <= 1.2 * first_busy, f"busiest rank's predicted lookups {busy:.2f} (first {first_busy:.2f})"),
            ("throughput", kept >= args.keep, f"{meas / 1e6:.3f} M samples/s per GPU, {kept:.0%} of {worlds[0]} GPUs'"),
        ):  # fmt: skip
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} {w} GPUs {name}: {text}", flush=True)
        rows.append(
            f"| {w} | {busy:.2f} | {step_ms:.2f} | {pred / 1e6:.3f} | {ms:.2f} | {meas / 1e6:.3f} | {kept:.0%} |"
        )
    table = "\n".join(rows)
    print(table)
    (out / "weak_scaling.md").write_text(table + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
