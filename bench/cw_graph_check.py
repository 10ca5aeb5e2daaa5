"""GPU check of column-wise tables in the whole-step CUDA graph, and of the planner's balance for graphed jobs.

    python -m bench.cw_graph_check --out DIR                     # 1 GPU: parity; planner shares (no GPU needed)
    python -m bench.cw_graph_check --out DIR --e2e --nproc 2     # + the MLPerf e2e with a timeline (busy shares)

1. Parity on CUDA (NCCL, `EMBSHARD_TEST_DEVICE=cuda`): the whole training step captured as one CUDA graph, with a
   column-wise table (two column blocks, row-wise Adagrad's exact update) beside table-wise and data-parallel ones,
   trains like the eager step (losses, dense and embedding weights), fixed bags and ragged bags padded to a capacity,
   and replays (tests/test_step_graph.py at world 1, and at world 2 when 2 GPUs are visible); the collection's own
   step graph likewise (tests/test_emb_graph.py). One `PASS name seconds` or `FAIL name: last lines` per test.
2. The planner's plans for the graphed MLPerf model (configs/dlrm_dcnv2_mlperf.yaml, bf16) at 2, 4 and 8 H100s: each
   rank's lookups over a balanced rank's, the predicted step, the slowest rank's predicted time over the mean rank's,
   and how the hot tables are placed; `PASS` when every plan is one the graph holds and the busiest share is under
   1.2 at 2 and 4 GPUs (1.35 at 8). Then `auto` (what training.cuda_graph auto asks for): the plan taken, both
   predictions; `PASS` when it is the faster of the graph's plan and the eager step's.
3. `--e2e`: bench/run.py's e2e suite with `--timeline` at bf16 on --nproc GPUs: its timeline_bf16.png and the GPU
   busy share per stream (bench/timeline.py) to compare the ranks (before: rank 0 busy 91.9%, rank 1 88.7% on 2 H100s,
   the hot tables whole on one rank).

Every line also goes to DIR/cw_graph_check.txt; `ALL PASS` or `N FAILED` at the end, exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.verdict import finish

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_step_graph.py::test_whole_step_graph_on_one_rank_trains_like_the_eager_step",
    "tests/test_step_graph.py::test_whole_step_graph_trains_like_the_eager_step",
    "tests/test_emb_graph.py::test_graphed_step_trains_like_the_eager_step",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, EMBSHARD_TEST_DEVICE="cuda", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def parity(lines: list[str]) -> int:
    failures = 0
    for test in TESTS:
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", test, "-p", "no:cacheprovider"]
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        out, secs = done.stdout + done.stderr, time.perf_counter() - start
        tail = " | ".join(out.strip().splitlines()[-6:])
        if done.returncode == 0 and " passed" in out:
            lines.append(f"PASS {test} {secs:.1f} s")
        elif done.returncode == 0:  # skipped: fewer GPUs than the test's world
            lines.append(f"SKIP {test}: {tail}")
        else:
            failures += 1
            lines.append(f"FAIL {test}: {tail}")
        print(lines[-1], flush=True)
    return failures


def time_shares(report) -> list[float]:
    """Each rank's predicted time over the mean rank's (what the cost model balances: a column block of width d
    costs its rank every id's and every touched row's work of the table, not d/D of it)."""
    times = [r.time_s for r in report.ranks]
    mean = sum(times) / len(times)
    return [t / mean for t in times]


def planner_shares(lines: list[str]) -> int:
    from embshard.planner import Topology
    from embshard.planner.balance import busy_shares, hot_tables
    from embshard.planner.policy import search_plan
    from embshard.spec.graph_rules import plan_refusal
    from embshard.tools.plan_inputs import training_planner_input

    overrides = ["training.precision=bf16", "lookup.output_dtype=bf16", "training.cuda_graph=false"]
    inp, _ = training_planner_input("configs/dlrm_dcnv2_mlperf.yaml", overrides)
    failures = 0
    for W, limit in ((2, 1.2), (4, 1.2), (8, 1.35)):
        topo = Topology.preset("h100", world_size=W)
        predicted = {}
        for graphed in (False, True, "auto"):
            said: list[str] = []
            settings = replace(inp.settings, whole_step_graph=graphed)
            plan, report = search_plan(
                inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings, said.append
            )
            predicted[graphed] = report.step_time_s
            shares, times = busy_shares(plan, inp.tables, inp.batch_size), time_shares(report)
            hot = {n: f"{plan[n].sharding_type.value}/{len(plan[n].shards)}" for n in hot_tables(inp.tables, W)}
            name = {False: "eager  ", True: "graphed", "auto": "auto   "}[graphed]
            text = (
                f"{W} GPUs {name}: busiest {max(shares):.2f} ({' '.join(f'{s:.2f}' for s in shares)}), predicted "
                f"step {report.step_time_s * 1e3:.3f} ms, slowest rank's time {max(times):.2f} x the mean, hot "
                f"tables {hot}"
            )
            if graphed is False:
                lines.append(f"INFO {text}")
            elif graphed == "auto":  # the faster of the two, as training.cuda_graph auto takes it
                choice = report.graph_choice
                text += f"; {choice.line().strip()}"
                right = choice.graph is (predicted[True] <= predicted[False] or choice.same_plan)
                ok = right and report.step_time_s <= min(predicted[True], predicted[False]) * (1 + 1e-9)
                failures += not ok
                lines.append(f"{'PASS' if ok else 'FAIL'} planner {text}")
            elif said or plan_refusal(inp.tables, plan) is not None or max(shares) >= limit:
                failures += 1
                lines.append(f"FAIL planner {text}; {said[:1]}")
            else:
                lines.append(f"PASS planner {text}")
            print(lines[-1], flush=True)
    return failures


def e2e(out: Path, nproc: int, lines: list[str]) -> int:
    cmd = [sys.executable, "-m", "bench.run", "e2e", "--out", str(out / "e2e"), "--nproc", str(nproc)]
    cmd += ["--timeline", "--precisions", "bf16", "--pairs", "1"]
    lines.append(f"RUN {' '.join(cmd)}")
    print(lines[-1], flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    busy = [ln for ln in (done.stdout + done.stderr).splitlines() if "busy" in ln or "kernels" in ln]
    lines.extend(f"INFO {ln.strip()}" for ln in busy[-16:])
    ok = done.returncode == 0
    lines.append(
        f"{'PASS' if ok else 'FAIL'} e2e exit {done.returncode}: {out / 'e2e'} (e2e.log, timeline_bf16.png, summary.md)"
    )
    print("\n".join(lines[-len(busy[-16:]) - 1 :]), flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--e2e", action="store_true", help="also the MLPerf e2e with a timeline")
    p.add_argument("--nproc", type=int, default=2, help="GPUs for --e2e")
    p.add_argument("--no-parity", action="store_true", help="skip the CUDA parity tests")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    failures = 0 if args.no_parity else parity(lines)
    failures += planner_shares(lines)
    if args.e2e:
        failures += e2e(out, args.nproc, lines)
    return finish(lines, failures, out / "cw_graph_check.txt")


if __name__ == "__main__":
    sys.exit(main())
