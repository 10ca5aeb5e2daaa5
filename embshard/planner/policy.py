"""The plan of a training job: its config's `planner:` section says where the plan comes from, a saved file
(plan_file), the search (strategy auto: search.py on the topology of topology_file or of this machine) or the simple
placement (strategy simple: simple.py), and this module makes it, checked against the tables.

The section is read through `JobPlanning`, the fields planning uses (embshard.config.PlannerConfig has them), so the
planner does not import the config package, which sits above it (config -> planner -> plan).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from embshard.optim import FusedOptimizerConfig
from embshard.plan import MemoryTier, ShardingPlan
from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.errors import PlanningError
from embshard.planner.search import plan_with_report
from embshard.planner.settings import PlannerSettings
from embshard.planner.simple import simple_plan
from embshard.planner.topology import Topology
from embshard.tables import ConfigError, TableConfig


class JobPlanning(Protocol):
    """The fields of a training config's planner section that planning reads (embshard.config.PlannerConfig)."""

    @property
    def strategy(self) -> str: ...
    @property
    def plan_file(self) -> str | None: ...
    @property
    def topology_file(self) -> str | None: ...
    @property
    def hbm_gib(self) -> float | None: ...
    @property
    def ddr_gib(self) -> float | None: ...
    @property
    def settings(self) -> PlannerSettings: ...
    @property
    def tier(self) -> MemoryTier | None: ...
    @property
    def column_shards(self) -> int | None: ...
    @property
    def constraints(self) -> Mapping[str, ParameterConstraints] | None: ...


def plan_for_job(
    tables: Sequence[TableConfig],
    planner_cfg: JobPlanning,
    world_size: int,
    local_world_size: int,
    device_type: str,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    log: Callable[[str], None] | None = None,
) -> ShardingPlan:
    """The sharding plan (checked against `tables`): loaded from planner.plan_file, else made by the planner
    (strategy auto: the search on the topology of planner.topology_file or of this machine, for `batch_size`
    samples per rank and the sparse `optimizer`), else by the simple placement (strategy simple: each table's first
    allowed sharding type, tier and rank, planner.tier and planner.column_shards for the rest). `log` gets the
    plan and, for auto, the predicted memory and time per rank and the predicted step time. Deterministic; a
    training job still makes it on rank 0 only and broadcasts it (train.plan_on_rank0)."""
    say = log or (lambda _text: None)
    if planner_cfg.plan_file:
        plan = ShardingPlan.load(planner_cfg.plan_file)
        if (plan.world_size, plan.local_world_size) != (world_size, local_world_size):
            raise ConfigError(
                f"planner.plan_file={planner_cfg.plan_file!r} is a plan for world_size={plan.world_size}, "
                f"local_world_size={plan.local_world_size}, but this job has {world_size} and {local_world_size}: "
                "re-plan for this job (`embshard plan CONFIG --world-size N --out FILE`), or leave plan_file unset"
            )
        plan.check(tables)
        say(f"plan loaded from {planner_cfg.plan_file}")
        say(str(plan))
        return plan
    if planner_cfg.strategy == "simple":
        try:
            constraints = resolve_constraints(tables, planner_cfg.constraints, world_size)
        except ConfigError as e:
            raise ConfigError(f"planner.{e}") from None
        tier = planner_cfg.tier or (MemoryTier.HOST if device_type == "cpu" else MemoryTier.HBM)
        columns = planner_cfg.column_shards or 2
        plan = simple_plan(tables, world_size, local_world_size, None, tier, columns, constraints)
        say(str(plan))
        return plan
    topo = topology_for(planner_cfg, world_size, local_world_size, device_type)
    try:
        plan, report = plan_with_report(
            tables, topo, batch_size, optimizer, planner_cfg.constraints, planner_cfg.settings
        )
    except PlanningError as e:
        raise PlanningError(
            f"planner: no sharding plan fits {topo.describe()}:\n{e}\n(in a training config: planner.hbm_gib and "
            "planner.ddr_gib set the memory per rank, planner.settings.hbm_reserve_gib the dense model's reserve, "
            "--nproc / torchrun the number of ranks, planner.constraints.<table> the allowed options)",
            e.details,
        ) from None
    except ConfigError as e:
        raise ConfigError(f"planner: {e}") from None
    plan.check(tables)
    say(str(plan))
    say(report.format_ranks())
    say(report.summary())
    return plan


def topology_for(
    cfg: JobPlanning, world_size: int, local_world_size: int | None = None, device_type: str | None = None
) -> Topology:
    """The topology to plan for: planner.topology_file, else this machine (Topology.detect), with the job's rank
    counts and planner.hbm_gib / planner.ddr_gib applied. With `device_type` ('cuda' or 'cpu': where training
    computes) a topology of the other kind is an error."""
    if cfg.topology_file:
        if not Path(cfg.topology_file).is_file():
            raise ConfigError(
                f"planner.topology_file={cfg.topology_file!r} does not exist: write one with `embshard calibrate "
                "--out FILE`, or leave topology_file unset to read this machine"
            )
        topo = Topology.load(cfg.topology_file).with_sizes(world_size, local_world_size)
    else:
        topo = Topology.detect(world_size, local_world_size)
    topo = topo.with_sizes(hbm_gib=cfg.hbm_gib, ddr_gib=cfg.ddr_gib)
    if device_type is not None and topo.compute_device != device_type:
        where = f"planner.topology_file={cfg.topology_file!r}" if cfg.topology_file else "this machine"
        raise ConfigError(
            f"{where} describes {topo.compute_device} ranks, but this job computes on {device_type}: use a "
            f"topology file measured on {device_type} ranks (`embshard calibrate`), or leave topology_file unset"
        )
    return topo
