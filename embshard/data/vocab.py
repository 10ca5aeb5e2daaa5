"""Vocabularies: value counts of the training rows, vocabulary files, and the vectorized value -> row lookup.

    training pieces -> raw values per column -> counts (Arrow value_counts, merged with a group-by sum)
                    -> sorted by count (descending), then value -> vocabulary file <dir>/<column>.parquet
    vocabulary + table size + min_count -> lookup: row 2 + rank for the first (num_embeddings - 2) values seen at
                    least min_count times; row 1 = out of vocabulary; row 0 = missing (never in a vocabulary)

The lookup hashes values with embshard-hash-v1 (data/hashing.py) and binary-searches the sorted hashes of the
vocabulary, so no Python dict is built and mapping a batch is a few numpy passes. Two vocabulary values with one
64-bit hash are refused when the lookup is built; an out-of-vocabulary value whose hash equals a vocabulary
value's (odds about n / 2^64) would take that value's row.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embshard.data.hashing import hash_values
from embshard.spec.tables import ConfigError

OOV_ROW = 1
FIRST_VOCAB_ROW = 2


class Counter:
    """Running value counts of one column (values as text; merged every `merge_every` batches of values)."""

    def __init__(self, merge_every: int = 16) -> None:
        self.parts: list[pa.Table] = []
        self.merge_every = merge_every

    def add(self, values: pa.Array) -> None:
        if len(values) == 0:
            return
        vc = pc.value_counts(values)
        self.parts.append(pa.table({"value": vc.field("values"), "count": vc.field("counts").cast(pa.int64())}))
        if len(self.parts) >= self.merge_every:
            self.parts = [self.table()]

    def merge(self, other: Counter) -> None:
        self.parts.extend(other.parts)
        self.parts = [self.table()]

    def table(self) -> pa.Table:
        """value, count; unsorted."""
        if not self.parts:
            return pa.table({"value": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
        t = pa.concat_tables(self.parts, promote_options="permissive")
        return t.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])

    def sorted_table(self) -> pa.Table:
        """value, count: most frequent first, ties by value (the vocabulary order)."""
        t = self.table()
        return t.take(pc.sort_indices(t, sort_keys=[("count", "descending"), ("value", "ascending")]))


def vocab_path(folder: str, column: str) -> str:
    return os.path.join(folder, f"{column}.parquet")


def write_vocab(folder: str, column: str, counter: Counter) -> None:
    """Write one column's vocabulary file (atomically)."""
    os.makedirs(folder, exist_ok=True)
    path = vocab_path(folder, column)
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(counter.sorted_table(), tmp)
    os.replace(tmp, path)


def read_vocab(folder: str, column: str) -> pa.Table:
    path = vocab_path(folder, column)
    if not os.path.isfile(path):
        raise ConfigError(
            f"vocabulary file {path!r} does not exist: write it with `embshard preprocess CONFIG --vocab-only "
            f"--out DIR` (vocab_dir: DIR/vocab), or set vocab_dir: null to count the training rows at start-up"
        )
    return pq.read_table(path)


class VocabLookup:
    """Value -> table row for one feature: rows 2.. for the kept vocabulary values, 1 for the others."""

    def __init__(self, vocab: pa.Table, num_embeddings: int, min_count: int, name: str) -> None:
        if num_embeddings < 3:
            raise ConfigError(
                f"feature {name!r}: vocab mapping needs num_embeddings >= 3 (row 0 missing, row 1 out of "
                f"vocabulary), got {num_embeddings}"
            )
        counts = vocab.column("count").to_numpy()
        keep = int(min(num_embeddings - FIRST_VOCAB_ROW, int((counts >= min_count).sum())))
        values = vocab.column("value").slice(0, keep).combine_chunks()
        hashes = hash_values(values)
        order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[order]
        self.rows = (order + FIRST_VOCAB_ROW).astype(np.int64)
        self.size = keep
        if keep > 1 and (np.diff(self.hashes) == 0).any():
            i = int(np.flatnonzero(np.diff(self.hashes) == 0)[0])
            a, b = values[int(order[i])].as_py(), values[int(order[i + 1])].as_py()
            raise ConfigError(f"feature {name!r}: vocabulary values {a!r} and {b!r} have the same 64-bit hash")

    def __call__(self, hashes: np.ndarray) -> np.ndarray:
        """Rows (int64) of hashed values."""
        if self.size == 0:
            return np.full(len(hashes), OOV_ROW, dtype=np.int64)
        pos = np.searchsorted(self.hashes, hashes)
        pos = np.minimum(pos, self.size - 1)
        found = self.hashes[pos] == hashes
        return np.where(found, self.rows[pos], OOV_ROW)
