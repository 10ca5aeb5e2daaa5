"""The planner as training uses it: the topology a training config's `planner` section describes, and the
planner input of a training config (for `embshard plan configs/dlrm_criteo.yaml`).

The training config's per-table constraints and settings are the planner's own dataclasses
(ParameterConstraints, PlannerSettings), so nothing is converted here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embshard.planner.inputs import PlannerInput
from embshard.planner.topology import Topology
from embshard.tables import ConfigError

if TYPE_CHECKING:
    from embshard.config import PlannerConfig

# Top-level keys that only a training config (embshard.config.TrainConfig) has; planner inputs have 'tables'.
TRAINING_KEYS = ("model", "data", "schedule")


def is_training_config(data: Any) -> bool:
    """Whether parsed YAML is a training config rather than a planner input (by its top-level keys)."""
    return isinstance(data, Mapping) and "tables" not in data and any(k in data for k in TRAINING_KEYS)


def topology_for(
    cfg: PlannerConfig, world_size: int, local_world_size: int | None = None, device_type: str | None = None
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


def training_planner_input(path: str | Path, overrides: Sequence[str] = ()) -> tuple[PlannerInput, PlannerConfig]:
    """The planner input of a training config: the model's tables, schedule.batch_size (per rank), the sparse
    optimizer, planner.constraints and planner.settings; and the config's planner section."""
    from embshard.config import load_config

    cfg = load_config(path, overrides)
    p = cfg.planner
    inp = PlannerInput(
        tables=tuple(cfg.model.tables),
        batch_size=cfg.schedule.batch_size,
        optimizer=cfg.sparse_optimizer,
        constraints=dict(p.constraints or {}),
        settings=p.settings,
    )
    return inp, p
