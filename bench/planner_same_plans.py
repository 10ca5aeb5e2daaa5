"""Does the planner of this tree plan exactly what the planner of another commit plans? For changes meant only to
make planning faster: each model's plan (every table's sharding, tier, kernel and shards) and its predicted step
times (the GPUs', the search's, the host's) must match to the last bit.

    python -m bench.planner_same_plans --against main [--large] [--out DIR]

The other commit's `embshard` and `bench` are unpacked (git archive) into a temporary folder and plan in a child
process there; this tree's plan in another, both with one string hash seed (the host step time's last bit
follows the order its terms are added in, which follows string hashing). The models are bench/planner_scale.py's mixed tables: a dozen of
20-2,000 tables on 1-256 GPUs (one-host and multi-host worlds), and with --large 10,000 tables on 512 GPUs. Prints
one PASS/FAIL line per model and FAIL overall on any difference (exit status 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = [  # (tables, seed, world size, local world size)
    (20, 1, 8, 8),
    (50, 2, 4, 4),
    (100, 0, 8, 8),
    (100, 3, 16, 8),
    (200, 4, 32, 8),
    (300, 5, 8, 8),
    (500, 6, 64, 8),
    (1000, 0, 64, 8),
    (150, 7, 2, 2),
    (400, 8, 128, 8),
    (60, 9, 1, 1),
    (2000, 1, 256, 8),
]
LARGE = (10000, 0, 512, 8)


def plan_all(models: list[tuple[int, int, int, int]]) -> dict[str, list[str]]:
    """{model: [plan digest, step, GPU step, search step, host step]} of this process's planner."""
    from bench.planner_scale import batch_size, mixed_tables
    from embshard.planner import Topology, plan_with_report

    out = {}
    for n, seed, world, local in models:
        tables = mixed_tables(n, seed=seed, world_size=world)
        plan, rep = plan_with_report(tables, Topology.preset("h100", world, local), batch_size(n))
        steps = [rep.step_time_s, rep.gpu_step_time_s, rep.search_step_time_s, rep.host_step_time_s]
        out[f"{n} tables x {world} GPUs (seed {seed})"] = [hashlib.sha1(repr(plan).encode()).hexdigest()] + [
            repr(s) for s in steps
        ]
    return out


def plans_in(root: Path, models: list[tuple[int, int, int, int]]) -> dict[str, list[str]]:
    """plan_all run by a child process on the code under `root`."""
    code = f"import json, sys; from bench.planner_same_plans import plan_all; print(json.dumps(plan_all({models!r})))"
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"}  # the host step sums in set order
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--against", default="main", help="the commit (or branch) whose plans this tree must match")
    p.add_argument("--large", action="store_true", help="also 10,000 tables on 512 GPUs (about a minute more)")
    p.add_argument("--out", type=Path, help="folder for the plans of both as JSON")
    args = p.parse_args()
    models = MODELS + ([LARGE] if args.large else [])
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", args.against, "embshard", "bench"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        (Path(tmp) / "bench" / "planner_same_plans.py").write_text(Path(__file__).read_text())
        theirs = plans_in(Path(tmp), models)
    ours = plans_in(ROOT, models)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "planner_same_plans.json").write_text(json.dumps({"against": theirs, "this": ours}, indent=1))
    failed = 0
    for name in theirs:
        same = theirs[name] == ours[name]
        failed += not same
        detail = "" if same else f": {args.against} {theirs[name]} | this tree {ours[name]}"
        print(f"{'PASS' if same else 'FAIL'} {name}{detail}")
    print(
        f"{'PASS' if not failed else 'FAIL'}: {len(theirs) - failed} of {len(theirs)} plans the same as {args.against}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
