"""`embshard plan CONFIG.yaml --world-size N ...`: plan without GPUs; print the plan, per-table and per-rank
predictions, and save the plan (the file training loads instead of planning again), the report and a plot.

CONFIG is a planner input (configs/planner/*.yaml) or a training config (configs/*.yaml: its tables,
schedule.batch_size, sparse_optimizer and planner section; key=value overrides as for `embshard train`).
--out, --report and --plot without a file name write into runs/plan/ (runs/ is where every embshard command
writes by default)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from embshard.planner.explain import explain
from embshard.planner.policy import search_plan, topology_for
from embshard.planner.topology import Topology
from embshard.planner.twod import plan_at_scale
from embshard.spec.tables import ConfigError
from embshard.tools import plan_scale
from embshard.tools.plan_inputs import (
    PlannerInput,
    is_training_config,
    planner_input_from_dict,
    training_planner_input_and_config,
)

OUT_DIR = Path("runs") / "plan"
"""Where --out, --report and --plot without a file name write."""
DEFAULT_FILES = {"out": "plan.yaml", "torchrec": "plan.torchrec.json", "report": "report.json", "plot": "plan.png"}
_SUFFIXES = {"out": (".yaml", ".yml", ".json"), "torchrec": (".json",), "report": (".json", ".yaml", ".yml")}
_SUFFIXES["plot"] = (".png",)
_DEFAULT = "<default>"  # --out / --report / --plot given without a file name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embshard plan", description=__doc__)
    p.add_argument("config", help="planner-input YAML (configs/planner/*.yaml) or training config (configs/*.yaml)")
    p.add_argument(
        "overrides", nargs="*", help="training configs only: key.sub=value overrides, e.g. planner.hbm_gib=8"
    )
    p.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    p.add_argument("--local-world-size", type=int, help="ranks per host (default: min(world size, 8))")
    p.add_argument(
        "--device",
        help="GPU preset for dry runs: h100, h200, a100, cpu (default: the planner input's device, else h100; "
        "for a training config: its planner.topology_file, else this machine)",
    )
    p.add_argument("--topology", help="topology YAML from `embshard calibrate` (overrides --device)")
    p.add_argument("--detect", action="store_true", help="read this machine's GPUs instead of a preset")
    p.add_argument("--hbm-gib", type=float, help="GPU memory per rank (GiB), e.g. to plan for a smaller share")
    p.add_argument("--ddr-gib", type=float, help="host memory per rank (GiB)")
    p.add_argument("--hbm-reserve-gib", type=float, help="GPU memory per rank kept for the dense model (GiB)")
    p.add_argument("--batch-size", type=int, help="samples per rank per step (overrides the config)")
    p.add_argument(
        "--format",
        choices=["table", "yaml", "json", "torchrec"],
        default="table",
        help="what to print; torchrec: the plan as TorchRec's (JSON; embshard.interop.load_torchrec_plan reads it)",
    )
    p.add_argument(
        "--out",
        nargs="?",
        const=_DEFAULT,
        help="save the ShardingPlan (.yaml or .json; default runs/plan/plan.yaml); with --format torchrec, "
        "TorchRec's (JSON; default runs/plan/plan.torchrec.json)",
    )
    p.add_argument(
        "--torchrec-module-path",
        default="",
        help="--format torchrec: path of the EmbeddingBagCollection in the module DMP wraps, e.g. "
        "model.sparse_arch.embedding_bag_collection (default: '', the collection itself)",
    )
    p.add_argument(
        "--torchrec-device", choices=["cuda", "cpu"], default="cuda", help="--format torchrec: TorchRec's device type"
    )
    p.add_argument(
        "--report",
        nargs="?",
        const=_DEFAULT,
        help="save the PlanReport with predictions (.json or .yaml; default runs/plan/report.json)",
    )
    p.add_argument(
        "--plot",
        nargs="?",
        const=_DEFAULT,
        help="save a PNG of memory and predicted time per rank (default runs/plan/plan.png)",
    )
    p.add_argument("--explain", action="append", default=[], metavar="TABLE", help="explain a table's placement")
    plan_scale.add_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """The flags' values, before any work (ConfigError naming the flag, the value and the fix); --out, --report
    and --plot given without a file name get their runs/plan/ file."""
    if args.world_size < 1:
        raise ConfigError(
            f"--world-size {args.world_size} is invalid: the number of ranks (GPUs) to plan for, >= 1, e.g. "
            "--world-size 8"
        )
    local, world = args.local_world_size, args.world_size
    if local is not None and (local < 1 or local > world or world % local):
        fit = max(d for d in range(1, min(world, 8) + 1) if world % d == 0)
        raise ConfigError(
            f"--local-world-size {local} is invalid with --world-size {world}: the ranks per host, >= 1 and dividing "
            f"the world size, e.g. --local-world-size {fit}; or leave it out (min(world size, 8))"
        )
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(
            f"--batch-size {args.batch_size} is invalid: the samples per rank per step, >= 1, or leave it out "
            "(the config's)"
        )
    for flag in ("hbm_gib", "ddr_gib"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} {value} is invalid: the memory per rank in GiB, > 0, or leave it out")
    if args.hbm_reserve_gib is not None and not args.hbm_reserve_gib >= 0:
        raise ConfigError(f"--hbm-reserve-gib {args.hbm_reserve_gib} is invalid: the GiB kept per rank, >= 0")
    for flag in ("out", "report", "plot"):
        kind = "torchrec" if flag == "out" and args.format == "torchrec" else flag
        value: Any = getattr(args, flag)
        if value == _DEFAULT:
            setattr(args, flag, str(OUT_DIR / DEFAULT_FILES[kind]))
        elif value is not None and Path(value).suffix.lower() not in _SUFFIXES[kind]:
            hint = (
                " (a key=value override after a flag without a file name is taken as the name)" if "=" in value else ""
            )
            raise ConfigError(
                f"--{flag} {value!r} is invalid: give a file ending in {' or '.join(_SUFFIXES[kind])}{hint}, or "
                f"--{flag} alone for {OUT_DIR / DEFAULT_FILES[kind]}"
            )


def _parent(path: str) -> str:
    """`path`, its folder made where missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return path


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


