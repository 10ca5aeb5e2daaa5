"""MovieLens ratings joined with user and movie attributes (CSV with a header), for the two-tower model.

Columns: user_id, movie_id, rating, timestamp, title, genres, gender, age, occupation, zip. Every column but
rating and timestamp can be a sparse feature (a table's feature name is the column name); multi-valued columns
(`genres`: "Comedy|Drama") become jagged features with one id per value. Values map to table rows by hash or
vocabulary (data/common.py; row 0 is the missing value, used for an empty field). The label is
rating >= positive_rating. There are no dense features. The last eval_fraction of rows are held out; each rank
keeps its part of each split (data.shard).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from embshard.config.data import MovieLensConfig
from embshard.data.common import CategoricalMapper, Columns, Jagged, TabularSource, check_unweighted, rank_positions
from embshard.tables import ConfigError, TableConfig

NOT_FEATURES = ("rating", "timestamp")


def read_csv(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a CSV file (quoted fields such as titles with commas are handled)."""
    if not Path(path).is_file():
        raise ConfigError(f"data.movielens: file {path!r} does not exist (paths are relative to {Path.cwd()})")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ConfigError(f"{path}: the file is empty; expected a CSV header and rows")
        rows = list(reader)
    for i, r in enumerate(rows):
        if len(r) != len(header):
            raise ConfigError(f"{path}:{i + 2}: {len(r)} fields, but the header has {len(header)}")
    return header, rows


def split_values(text: str, separator: str) -> list[str]:
    """The values of a multi-valued field; an empty field is one missing value ('')."""
    values = [v for v in text.split(separator) if v]
    return values or [""]


def movielens_source(
    cfg: MovieLensConfig,
    tables: Sequence[TableConfig],
    batch_size: int,
    shard: str,
    shuffle: bool,
    seed: int,
    rank: int,
    world_size: int,
) -> TabularSource:
    """This rank's part of the MovieLens training and held-out rows."""
    check_unweighted(tables, "movielens")
    header, rows = read_csv(cfg.path)
    if "rating" not in header:
        raise ConfigError(f"{cfg.path}: no 'rating' column (header: {header}); the label is rating >= positive_rating")
    table_of = {f: t for t in tables for f in t.feature_names}
    usable = [c for c in header if c not in NOT_FEATURES]
    unknown = [f for f in table_of if f not in usable]
    if unknown:
        raise ConfigError(
            f"features {unknown} are not columns of {cfg.path}; the tables' feature_names must be among {usable}"
        )
    n_eval = max(1, round(len(rows) * cfg.eval_fraction))
    n_train = len(rows) - n_eval
    train_rows, eval_rows = rows[:n_train], rows[n_train:]
    features = list(table_of)
    col = {f: header.index(f) for f in features}

    def values_of(part: list[list[str]], f: str) -> tuple[np.ndarray, list[str]]:
        if f in cfg.multi_valued:
            lists = [split_values(r[col[f]], cfg.separator) for r in part]
            return np.array([len(v) for v in lists], dtype=np.int64), [v for vs in lists for v in vs]
        return np.ones(len(part), dtype=np.int64), [r[col[f]].strip() for r in part]

    mappers = {
        f: CategoricalMapper(table_of[f], f, cfg.categorical, values_of(train_rows, f)[1], cfg.vocab_min_count)
        for f in features
    }

    def parse(part: list[list[str]], positions: np.ndarray, first_line: int) -> Columns:
        part = [part[i] for i in positions]
        try:
            ratings = np.array([float(r[header.index("rating")]) for r in part], dtype=np.float32)
        except ValueError as e:
            raise ConfigError(f"{cfg.path} (rows from line {first_line}): a rating is not a number ({e})") from None
        sparse = {}
        for f in features:
            lengths, values = values_of(part, f)
            sparse[f] = Jagged(lengths, mappers[f](values))
        labels = (ratings >= cfg.positive_rating).astype(np.float32)
        return Columns(labels, np.zeros((len(part), 0), dtype=np.float32), sparse)

    train = parse(train_rows, rank_positions(n_train, rank, world_size, shard), 2)
    held_out = parse(eval_rows, rank_positions(n_eval, rank, world_size, shard), 2 + n_train)
    return TabularSource(train, held_out, batch_size, shuffle, seed, rank, f"data.movielens ({cfg.path})")
