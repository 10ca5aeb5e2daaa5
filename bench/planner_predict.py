"""Planner predictions to compare with measurements: for each workload, the plan, its predicted step time and
predicted peak GPU memory per rank, one line each, and the plan saved so the measuring benchmark can load it.

Workloads (configs/planner/): hetero124 and uniform26 at full GPU memory, and overflow with --hbm-gib 16 so
it does not fit in HBM (large tables go to UVM-caching). For hetero124 also TorchRec-like variants with fixed
placements (all table-wise; tiny tables data-parallel; + huge tables row-wise), the variants measured with
TorchRec on 2 H200 (19.79, 7.47, 8.45 ms/step), so the model's differences can be checked too.

On the GPU machine (reads the GPUs; --topology FILE uses `embshard calibrate` numbers instead; --torchrec adds
TorchRec's own plan for each workload, given the same GPU memory, predicted by the same model):
    python bench/planner_predict.py --detect --out-dir plans [--torchrec]
Without GPUs (preset speeds):
    python bench/planner_predict.py --device h200 --world-size 2

Each line: workload=... variant=... predicted_ms=... predicted_peak_hbm_gib=... (max over ranks: shards + batch
buffers, without the dense model) per_rank_hbm_gib=[...] per_rank_host_gib=[...] plan=FILE
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from embshard.plan import MemoryTier, ShardingPlan, ShardingType  # noqa: E402
from embshard.planner import PlanReport, Topology, plan_with_report, predict, simple_plan  # noqa: E402
from embshard.planner.tools.inputs import PlannerInput, load_planner_input  # noqa: E402
from embshard.planner.topology import GIB  # noqa: E402

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
    args = p.parse_args(argv)
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
            from torchrec_planner import torchrec_plan

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