def load_input(args: argparse.Namespace) -> tuple[PlannerInput, Topology]:
    """The planner input and topology of a planner-input YAML or a training config, with the flags applied."""
    import yaml

    try:
        data = yaml.safe_load(Path(args.config).read_text())
    except OSError as e:
        raise ConfigError(f"{args.config}: cannot read the file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{args.config}: not valid YAML: {e}") from None
    if is_training_config(data):
        inp, train_cfg = training_planner_input_and_config(args.config, args.overrides)
        planner_cfg = train_cfg.planner
        args.train_config = train_cfg  # the dense model's size: plan_scale.dense_spec
        if args.topology or args.detect or args.device:
            topo = resolve_topology(args, None).with_sizes(hbm_gib=planner_cfg.hbm_gib, ddr_gib=planner_cfg.ddr_gib)
        else:  # what `embshard train` plans for: planner.topology_file, else this machine
            topo = topology_for(planner_cfg, args.world_size, args.local_world_size)
            if not planner_cfg.topology_file:
                print(
                    "note: planning for this machine's devices (as `embshard train` does); pass --device or "
                    "--topology to plan for others",
                    file=sys.stderr,
                )
        topo = topo.with_sizes(hbm_gib=args.hbm_gib, ddr_gib=args.ddr_gib)
    else:
        if args.overrides:
            raise ConfigError(
                f"{args.config} is a planner input: key=value overrides {args.overrides} apply to training configs"
            )
        inp = planner_input_from_dict(data, args.config)
        topo = resolve_topology(args, inp.device)
    if args.hbm_reserve_gib is not None:
        inp = replace(inp, settings=replace(inp.settings, hbm_reserve_gib=args.hbm_reserve_gib))
    if args.batch_size is not None:
        inp = replace(inp, batch_size=args.batch_size)
    return inp, topo


def torchrec_out(plan, args: argparse.Namespace, optimizer) -> None:
    """--format torchrec: print TorchRec's plan (JSON) or save it to --out; the notes go to stderr."""
    import json

    from embshard.interop.plan_out import plan_dict

    data = plan_dict(plan, args.torchrec_module_path, args.torchrec_device, optimizer)
    if args.out:
        Path(_parent(args.out)).write_text(json.dumps(data, indent=1) + "\n")
        print(f"TorchRec plan saved to {args.out} (embshard.interop.load_torchrec_plan reads it)", file=sys.stderr)
    else:
        print(json.dumps(data, indent=1))
    for note in data["notes"]:
        print(f"note: {note}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_intermixed_args(argv)
    try:
        check_args(args)
        plan_scale.check_args(args)
        inp, topo = load_input(args)
        train_cfg = getattr(args, "train_config", None)
        plan_scale.apply_config(args, train_cfg)  # a training config's sharding section, where no flag is given
        dense = plan_scale.dense_spec(train_cfg)
        scale = plan_at_scale(
            inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, inp.settings, dense,
            args.replica_sync, args.replica_sync_every, args.group_size, plan_scale.search_for(search_plan, inp, dense),
        )  # fmt: skip
        plan, report = scale.plan, scale.best.report
        if args.format == "table":
            print(report)
            print()
            print(scale.summary())
        elif args.format == "yaml":
            print(plan.to_yaml(), end="")
        elif args.format == "json":
            print(plan.to_json())
        else:
            torchrec_out(plan, args, inp.optimizer)
        for name in args.explain:
            print()
            print(explain(report, name))
        if args.out and args.format != "torchrec":
            plan.save(_parent(args.out))
            print(f"plan saved to {args.out}", file=sys.stderr)
        if args.report:
            report.save(_parent(args.report))
            print(f"report saved to {args.report}", file=sys.stderr)
        if args.plot:
            from embshard.tools.plan_plot import plot_report

            plot_report(report, _parent(args.plot))
            print(f"plot saved to {args.plot}", file=sys.stderr)
    except (ConfigError, KeyError) as e:
        print(f"embshard plan: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
