"""What a reader reads and what it gives back: `ReadSpec` (the columns and rules of one split's files, with one
`FeatureSpec` per sparse feature) and `Chunk` (the decoded rows: labels, dense features, and per feature its bag
lengths, ids and per-id weights). Plain data: specs are sent to worker processes, chunks come back from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embshard.config.data import DenseColumnConfig


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature: its column, its table's rows, how multi-valued text is split, its weight column."""

    name: str
    column: str
    rows: int
    table: str
    separator: str | None = None
    weights: str | None = None


@dataclass(frozen=True)
class ReadSpec:
    """Everything a reader needs (plain data: it is sent to worker processes)."""

    where: str  # config key for messages, e.g. data.table
    fmt: str
    header: bool
    column_names: tuple[str, ...] | None
    delimiter: str
    label: str
    label_threshold: float | None
    dense: tuple[DenseColumnConfig, ...]
    features: tuple[FeatureSpec, ...]
    mapping: str
    weighted: bool
    on_bad_row: str
    chunk_rows: int = 65536

    def columns(self) -> list[str]:
        """The columns read, each once."""
        names = [self.label, *(d.column for d in self.dense)]
        for f in self.features:
            names += [f.column] + ([f.weights] if f.weights else [])
        return list(dict.fromkeys(names))


@dataclass
class Chunk:
    """Rows of one piece (or a window of pieces): labels [n], dense [n, D], and per feature lengths [n] int32,
    ids int64 and per-id weights float32 (None when no table is weighted)."""

    labels: np.ndarray
    dense: np.ndarray
    lengths: list[np.ndarray]
    values: list[np.ndarray]
    weights: list[np.ndarray] | None
    fixed: list[int | None] | None = None  # per feature: the size of every bag, when known to be one size

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(chunks: list[Chunk]) -> Chunk:
        if len(chunks) == 1:
            return chunks[0]
        nf = len(chunks[0].lengths)
        return Chunk(
            np.concatenate([c.labels for c in chunks]),
            np.concatenate([c.dense for c in chunks]),
            [np.concatenate([c.lengths[f] for c in chunks]) for f in range(nf)],
            [np.concatenate([c.values[f] for c in chunks]) for f in range(nf)],
            None if chunks[0].weights is None else [np.concatenate([c.weights[f] for c in chunks]) for f in range(nf)],
            [same_size([c.fixed[f] if c.fixed else None for c in chunks]) for f in range(nf)],
        )

    def keep(self, mask: np.ndarray) -> Chunk:
        """The rows where mask is true."""
        per_value = [np.repeat(mask, lens) for lens in self.lengths]
        return Chunk(
            self.labels[mask],
            self.dense[mask],
            [lens[mask] for lens in self.lengths],
            [v[m] for v, m in zip(self.values, per_value)],
            None if self.weights is None else [w[m] for w, m in zip(self.weights, per_value)],
            self.fixed,
        )


def same_size(sizes: list[int | None]) -> int | None:
    """The one size all of `sizes` share, else None (also when the first is unknown)."""
    return sizes[0] if sizes[0] is not None and all(k == sizes[0] for k in sizes) else None
