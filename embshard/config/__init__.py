"""YAML training configuration: parsed once into frozen dataclasses (TrainConfig), with command-line overrides.

    cfg = load_config("configs/dlrm_criteo.yaml", ["schedule.steps=100", "model.tables[0].embedding_dim=32"])

Each component receives only its own section: the model builder `cfg.model`, the data loader `cfg.data`, the
planner `cfg.planner`, and so on. docs/config.md is generated from the field docstrings here
(`python -m embshard.config.doc`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from embshard.config.data import (
    CategoricalColumnConfig,
    CriteoConfig,
    DataConfig,
    DenseColumnConfig,
    MovieLensConfig,
    SyntheticConfig,
    TableSourceConfig,
)
from embshard.config.model import DCNConfig, DLRMConfig, ModelConfig, TwoTowerConfig
from embshard.config.run import (
    CheckpointConfig,
    DenseOptimizerConfig,
    LoggingConfig,
    ScheduleConfig,
    TableConstraint,
    TrainingConfig,
)
from embshard.config.runtime import RuntimeConfig
from embshard.config.schema import Source, build
from embshard.config.sharding import ShardingConfig
from embshard.planner.policy import PlannerConfig
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions, counts_on_host
from embshard.spec.tables import ConfigError, FieldError

__all__ = [
    "CategoricalColumnConfig",
    "CheckpointConfig",
    "CriteoConfig",
    "DCNConfig",
    "DLRMConfig",
    "DataConfig",
    "DenseColumnConfig",
    "DenseOptimizerConfig",
    "LoggingConfig",
    "LookupOptions",
    "ModelConfig",
    "MovieLensConfig",
    "PlannerConfig",
    "RuntimeConfig",
    "ShardingConfig",
    "ScheduleConfig",
    "SyntheticConfig",
    "TableConstraint",
    "TableSourceConfig",
    "TrainConfig",
    "TrainingConfig",
    "TwoTowerConfig",
    "apply_overrides",
    "load_config",
]


@dataclass(frozen=True)
class TrainConfig:
    """A training run: `embshard train CONFIG`."""

    model: ModelConfig
    """Embedding tables and dense architecture."""
    data: DataConfig
    """Data source and its split over ranks."""
    schedule: ScheduleConfig
    """Batch size, length of training, evaluation interval."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Training pipeline (overlap of consecutive batches) and dense precision."""
    sparse_optimizer: FusedOptimizerConfig = field(default_factory=FusedOptimizerConfig)
    """The optimizer fused into the embedding backward (embshard.spec.optim.FusedOptimizerConfig)."""
    lookup: LookupOptions = field(default_factory=LookupOptions)
    """Embedding lookup options (embshard.spec.options.LookupOptions): pooled output dtype, fp16 rounding, out-of-range
    ids, UVM-cache prefetch and statistics, regroup kernel, column-wise Adagrad state."""
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    """The optimizer of the dense (data-parallel) parameters."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Sharding plan: a saved plan file, or planning settings and per-table constraints."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint folder, interval and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, progress bar, TensorBoard and metrics file."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Collective timeout (watchdog) and numeric guard."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """2D sharding: sharding groups that are data-parallel replicas (group size, exact or periodic sync)."""
    seed: int = 0
    """Seed of the initial weights, the data shuffles and the synthetic data."""

    def __post_init__(self) -> None:
        tables = {t.name for t in self.model.tables}
        for name in self.planner.constraints or {}:
            if any(ch in name for ch in "*?["):
                if not fnmatch.filter(tables, name):
                    raise FieldError(
                        f"planner.constraints.{name}", name, f"the pattern matches no table: {sorted(tables)}"
                    )
            elif name not in tables:
                raise FieldError(f"planner.constraints.{name}", name, f"no such table; tables: {sorted(tables)}")
        weighted = {f for t in self.model.tables if t.weighted for f in t.feature_names}
        try:
            self.data.check_features(self.model.features, weighted)
        except FieldError as e:
            raise FieldError(f"data.{e.key}", e.value, e.rule) from None
        if self.data.source == "sequences":
            check_sequences(self)
        elif self.model.sequential is not None and self.model.sequential.time_bias:
            raise FieldError(
                "model.sequential.time_bias",
                True,
                f"data.source {self.data.source!r} has no timestamps: use data.source sequences or set it to false",
            )
        if self.data.source == "synthetic":
            if self.schedule.epochs is not None:
                raise FieldError("schedule.epochs", self.schedule.epochs, "synthetic data has no epochs: set steps")
            features = set(self.model.features)
            for f in (self.data.synthetic.pooling or {}) if self.data.synthetic else {}:
                if f not in features:
                    raise FieldError(
                        f"data.synthetic.pooling.{f}", f, f"no table lists this feature: {sorted(features)}"
                    )
            affinity = self.data.synthetic.affinity if self.data.synthetic else None
            for key in ("user_feature", "item_feature") if affinity else ():
                if getattr(affinity, key) not in features:
                    raise FieldError(
                        f"data.synthetic.affinity.{key}",
                        getattr(affinity, key),
                        f"no table lists this feature: {sorted(features)}",
                    )

    @property
    def batch_counts(self) -> str:
        """Where this job's training steps take their batch counts from: 'host' (the training pipeline counts each
        batch on the CPU: no device sync) or 'device' (the forward gathers them on the GPUs and syncs once a step):
        `embshard.spec.options.counts_on_host` of training.pipeline, lookup.bounds_check and the retrieval catalog
        (two_tower with item_mlp: []) or sequence tables. The planner prices the step so unless planner.settings.batch_counts is set."""
        tt = self.model.two_tower
        catalog = (self.model.kind == "two_tower" and tt is not None and tt.catalog_mode) or self.model.kind == "hstu"
        catalog = catalog or any(t.sequence for t in self.model.tables)  # sequence tables: looked up in the forward
        return "host" if counts_on_host(self.training.pipeline, self.lookup.bounds_check, catalog) else "device"

    @property
    def whole_step_graph(self) -> bool:
        """Whether this job asks for its whole training step as one CUDA graph on CUDA GPUs (training.cuda_graph true,
        or auto with training.precision bf16, with graph_scope step, the batch counts on the host, no raw-id tables):
        the planner then looks first for a plan the graph can hold, unless planner.settings.whole_step_graph is set.
        The step mode of the job (embshard/training/mode.py) decides the rest."""
        t = self.training
        raw = any(tb.raw_ids for tb in self.model.tables)
        wanted = t.cuda_graph is True or (t.cuda_graph == "auto" and t.precision == "bf16")
        return wanted and t.graph_scope == "step" and self.batch_counts == "host" and not raw


_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def _split_key(key: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in key.split("."):
        m = _KEY.fullmatch(piece)
        if not m:
            raise ConfigError(
                f"override key {key!r} is malformed at {piece!r}: write e.g. model.tables[0].embedding_dim"
            )
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, str]:
    """Apply `key.sub[i]=value` overrides (value typed as a YAML scalar or flow list) to the raw mapping in place.
    Returns {key path: override text} so errors can name the override."""
    applied: dict[str, str] = {}
    for text in overrides:
        key, eq, raw = text.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {text!r} is not key=value: write e.g. schedule.steps=100")
        value = yaml.safe_load(raw) if raw.strip() else None
        parts = _split_key(key.strip())
        node: Any = data
        walked = ""
        for part, nxt in zip(parts[:-1], parts[1:]):
            walked = f"{walked}[{part}]" if isinstance(part, int) else (f"{walked}.{part}" if walked else part)
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    raise ConfigError(f"override {text!r}: {walked} does not exist (the list is shorter)")
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise ConfigError(f"override {text!r}: {walked} is not inside a mapping")
                if node.get(part) is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        last = parts[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last >= len(node):
                raise ConfigError(f"override {text!r}: index {last} does not exist (the list is shorter)")
            node[last] = value
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: the parent of {last!r} is not a mapping")
            node[last] = value
        applied[key.strip()] = text
    return applied


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config, apply overrides, and build the frozen TrainConfig (ConfigError on any problem)."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    applied = apply_overrides(data, overrides)
    return build(TrainConfig, data, "", Source(path, applied))


def check_sequences(cfg: TrainConfig) -> None:
    """data.source sequences feeds model kind hstu: the same item feature, histories the model can read, and no
    epochs for the endless synthetic stream."""
    sq, model = cfg.data.sequences, cfg.model.sequential
    if model is None:
        raise FieldError("data.source", "sequences", f"per-user sequences feed model kind hstu, not {cfg.model.kind}")
    if sq.item_feature != model.item_feature:
        raise FieldError(
            "data.sequences.item_feature",
            sq.item_feature,
            f"it must be model.sequential.item_feature ({model.item_feature!r})",
        )
    if sq.max_length > model.max_length:
        raise FieldError(
            "data.sequences.max_length",
            sq.max_length,
            f"the model reads at most model.sequential.max_length={model.max_length} items: lower it or raise that",
        )
    if sq.path is None and cfg.schedule.epochs is not None:
        raise FieldError("schedule.epochs", cfg.schedule.epochs, "synthetic sequences have no epochs: set steps")
