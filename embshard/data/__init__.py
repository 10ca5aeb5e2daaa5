"""Data loaders: each yields `Batch(dense [B, num_dense], sparse KeyedJaggedTensor, labels [B])` for one rank.

- criteo (data/criteo.py): Criteo click logs, tab-separated original or CSV with header.
- movielens (data/movielens.py): MovieLens ratings with user/movie attributes; genres is a jagged feature.
- synthetic (data/synthetic.py): Zipf-skewed ids and per-feature pooling factors at any scale.

Every source has `num_dense`, `steps_per_epoch` (None for the endless synthetic stream), `train_batches(start_step)`
and `eval_batches()`. File sources give every rank the same number of rows, so all ranks take the same number of
steps (the sharded embedding exchange needs every rank in every step).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard.config.data import DataConfig
from embshard.data.common import Batch, stable_hash
from embshard.tables import TableConfig

__all__ = ["Batch", "build_source", "stable_hash"]


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
    if cfg.source == "criteo":
        from embshard.data.criteo import criteo_source

        return criteo_source(cfg.criteo, tables, batch_size, cfg.shard, cfg.shuffle, seed, rank, world_size)
    if cfg.source == "movielens":
        from embshard.data.movielens import movielens_source

        return movielens_source(cfg.movielens, tables, batch_size, cfg.shard, cfg.shuffle, seed, rank, world_size)
    from embshard.data.synthetic import SyntheticSource

    workers = cfg.synthetic.workers if workers is None else workers
    return SyntheticSource(cfg.synthetic, tables, batch_size, seed, rank, workers=workers)
