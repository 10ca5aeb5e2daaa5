"""Shared pieces of the loaders: the batch type, stable categorical mapping, rank splits, in-memory batching.

Categorical values become table rows as follows (both modes reserve row 0 for a missing value):
- hash:  row = 1 + BLAKE2b-64(value) mod (num_embeddings - 1)   (stable across runs, machines and Python versions)
- vocab: row 1 = out of vocabulary; rows 2, 3, ... = the training rows' values seen at least `min_count` times,
  most frequent first (ties by value), as many as fit in the table.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embshard.tables import ConfigError, TableConfig

MISSING_ROW = 0
OOV_ROW = 1


@dataclass
class Batch:
    """One rank's batch: dense `[B, num_dense]` float32, sparse KeyedJaggedTensor (keys in table order, lengths
    `[F * B]` int32, ids int64), labels `[B]` float32, and `position` (the source position after this batch, a small
    dict for checkpoints; None for evaluation and synthetic batches)."""

    dense: torch.Tensor
    sparse: object  # torchrec KeyedJaggedTensor
    labels: torch.Tensor
    position: dict | None = None

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device` (non_blocking: asynchronous from pinned memory)."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position,
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory (needs CUDA; a copy)."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(), self.position)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the batch's device tensors as used on `stream` (when it was copied on another stream)."""
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)


def stable_hash(values: Sequence[str]) -> np.ndarray:
    """64-bit BLAKE2b of each string's UTF-8 bytes, as uint64 (never Python's salted hash())."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") for v in values),
        dtype=np.uint64,
        count=len(values),
    )


class CategoricalMapper:
    """Maps one feature's string values to rows of its table (see the module docstring)."""

    def __init__(
        self,
        table: TableConfig,
        feature: str,
        mode: str,
        train_values: Iterable[str] | None = None,
        min_count: int = 1,
    ) -> None:
        self.feature, self.mode, self.rows = feature, mode, table.num_embeddings
        need = 2 if mode == "hash" else 3
        if self.rows < need:
            raise ConfigError(
                f"table {table.name!r} (feature {feature!r}) has num_embeddings={self.rows}; {mode} mapping needs at "
                f"least {need} rows (row 0 is the missing value{', row 1 out-of-vocabulary' if need == 3 else ''})"
            )
        self.vocab: dict[str, int] = {}
        if mode == "vocab":
            counts = Counter(v for v in (train_values or ()) if v)
            ranked = sorted((v for v, c in counts.items() if c >= min_count), key=lambda v: (-counts[v], v))
            self.vocab = {v: 2 + i for i, v in enumerate(ranked[: self.rows - 2])}

    def __call__(self, values: Sequence[str]) -> np.ndarray:
        """Rows (int64) of the given values; '' is the missing value."""
        if self.mode == "hash":
            rows = (stable_hash(values) % np.uint64(self.rows - 1)).astype(np.int64) + 1
        else:
            rows = np.fromiter((self.vocab.get(v, OOV_ROW) for v in values), dtype=np.int64, count=len(values))
        missing = np.fromiter((not v for v in values), dtype=bool, count=len(values))
        rows[missing] = MISSING_ROW
        return rows


def rank_positions(num_rows: int, rank: int, world_size: int, mode: str) -> np.ndarray:
    """The positions (0-based, within a split of `num_rows` rows) that `rank` reads: floor(num_rows / world_size)
    of them, strided (rank, rank + W, ...) or contiguous (the rank-th of W equal blocks)."""
    n = num_rows // world_size
    if mode == "strided":
        return rank + world_size * np.arange(n, dtype=np.int64)
    return rank * n + np.arange(n, dtype=np.int64)


@dataclass
class Jagged:
    """One sparse feature over N rows: per-row lengths and the concatenated row ids."""

    lengths: np.ndarray  # [N] int64
    values: np.ndarray  # [sum(lengths)] int64

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)])


@dataclass
class Columns:
    """N parsed rows: labels, dense features and sparse features (in the model's feature order)."""

    labels: np.ndarray  # [N] float32
    dense: np.ndarray  # [N, num_dense] float32
    sparse: dict[str, Jagged]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, rows: np.ndarray) -> Batch:
        """The batch made of the given row indices."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        rows_t = torch.from_numpy(rows)
        lengths, values = [], []
        for col in self.sparse.values():
            lens = torch.from_numpy(col.lengths)[rows_t]
            starts = torch.from_numpy(col.offsets()[:-1])[rows_t]
            total = int(lens.sum())
            # position of each output id in col.values: its row's start plus its index within the row
            first = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens, output_size=total)
            values.append(torch.from_numpy(col.values)[first + torch.arange(total)])
            lengths.append(lens)
        kjt = KeyedJaggedTensor(
            keys=list(self.sparse),
            values=torch.cat(values),
            lengths=torch.cat(lengths).to(torch.int32),
        )
        return Batch(torch.from_numpy(self.dense[rows]), kjt, torch.from_numpy(self.labels[rows]))


class TabularSource:
    """Batches over one rank's parsed rows: training cycles epochs (reshuffled each epoch, last partial batch
    dropped so every rank takes the same number of steps); evaluation covers every held-out row once."""

    def __init__(
        self, train: Columns, held_out: Columns, batch_size: int, shuffle: bool, seed: int, rank: int, name: str
    ) -> None:
        self.train, self.held_out = train, held_out
        self.batch_size, self.shuffle, self.seed, self.rank = batch_size, shuffle, seed, rank
        self.num_dense = int(train.dense.shape[1])
        self.steps_per_epoch = len(train) // batch_size
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"{name}: each rank has {len(train)} training rows, fewer than schedule.batch_size={batch_size}: "
                "lower the batch size, use fewer ranks or more data"
            )
        if len(held_out) < 1:
            raise ConfigError(f"{name}: no held-out rows reach each rank: raise eval_fraction or use fewer ranks")

    def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Batches for steps start_step, start_step + 1, ... (endless; epoch = step // steps_per_epoch)."""
        step = start_step
        while True:
            epoch, within = divmod(step, self.steps_per_epoch)
            order = np.arange(len(self.train), dtype=np.int64)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, self.rank]).permutation(order)
            for i in range(within, self.steps_per_epoch):
                yield self.train.take(order[i * self.batch_size : (i + 1) * self.batch_size])
            step = (epoch + 1) * self.steps_per_epoch

    def eval_batches(self) -> Iterator[Batch]:
        """Every held-out row once, in order (the last batch may be smaller; every rank has the same count)."""
        n = len(self.held_out)
        for lo in range(0, n, self.batch_size):
            yield self.held_out.take(np.arange(lo, min(lo + self.batch_size, n), dtype=np.int64))


def check_unweighted(tables: Sequence[TableConfig], loader: str) -> None:
    """File loaders carry no per-id weights: refuse weighted tables."""
    for t in tables:
        if t.weighted:
            raise ConfigError(
                f"table {t.name!r} is weighted, but the {loader} data has no per-id weights: set weighted: false"
            )
