"""Criteo click logs: `label, I1..I13, C1..C26`.

Two layouts are read: the original release (tab-separated, no header) and CSV with a header row naming the
columns (as in data/criteo_sample.txt). Values:
- label: 0 or 1.
- I1..I13 (integer counts, may be empty): missing -> 0; negatives clamped to 0; then log(1 + x).
- C1..C26 (32-bit hex strings, may be empty): mapped to table rows (data/common.py: hash or vocab; row 0 is the
  missing value). Only the features that the model's tables list are read.
The last `eval_fraction` of the file's rows (or a separate eval_path file) are held out. Each rank keeps its part
of each split (data.shard: strided or contiguous, floor(rows / world_size) rows each).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from embshard.config.data import CriteoConfig
from embshard.data.common import CategoricalMapper, Columns, Jagged, TabularSource, check_unweighted, rank_positions
from embshard.tables import ConfigError, TableConfig

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
COLUMNS = ["label", *DENSE, *CATEGORICAL]


def detect_format(path: str, fmt: str) -> str:
    """'tsv' or 'csv' ('auto': a tab in the first line means the original tab-separated release)."""
    if fmt != "auto":
        return fmt
    with open(path) as f:
        first = f.readline()
    return "tsv" if "\t" in first else "csv"


def read_rows(path: str, fmt: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, the 40 fields in COLUMNS order) for every data row of the file."""
    fmt = detect_format(path, fmt)
    sep = "\t" if fmt == "tsv" else ","
    with open(path) as f:
        order = list(range(len(COLUMNS)))
        width = len(COLUMNS)
        first_data_line = 1
        if fmt == "csv":
            header = f.readline().rstrip("\r\n").split(",")
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise ConfigError(
                    f"{path}: the CSV header lacks columns {missing}; a Criteo CSV names label, I1..I13, C1..C26 "
                    "(for the headerless tab-separated release set data.criteo.format: tsv)"
                )
            order = [header.index(c) for c in COLUMNS]
            width = len(header)
            first_data_line = 2
        for lineno, line in enumerate(f, start=first_data_line):
            fields = line.rstrip("\r\n").split(sep)
            if len(fields) != width:
                raise ConfigError(
                    f"{path}:{lineno}: {len(fields)} {fmt} fields, expected {width} (label, 13 integer, 26 "
                    "categorical); check data.criteo.format"
                )
            yield lineno, [fields[i] for i in order]


def count_rows(path: str, fmt: str) -> int:
    """Data rows in the file (lines, less the header for CSV)."""
    n = 0
    last = b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    if last and last != b"\n":
        n += 1  # a last line without a newline
    return n - (1 if detect_format(path, fmt) == "csv" else 0)


def dense_value(text: str) -> float:
    """Missing -> 0; negatives clamped to 0; log(1 + x)."""
    return math.log1p(max(float(text), 0.0)) if text else 0.0


def _parse(rows: list[list[str]], path: str, features: Sequence[str], mappers: dict[str, CategoricalMapper]) -> Columns:
    try:
        labels = np.array([float(r[0]) for r in rows], dtype=np.float32)
        dense = np.array([[dense_value(x) for x in r[1:14]] for r in rows], dtype=np.float32).reshape(len(rows), 13)
    except ValueError as e:
        raise ConfigError(f"{path}: a label or integer feature is not a number ({e})") from None
    sparse = {}
    for f in features:
        col = COLUMNS.index(f)
        sparse[f] = Jagged(np.ones(len(rows), dtype=np.int64), mappers[f]([r[col] for r in rows]))
    return Columns(labels, dense, sparse)


def criteo_source(
    cfg: CriteoConfig,
    tables: Sequence[TableConfig],
    batch_size: int,
    shard: str,
    shuffle: bool,
    seed: int,
    rank: int,
    world_size: int,
) -> TabularSource:
    """This rank's part of the Criteo training and held-out rows."""
    check_unweighted(tables, "criteo")
    table_of = {f: t for t in tables for f in t.feature_names}
    unknown = [f for f in table_of if f not in CATEGORICAL]
    if unknown:
        raise ConfigError(f"features {unknown} are not Criteo columns; the tables' feature_names must be among C1..C26")
    features = list(table_of)
    for p in (cfg.path, cfg.eval_path):
        if p is not None and not Path(p).is_file():
            raise ConfigError(f"data.criteo: file {p!r} does not exist (paths are relative to {Path.cwd()})")
    n_rows = count_rows(cfg.path, cfg.format)
    if cfg.eval_path is None:
        n_eval = max(1, round(n_rows * cfg.eval_fraction))
        n_train = n_rows - n_eval
    else:
        n_train, n_eval = n_rows, count_rows(cfg.eval_path, cfg.format)
    train_pos = set(rank_positions(n_train, rank, world_size, shard).tolist())
    eval_pos = set(rank_positions(n_eval, rank, world_size, shard).tolist())
    train_rows, eval_rows = [], []
    vocab_values: dict[str, list[str]] = {f: [] for f in features}
    for i, (_, fields) in enumerate(read_rows(cfg.path, cfg.format)):
        if i < n_train:
            if i in train_pos:
                train_rows.append(fields)
            if cfg.categorical == "vocab":
                for f in features:
                    vocab_values[f].append(fields[COLUMNS.index(f)])
        elif cfg.eval_path is None and i - n_train in eval_pos:
            eval_rows.append(fields)
    if cfg.eval_path is not None:
        eval_rows = [r for i, (_, r) in enumerate(read_rows(cfg.eval_path, cfg.format)) if i in eval_pos]
    mappers = {
        f: CategoricalMapper(table_of[f], f, cfg.categorical, vocab_values[f], cfg.vocab_min_count) for f in features
    }
    train = _parse(train_rows, cfg.path, features, mappers)
    held_out = _parse(eval_rows, cfg.eval_path or cfg.path, features, mappers)
    return TabularSource(train, held_out, batch_size, shuffle, seed, rank, f"data.criteo ({cfg.path})")
