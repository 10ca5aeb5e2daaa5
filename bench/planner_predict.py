"""Planner predictions to compare with measurements: for each workload, the plan, its predicted step time and
predicted peak GPU memory per rank, one line each, and the plan saved so the measuring benchmark can load it.

Workloads (configs/planner/): hetero124 and uniform26 at full GPU memory, and overflow with --hbm-gib 16 so
it does not fit in HBM (large tables go to UVM-caching). For hetero124 also TorchRec-like variants with fixed
placements (all table-wise; tiny tables data-parallel; + huge tables row-wise), the variants measured with
TorchRec on 2 H200 (19.79, 7.47, 8.45 ms/step), so the model's differences can be checked too.

On the GPU machine (reads the GPUs; --topology FILE uses `embshard calibrate` numbers instead; --torchrec adds
TorchRec's own plan for each workload, given the same GPU memory, predicted by the same model):
    python -m bench.planner_predict --detect --out-dir plans [--torchrec]
Without GPUs (preset speeds):
    python -m bench.planner_predict --device h200 --world-size 2

Each line: workload=... variant=... predicted_ms=... predicted_peak_hbm_gib=... (max over ranks: shards + batch
buffers, without the dense model) per_rank_hbm_gib=[...] per_rank_host_gib=[...] plan=FILE

Refit a GPU model's constants (embshard/planner/presets/DEVICE.yaml) to benchmark logs of that GPU, one command
after `python -m bench.run emb kernels --out OUT` (emb.log has each run's RESULT line and the plan it ran):
    python -m bench.planner_predict --refit --device h100 --steps OUT/emb.log --kernels OUT/kernels.log --write
Predicted against every measured embedding step of embshard's runtime kept in the repository (one line per GPU
model and workload, static or raw ids, the plan it ran; tests/planner/test_planner_measured.py pins them within
10%), with the raw-id cases' remap term by term, and with --fit the shared host cost and the per-bag cost refitted
to the static cases (values to put into presets/*.yaml), then the raw-id remap's cost per id (cost.RAW_ID_BYTES)
to the raw-id cases (host_sync and batch_bag to the static cases with device batch counts only: host_sync is the
cost of the device sync that host counts, the training pipeline's, avoid; each case is predicted with its counts):
    python -m bench.planner_predict --measured [tests/planner/data/measured_steps.json] [--fit]
--kernels refits the small-table kernel's constants (forward per id, backward and data-parallel dense gradient
per atomic sector), --steps the fixed cost of a step (embshard/planner/refit.py); it prints every measured
step against the prediction before and after, and --write rewrites the preset file (or --out FILE).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from embshard.planner import PlannerSettings, PlanReport, Topology, plan_with_report, predict, simple_plan  # noqa: E402
from embshard.planner.topology import GIB  # noqa: E402
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType  # noqa: E402
from embshard.tools.plan_inputs import PlannerInput, load_planner_input  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = [("hetero124", None), ("uniform26", None), ("overflow", 16.0)]  # (config, --hbm-gib)


def line(workload: str, variant: str, report: PlanReport, plan_file: Path | None) -> str:
    """The one comparable line."""
    hbm = ",".join(f"{r.peak_hbm / GIB:.2f}" for r in report.ranks)
    host = ",".join(f"{float(r.storage.ddr) / GIB:.2f}" for r in report.ranks)
    kinds: dict[str, int] = {}
    for t in report.tables:
        key = f"{t.sharding}/{t.tier}" + (f"/{t.kernel}" if t.kernel != "fbgemm" else "")
        kinds[key] = kinds.get(key, 0) + 1
    mix = ",".join(f"{k}:{v}" for k, v in sorted(kinds.items()))
    return (
        f"workload={workload} variant={variant} world_size={report.topology.world_size} "
        f"predicted_ms={report.step_time_s * 1e3:.3f} predicted_peak_hbm_gib={report.peak_hbm / GIB:.2f} "
        f"per_rank_hbm_gib=[{hbm}] per_rank_host_gib=[{host}] tables={mix}"
        + (f" plan={plan_file}" if plan_file else "")
    )


def torchrec_like_variants(inp: PlannerInput, world: int) -> dict[str, ShardingPlan]:
    """Fixed hetero124 placements: all table-wise (TorchRec's plan at 130 GiB), tiny tables data-parallel, and
    tiny data-parallel with the huge tables row-wise."""
    tables = inp.tables
    small = {t.name: ShardingType.DATA_PARALLEL for t in tables if t.name.startswith("small")}
    big_rw = {t.name: ShardingType.ROW_WISE for t in tables if t.name.startswith("big")}
    return {
        "all-table-wise": simple_plan(tables, world, tier=MemoryTier.HBM),
        "small-dp": simple_plan(tables, world, sharding_types=small, tier=MemoryTier.HBM),
        "small-dp,big-rw": simple_plan(tables, world, sharding_types={**small, **big_rw}, tier=MemoryTier.HBM),
    }


def dmp_workload(name: str) -> tuple[list, int]:
    """The tables and batch per rank of a bench/embshard_dmp.py workload (the names its saved plans use)."""
    from bench.workloads import WORKLOADS, workload_tables

    if name not in WORKLOADS:
        raise SystemExit(f"workload {name!r} is not one of bench/embshard_dmp.py's: {sorted(WORKLOADS)}")
    return workload_tables(name), WORKLOADS[name][1]


def refit(args: argparse.Namespace) -> None:
    """--refit: fit the device's constants to the logs, print the fit, rewrite the preset file with --write."""
    from embshard.planner import refit as rf
    from embshard.planner.presets import preset_path
    from embshard.spec.optim import FusedOptimizerConfig

    if not (args.kernels or args.steps):
        raise SystemExit(
            "--refit needs --kernels LOG (bench/kernels.py) and/or --steps LOG... (bench/run.py emb's log)"
        )
    from embshard.planner.topology import preset_for_gpu

    for log_file in [*filter(None, [args.kernels]), *(args.steps or [])]:
        gpu = rf.gpu_of_log(Path(log_file).read_text())
        if gpu and preset_for_gpu(gpu, 0) != args.device:
            raise SystemExit(f"{log_file} was measured on {gpu!r}, not on a {args.device}: pass --device for that GPU")
    topo = Topology.preset(args.device, 2)
    updates: dict[str, float] = {}
    why: dict[str, str] = {}
    stamp = time.strftime("%Y-%m-%d")
    if args.kernels:
        log = rf.parse_kernel_log(Path(args.kernels).read_text(), args.kernels)
        fitted, lines = rf.fit_kernel_log(log, topo)
        print(f"# small-table kernel, {args.kernels}:")
        print("\n".join(lines))
        for k, v in fitted.items():
            print(f"{k}: {getattr(topo, k) * 1e12:.2f} -> {v * 1e12:.2f} ps")
            why[k] = f"fitted to {args.kernels} ({stamp}, bench/kernels.py, uniform ids)"
        updates.update(fitted)
        topo = replace(topo, **fitted)
    if args.steps:
        import json

        runs = [r for path in args.steps for r in rf.parse_step_log(Path(path).read_text())]
        if not runs:
            raise SystemExit(f"{args.steps}: no embedding-step results ('RESULT framework=embshard bench=emb ...')")
        opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
        bare = replace(topo, step_overhead_s=0.0)
        rows, predicted, measured = [], [], []
        for run in runs:
            workload, world = run["workload"], int(run.get("world", 2))
            hbm = float(run.get("hbm_gib", 0) or 0) or None
            tables, batch = dmp_workload(workload)
            machine = bare.with_sizes(world, hbm_gib=hbm)
            # the run's batch counts (RESULT counts=host|device; logs from before --counts: device, one sync a step)
            counts = run.get("counts", "device")
            settings = PlannerSettings(batch_counts=counts)
            if run["plan_json"] is not None:
                plan, how = ShardingPlan.from_dict(json.loads(run["plan_json"])), "its plan"
            else:  # logs before the PLAN lines: the plan the planner makes now (the same where the preset agrees)
                plan, how = plan_with_report(tables, machine, batch, opt, settings=settings)[0], "re-planned"
            report = predict(plan, tables, machine, batch, opt, settings=settings)
            rows.append((workload, f"{how}, {counts}", run["seconds"], report.step_time_s))
            predicted.append(report.step_time_s)
            measured.append(run["seconds"])
        c = rf.fit_step_overhead(predicted, measured)
        old = Topology.preset(args.device, 2).step_overhead_s
        print(f"# steps ({len(rows)} runs): step_overhead {old * 1e6:.0f} -> {c * 1e6:.0f} us")
        for workload, how, seconds, p0 in rows:
            print(
                f"{workload:10s} {how:19s} measured {seconds * 1e3:7.2f} ms  predicted {(p0 + old) * 1e3:7.2f} "
                f"({(p0 + old) / seconds - 1:+.0%}) -> {(p0 + c) * 1e3:7.2f} ({(p0 + c) / seconds - 1:+.0%})"
            )
        updates["step_overhead_s"] = c
        logs = ", ".join(args.steps)
        why["step_overhead_s"] = f"fitted to {logs} ({stamp}: {len(rows)} steps, relative least squares)"
    if args.write or args.out:
        target = Path(args.out) if args.out else preset_path(args.device)
        rf.rewrite_preset(preset_path(args.device), updates, why, out=target)
        print(f"wrote {target}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="h200", help="preset when neither --detect nor --topology is given")
    p.add_argument("--detect", action="store_true", help="read this machine's GPUs (memory sizes, GPU model)")
    p.add_argument("--topology", help="topology YAML written by `embshard calibrate`")
    p.add_argument("--zipf", type=float, help="access skew the benchmark's ids follow (default: each config's, 0)")
    p.add_argument("--out-dir", default="plans", help="where the plans are saved (YAML)")
    p.add_argument("--verbose", action="store_true", help="also print each full report")
    p.add_argument("--torchrec", action="store_true", help="also plan with TorchRec (given the same GPU memory)")
    p.add_argument("--refit", action="store_true", help="refit --device's constants to --kernels / --steps logs")
    p.add_argument("--kernels", help="--refit: bench/kernels.py output of one GPU of that model")
    p.add_argument(
        "--steps", nargs="+", help="--refit: logs with bench/embshard_dmp.py's RESULT lines (bench/run.py emb)"
    )
    p.add_argument("--write", action="store_true", help="--refit: rewrite embshard/planner/presets/DEVICE.yaml")
    p.add_argument("--out", help="--refit: write the refitted preset here instead")
    p.add_argument(
        "--measured",
        nargs="?",
        const=str(ROOT / "tests" / "planner" / "data" / "measured_steps.json"),
        help="print predicted against the measured steps of this JSON file (default: the tests' table)",
    )
    p.add_argument(
        "--fit", action="store_true", help="--measured: refit host_sync and batch_bag (and RAW_ID_BYTES) to them"
    )
    args = p.parse_args(argv)
    if args.measured:
        from embshard.planner import measured as ms

        cases, _ = ms.load_cases(args.measured)
        print("\n".join(ms.table(cases)))
        for c in cases:
            if c.ids == "raw":  # the raw-id tables' remap, term by term
                print("\n".join(ms.raw_breakdown(c)))
        if args.fit:
            print("\n".join(ms.fit_host_and_bag(cases)[2]))
            for gpu in sorted({c.gpu for c in cases if c.step == "eager"}):
                try:
                    print("\n".join(ms.fit_host_floor(cases, gpu)[1]))
                except ValueError as e:
                    print(e)
            if any(c.ids == "raw" for c in cases):
                print("\n".join(ms.fit_raw_id_bytes(cases)[1]))
        return
    if args.refit:
        refit(args)
        return
    if args.topology:
        base = Topology.load(args.topology).with_sizes(args.world_size)
    elif args.detect:
        base = Topology.detect(args.world_size)
    else:
        base = Topology.preset(args.device, args.world_size)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# topology: {base.describe()}")
    lines = []
    for name, hbm_gib in WORKLOADS:
        inp = load_planner_input(ROOT / "configs" / "planner" / f"{name}.yaml")
        settings = inp.settings if args.zipf is None else replace(inp.settings, zipf_alpha=args.zipf)
        topo = base.with_sizes(hbm_gib=hbm_gib)
        plan, report = plan_with_report(inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings)
        path = out_dir / f"{name}.yaml"
        plan.save(path)
        if args.verbose:
            print(report, "\n")
        lines.append(line(name, "planner" + (f"@hbm{hbm_gib:g}GiB" if hbm_gib else ""), report, path))
        if args.torchrec:
            from bench.torchrec_planner import torchrec_plan

            tplan = torchrec_plan(
                inp.tables, topo.world_size, topo.local_world_size, topo.hbm_bytes / GIB, inp.batch_size
            )
            tpath = out_dir / f"{name}.torchrec.yaml"
            tplan.save(tpath)
            treport = predict(tplan, inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings)
            lines.append(line(name, "torchrec-planner", treport, tpath))
        if name == "hetero124":
            for variant, vplan in torchrec_like_variants(inp, topo.world_size).items():
                vpath = out_dir / f"{name}.{variant.replace(',', '+')}.yaml"
                vplan.save(vpath)
                vreport = predict(vplan, inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, settings)
                lines.append(line(name, variant, vreport, vpath))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
