"""Data loaders: each yields `Batch(dense [B, num_dense], sparse KeyedJaggedTensor, labels [B], position)` for one
rank (docs/data.md).

- table (data/source.py): any Parquet, CSV or TSV files, columns mapped to features in YAML; streamed in row
  groups by worker processes with a seeded shuffle window, an exact resume position, pinned memory.
- criteo (data/criteo.py), movielens (data/movielens.py): configurations of the table source.
- synthetic (data/synthetic.py): Zipf-skewed ids and per-feature pooling factors at any scale.
- sequences (data/sequences.py): per-user item sequences (a synthetic Markov chain, or a CSV file grouped by user
  and ordered by time) for sequential recommenders.

Every source has `num_dense`, `steps_per_epoch` (None for the endless synthetic stream), `train_batches(position)`
(position: None, a step count, or a training batch's `position`) and `eval_batches()`. File sources give every
rank the same number of rows, so all ranks take the same number of steps (the sharded embedding exchange needs
every rank in every step).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.config.data import DataConfig
from embshard.data.common import Batch
from embshard.data.hashing import hash_strings
from embshard.spec.tables import TableConfig

__all__ = ["Batch", "build_source", "check_source", "hash_strings"]


def build_source(
    cfg: DataConfig,
    tables: Sequence[TableConfig],
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    workers: int | None = None,
):
    """The configured source, reading this rank's part of the data. `workers`: synthetic batches drawn by this
    many worker processes (default: data.synthetic.workers)."""
    if cfg.source == "sequences":
        from embshard.data.sequences import SequenceSource

        return SequenceSource(cfg.sequences, tables, batch_size, seed, rank, world_size)
    if cfg.source == "synthetic":
        from embshard.data.synthetic import SyntheticSource

        workers = cfg.synthetic.workers if workers is None else workers
        return SyntheticSource(cfg.synthetic, tables, batch_size, seed, rank, workers=workers)
    from embshard.data.source import TableSource

    return TableSource(table_config(cfg, tables), cfg, tables, batch_size, seed, rank, world_size, f"data.{cfg.source}")


def check_source(cfg: DataConfig, tables: Sequence[TableConfig], batch_size: int, seed: int) -> None:
    """Open and check the configured source as its ranks will, without reading rows (before the ranks start):
    a file source's files exist and have the columns the tables and the config name; a synthetic source's
    settings fit the tables. Raises ConfigError naming the key, the file and the fix."""
    if cfg.source == "sequences":
        from embshard.data.sequences import SequenceSource

        SequenceSource(cfg.sequences, tables, batch_size, seed, 0, 1)
        return
    if cfg.source == "synthetic":
        from embshard.data.synthetic import SyntheticSource

        SyntheticSource(cfg.synthetic, tables, batch_size, seed, 0, workers=0)
        return
    from embshard.data.source import check_files

    check_files(table_config(cfg, tables), cfg, tables, f"data.{cfg.source}")


def table_config(cfg: DataConfig, tables: Sequence[TableConfig]):
    """The TableSourceConfig of a file source (criteo and movielens are configurations of it)."""
    if cfg.source == "criteo":
        from embshard.data.criteo import criteo_table

        return criteo_table(cfg.criteo, tables)
    if cfg.source == "movielens":
        from embshard.data.movielens import movielens_table

        return movielens_table(cfg.movielens, tables)
    if cfg.source == "table":
        return cfg.table
    raise ValueError(f"data.source {cfg.source!r} reads no files")
