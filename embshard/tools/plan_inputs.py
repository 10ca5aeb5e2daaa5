"""The planner's input read from a file: a planner-input YAML (tables, optimizer, batch size, per-table constraints
and planner settings, parsed strictly: an unknown key is an error naming the file and the key; examples in
configs/planner/*.yaml), or a training config (its tables, schedule.batch_size, sparse_optimizer and planner
section, for `embshard plan configs/dlrm_criteo.yaml`). A planner-input YAML:

    batch_size: 8192                      # samples per rank per step
    device: h200                          # GPU preset for dry runs (h100, h200, a100, cpu); optional
    optimizer: {kind: rowwise_adagrad, lr: 0.01}
    tables:
      - {name: big, count: 4, num_embeddings: 100000000, embedding_dim: 128, ids_per_bag: 1}
      - {name: user, num_embeddings: 1000000, embedding_dim: 64, feature_names: [user_id, friend_id]}
    constraints:                          # by table name or glob pattern
      "big_*": {sharding_types: [row_wise, table_wise], zipf_alpha: 1.0}
    settings: {hbm_reserve_fraction: 0.1}

`count: N` expands one entry into N tables NAME_0 .. NAME_{N-1}, each with its own feature (FEATURE_i). The
training config's per-table constraints and settings are the planner's own dataclasses (ParameterConstraints,
PlannerSettings), so nothing is converted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from embshard.config import PlannerConfig, load_config
from embshard.planner.constraints import ParameterConstraints
from embshard.planner.settings import PlannerSettings
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.tables import ConfigError, TableConfig, Tables, check_known_keys, validate_tables
from embshard.training.group_plan import job_settings

TOP_KEYS = ("batch_size", "device", "optimizer", "tables", "constraints", "settings")
TABLE_KEYS = {f.name for f in fields(TableConfig)} - {"extra", "init_std"} | {"count"}
TRAINING_KEYS = ("model", "data", "schedule")
"""Top-level keys that only a training config (embshard.config.TrainConfig) has; planner inputs have 'tables'."""


@dataclass(frozen=True)
class PlannerInput:
    """Everything the planner needs besides the topology."""

    tables: Tables
    """The embedding tables (checked: `validate_tables`)."""
    batch_size: int
    """Samples per rank per step."""
    optimizer: FusedOptimizerConfig = field(default_factory=FusedOptimizerConfig)
    """The fused sparse optimizer (its state counts in memory)."""
    constraints: dict[str, ParameterConstraints] = field(default_factory=dict)
    """Per-table constraints and hints, by table name or glob pattern."""
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    """Planner settings."""
    device: str | None = None
    """GPU preset the file was written for (h100, h200, a100, cpu), if any."""


def load_planner_input(path: str | Path) -> PlannerInput:
    """Read a planner-input YAML file (format in the module docstring)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return planner_input_from_dict(data, str(path))


def planner_input_from_dict(data: Any, where: str = "planner input") -> PlannerInput:
    """The same from parsed YAML; `where` (a file name) prefixes every error."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping with keys {list(TOP_KEYS)}")
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {list(TOP_KEYS)}")
    if "tables" not in data or "batch_size" not in data:
        raise ConfigError(f"{where}: 'tables' and 'batch_size' are required")
    batch = data["batch_size"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"{where}: batch_size={batch!r} is invalid: give samples per rank per step (>= 1)")
    tables = parse_tables(data["tables"], f"{where}: tables")
    opt = data.get("optimizer") or {}
    if not isinstance(opt, Mapping):
        raise ConfigError(f"{where}: optimizer must be a mapping, e.g. {{kind: rowwise_adagrad, lr: 0.01}}")
    check_known_keys(FusedOptimizerConfig, opt, f"{where}: optimizer")
    try:
        optimizer = FusedOptimizerConfig(**opt)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    raw_cons = data.get("constraints") or {}
    if not isinstance(raw_cons, Mapping):
        raise ConfigError(f"{where}: constraints must map table names (or patterns) to constraint mappings")
    cons = {
        str(k): ParameterConstraints.from_dict(v or {}, f"{where}: constraints[{k!r}]") for k, v in raw_cons.items()
    }
    settings = PlannerSettings.from_dict(data.get("settings") or {}, f"{where}: settings")
    device = data.get("device")
    if device is not None and not isinstance(device, str):
        raise ConfigError(f"{where}: device={device!r} must be a preset name such as h200")
    return PlannerInput(tables, batch, optimizer, cons, settings, device)


def parse_tables(entries: Any, where: str) -> Tables:
    """Table entries (list of mappings, `count` expands one entry into many) -> TableConfigs."""
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ConfigError(f"{where}: expected a non-empty list of table mappings")
    out: list[TableConfig] = []
    for k, entry in enumerate(entries):
        here = f"{where}[{k}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{here}: expected a mapping with keys such as name, num_embeddings, embedding_dim")
        for key in entry:
            if key not in TABLE_KEYS:
                raise ConfigError(f"{here}: unknown key {key!r}; known keys: {sorted(TABLE_KEYS)}")
        spec = dict(entry)
        count = spec.pop("count", None)
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{here}: 'name' (a non-empty string) is required")
        try:
            if count is None:
                spec.setdefault("feature_names", [name])
                out.append(TableConfig(**spec))
                continue
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"count={count!r} is invalid: it must be an integer >= 1")
            features = spec.pop("feature_names", [name])
            for i in range(count):
                out.append(
                    TableConfig(**{**spec, "name": f"{name}_{i}", "feature_names": [f"{f}_{i}" for f in features]})
                )
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{here}: {e}") from None
    try:
        return validate_tables(out)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def is_training_config(data: Any) -> bool:
    """Whether parsed YAML is a training config rather than a planner input (by its top-level keys)."""
    return isinstance(data, Mapping) and "tables" not in data and any(k in data for k in TRAINING_KEYS)


def training_planner_input(path: str | Path, overrides: Sequence[str] = ()) -> tuple[PlannerInput, PlannerConfig]:
    """The planner input of a training config: the model's tables, schedule.batch_size (per rank), the sparse
    optimizer, planner.constraints and planner.settings (pooled_bytes, batch_counts and whole_step_graph as the job
    runs, where unset); and the config's planner section."""
    inp, cfg = training_planner_input_and_config(path, overrides)
    return inp, cfg.planner


def training_planner_input_and_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[PlannerInput, Any]:
    """training_planner_input's planner input, and the whole TrainConfig (read and checked once)."""
    cfg = load_config(path, overrides)
    p = cfg.planner
    settings = job_settings(cfg)  # as the job runs
    inp = PlannerInput(
        tables=cfg.model.tables,
        batch_size=cfg.schedule.batch_size,
        optimizer=cfg.sparse_optimizer,
        constraints=dict(p.constraints or {}),
        settings=settings,
    )
    return inp, cfg
