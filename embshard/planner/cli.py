"""`embshard plan CONFIG.yaml --world-size N ...`: plan without GPUs; print the plan, per-table and per-rank
predictions, and save the plan (the file training loads instead of planning again), the report and a plot."""

from __future__ import annotations

import argparse
import sys

from embshard.planner.explain import explain
from embshard.planner.inputs import load_planner_input
from embshard.planner.search import plan_with_report
from embshard.planner.topology import Topology
from embshard.tables import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embshard plan", description=__doc__)
    p.add_argument("config", help="planner-input YAML (configs/planner/*.yaml)")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    p.add_argument("--local-world-size", type=int, help="ranks per host (default: min(world size, 8))")
    p.add_argument("--device", help="GPU preset for dry runs: h100, h200, a100, cpu (default: the config's, else h100)")
    p.add_argument("--topology", help="topology YAML from `embshard calibrate` (overrides --device)")
    p.add_argument("--detect", action="store_true", help="read this machine's GPUs instead of a preset")
    p.add_argument("--hbm-gib", type=float, help="GPU memory per rank (GiB), e.g. to plan for a smaller share")
    p.add_argument("--ddr-gib", type=float, help="host memory per rank (GiB)")
    p.add_argument("--hbm-reserve-gib", type=float, help="GPU memory per rank kept for the dense model (GiB)")
    p.add_argument("--batch-size", type=int, help="samples per rank per step (overrides the config)")
    p.add_argument("--format", choices=["table", "yaml", "json"], default="table", help="what to print")
    p.add_argument("--out", help="save the ShardingPlan (.yaml or .json)")
    p.add_argument("--report", help="save the PlanReport with predictions (.json or .yaml)")
    p.add_argument("--plot", help="save a PNG of memory and predicted time per rank")
    p.add_argument("--explain", action="append", default=[], metavar="TABLE", help="explain a table's placement")
    return p


def resolve_topology(args: argparse.Namespace, device: str | None) -> Topology:
    """The topology from --topology, --detect or a preset, resized by --world-size / memory flags."""
    if args.topology:
        topo = Topology.load(args.topology).with_sizes(args.world_size, args.local_world_size)
    elif args.detect:
        topo = Topology.detect(args.world_size, args.local_world_size)
    else:
        name = args.device or device
        if name is None:
            print("note: no --device, --topology or config device: assuming the h100 preset", file=sys.stderr)
            name = "h100"
        topo = Topology.preset(name, args.world_size, args.local_world_size)
    return topo.with_sizes(hbm_gib=args.hbm_gib, ddr_gib=args.ddr_gib)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        inp = load_planner_input(args.config)
        topo = resolve_topology(args, inp.device)
        settings = inp.settings
        if args.hbm_reserve_gib is not None:
            from dataclasses import replace

            settings = replace(settings, hbm_reserve_gib=args.hbm_reserve_gib)
        batch = args.batch_size or inp.batch_size
        plan, report = plan_with_report(inp.tables, topo, batch, inp.optimizer, inp.constraints, settings)
        if args.format == "table":
            print(report)
        elif args.format == "yaml":
            print(plan.to_yaml(), end="")
        else:
            print(plan.to_json())
        for name in args.explain:
            print()
            print(explain(report, name))
        if args.out:
            plan.save(args.out)
            print(f"plan saved to {args.out}", file=sys.stderr)
        if args.report:
            report.save(args.report)
            print(f"report saved to {args.report}", file=sys.stderr)
        if args.plot:
            from embshard.planner.plot import plot_report

            plot_report(report, args.plot)
            print(f"plot saved to {args.plot}", file=sys.stderr)
    except (ConfigError, KeyError) as e:
        print(f"embshard plan: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
