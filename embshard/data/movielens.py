"""MovieLens ratings joined with user and movie attributes (CSV with a header), for the two-tower model, as a
configuration of the table source (data/source.py).

Columns: user_id, movie_id, rating, timestamp, title, genres, gender, age, occupation, zip. Every column but
rating and timestamp can be a sparse feature (a table's feature name is the column name); multi-valued columns
(`genres`: "Comedy|Drama") become jagged features with one id per value. The label is rating >= positive_rating.
There are no dense features.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.config.data import CategoricalColumnConfig, MovieLensConfig, TableSourceConfig
from embshard.spec.tables import ConfigError, TableConfig

NOT_FEATURES = ("rating", "timestamp")


def movielens_table(cfg: MovieLensConfig, tables: Sequence[TableConfig]) -> TableSourceConfig:
    """The table-source configuration of the MovieLens layout, for the features the tables list."""
    features = [f for t in tables for f in t.feature_names]
    bad = [f for f in features if f in NOT_FEATURES]
    if bad:
        raise ConfigError(f"features {bad} are not MovieLens feature columns: rating is the label, timestamp unused")
    for t in tables:
        if t.weighted:
            raise ConfigError(f"table {t.name!r} is weighted, but MovieLens has no per-id weights: set weighted: false")
    return TableSourceConfig(
        files=(cfg.path,),
        label="rating",
        label_threshold=float(cfg.positive_rating),
        categorical=tuple(
            CategoricalColumnConfig(f, separator=cfg.separator if f in cfg.multi_valued else None) for f in features
        ),
        format="csv",
        mapping=cfg.categorical,
        vocab_min_count=cfg.vocab_min_count,
        eval_fraction=cfg.eval_fraction,
    )
