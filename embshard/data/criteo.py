"""Criteo click logs (`label, I1..I13, C1..C26`) as a configuration of the table source (data/source.py).

Two layouts are read: the original release (tab-separated, no header: day_0 .. day_23 of the 1TB set, or the
Kaggle train.txt) and CSV with a header row naming the columns (as data/criteo_sample.txt); `format: auto` looks for
a tab in the first line. Values:
- label: 0 or 1.
- I1..I13 (integer counts, may be empty): missing -> 0; negatives raised to 0; then log(1 + x).
- C1..C26 (32-bit hex strings, may be empty): table rows by hash or vocab (row 0 is the missing value). Only the
  columns that the model's tables list are read.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.config.data import CategoricalColumnConfig, CriteoConfig, DenseColumnConfig, TableSourceConfig
from embshard.data.layout import resolve_files
from embshard.spec.tables import ConfigError, TableConfig

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
COLUMNS = ["label", *DENSE, *CATEGORICAL]


def _paths(p: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    return (p,) if isinstance(p, str) else p


def detect_format(path: str, fmt: str) -> str:
    """'tsv' or 'csv' ('auto': a tab in the first line means the original tab-separated release)."""
    if fmt != "auto":
        return fmt
    with open(path, "rb") as f:
        first = f.readline()
    return "tsv" if b"\t" in first else "csv"


def criteo_table(cfg: CriteoConfig, tables: Sequence[TableConfig]) -> TableSourceConfig:
    """The table-source configuration of the Criteo layout, for the features the tables list."""
    features = [f for t in tables for f in t.feature_names]
    unknown = [f for f in features if f not in CATEGORICAL]
    if unknown:
        raise ConfigError(f"features {unknown} are not Criteo columns; the tables' feature_names must be among C1..C26")
    for t in tables:
        if t.weighted:
            raise ConfigError(
                f"table {t.name!r} is weighted, but Criteo data has no per-id weights: set weighted: false"
            )
    files = resolve_files(_paths(cfg.path), "data.criteo")
    fmt = detect_format(files[0], cfg.format)
    return TableSourceConfig(
        files=_paths(cfg.path),
        label="label",
        categorical=tuple(CategoricalColumnConfig(c) for c in CATEGORICAL if c in features),
        dense=tuple(DenseColumnConfig(c, fill=0.0, min=0.0, transform="log1p") for c in DENSE),
        format=fmt,
        header=fmt == "csv",
        column_names=None if fmt == "csv" else tuple(COLUMNS),
        mapping=cfg.categorical,
        vocab_dir=cfg.vocab_dir,
        vocab_min_count=cfg.vocab_min_count,
        eval_files=_paths(cfg.eval_path),
        eval_fraction=None if cfg.eval_path is not None else cfg.eval_fraction,
    )
