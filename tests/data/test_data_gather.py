"""The batch gathers (stream.assemble: stacked small bags, one-id runs copied in one go, 2-D gathers of larger fixed
bags, jagged bags, carried rows) give exactly the batches of a plain reference gather (every bag through its
offsets, one row at a time), on random parts of every kind; and from a Parquet file with one-hot, packed multi-hot,
list and weighted columns, worker processes (batches lent from reused shared-memory slots) give the batches of the
training process, each row's values those of the file's row."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard.config.data import CategoricalColumnConfig, DataConfig, DenseColumnConfig, TableSourceConfig
from embshard.data.decode import Chunk
from embshard.data.source import TableSource, _Train
from embshard.data.stream import Part, assemble
from embshard.spec.tables import TableConfig


def random_chunk(rng: np.random.Generator, n: int, sizes: list[int | None], weighted: bool, nd: int = 3) -> Chunk:
    """n rows; per feature a fixed bag size (ids int32 or int64 at random) or None (jagged, 0 to 5 ids a row)."""
    lengths, values = [], []
    for k in sizes:
        lens = np.full(n, k, np.int32) if k is not None else rng.integers(0, 6, n).astype(np.int32)
        lengths.append(lens)
        values.append(rng.integers(0, 1 << 30, int(lens.sum())).astype(rng.choice([np.int32, np.int64])))
    weights = [rng.random(len(v)).astype(np.float32) for v in values] if weighted else None
    labels = rng.integers(0, 2, n).astype(np.float32)
    dense = rng.standard_normal((n, nd)).astype(np.float32)
    return Chunk(labels, dense, lengths, values, weights, list(sizes) if rng.random() < 0.5 else None)


def reference(parts: list[tuple[Chunk, np.ndarray]], nf: int, weighted: bool) -> dict:
    """The batch written out row by row from the chunks' bags (feature-major, as a KeyedJaggedTensor)."""
    lengths, values, weights = [], [], []
    for f in range(nf):
        for c, idx in parts:
            off = np.concatenate([[0], np.cumsum(c.lengths[f])])
            for i in idx:
                lengths.append(int(c.lengths[f][i]))
                values += c.values[f][off[i] : off[i + 1]].tolist()
                if weighted:
                    weights += c.weights[f][off[i] : off[i + 1]].tolist()
    return {
        "labels": np.concatenate([c.labels[idx] for c, idx in parts]),
        "dense": np.concatenate([c.dense[idx] for c, idx in parts]),
        "lengths": np.array(lengths, np.int32),
        "values": np.array(values, np.int64),
        "weights": np.array(weights, np.float32) if weighted else None,
    }


def copy(c: Chunk) -> Chunk:
    """A deep copy (Part moves stacked ids out of its chunk)."""
    return Chunk(
        c.labels.copy(),
        c.dense.copy(),
        [x.copy() for x in c.lengths],
        [x.copy() for x in c.values],
        None if c.weights is None else [x.copy() for x in c.weights],
        None if c.fixed is None else list(c.fixed),
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_assemble_equals_the_row_by_row_gather(weighted):
    rng = np.random.default_rng(11)
    one_hot_run = [1, 1, 1, 1]  # stacked side by side: one transposing copy
    layouts = [
        one_hot_run + [2, 3, 7, None, 1, 12, None, 1],  # stacked small bags, larger fixed bags, jagged
        [1] * 6,  # all one-id features (the one-hot layout)
        [None, 5, 1, None],
    ]
    for sizes in layouts:
        for trial in range(3):
            chunks = [
                random_chunk(rng, int(rng.integers(1, 60)), sizes, weighted) for _ in range(int(rng.integers(1, 4)))
            ]
            if trial == 2:  # a feature fixed in one part and jagged in another (as after a carry)
                chunks[0].lengths[-1][:] = 1
                chunks[0].values[-1] = chunks[0].values[-1][: len(chunks[0])]
                if weighted:
                    chunks[0].weights[-1] = chunks[0].weights[-1][: len(chunks[0])]
            parts = [(Part(copy(c)), rng.permutation(len(c))[: int(rng.integers(0, len(c) + 1))]) for c in chunks]
            got = assemble(parts, len(sizes), weighted)
            want = reference([(c, idx) for c, (_, idx) in zip(chunks, parts)], len(sizes), weighted)
            for key, w in want.items():
                assert got[key] is None if w is None else np.array_equal(got[key], w), (sizes, trial, key)
            assert got["size"] == len(want["labels"])
            per_key = [int(want["lengths"].reshape(len(sizes), -1)[f].sum()) for f in range(len(sizes))]
            assert list(got["length_per_key"]) == per_key
            # carried rows: a Part's rows taken into a new chunk, then gathered again
            p, idx = parts[-1]
            carried = Part(p.take(idx))
            again = assemble([(carried, np.arange(len(idx)))], len(sizes), weighted)
            alone = reference([(chunks[-1], idx)], len(sizes), weighted)
            for key, w in alone.items():
                assert again[key] is None if w is None else np.array_equal(again[key], w), (sizes, "carry", key)


HOT = [1, 1, 3, 7]  # rowid (int64, one id), onehot (int32), packed 3 ids, packed 7 ids; then a list column


def write_file(path: Path, n: int, rng: np.random.Generator) -> dict:
    """Rows with a row id, a one-hot int32 column, packed multi-hot ids, a list column (with nulls) and its weights."""
    rowid = np.arange(n, dtype=np.int64)
    onehot = rng.integers(0, 100, n).astype(np.int32)
    p3 = rng.integers(0, 100, (n, 3)).astype(np.int32)
    p7 = rng.integers(0, 100, (n, 7)).astype(np.int32)
    tags = [None if rng.random() < 0.1 else rng.integers(0, 100, rng.integers(0, 5)).tolist() for _ in range(n)]
    tag_w = [None if t is None else rng.random(len(t)).round(3).tolist() for t in tags]
    meta = {"embshard.packed": "int32"}
    table = pa.table(
        {
            "y": rng.integers(0, 2, n).astype(np.float32),
            "x": rng.random(n),
            "rowid": rowid,
            "onehot": onehot,
            "p3": pa.FixedSizeBinaryArray.from_buffers(pa.binary(12), n, [None, pa.py_buffer(p3.tobytes())]),
            "p7": pa.FixedSizeBinaryArray.from_buffers(pa.binary(28), n, [None, pa.py_buffer(p7.tobytes())]),
            "tags": pa.array(tags, pa.list_(pa.int32())),
            "tag_w": pa.array(tag_w, pa.list_(pa.float32())),
        }
    )
    schema = table.schema
    for name in ("p3", "p7"):
        schema = schema.set(schema.get_field_index(name), schema.field(name).with_metadata(meta))
    table = table.cast(schema)
    sizes = rng.integers(50, 200, 40)
    with pq.ParquetWriter(path, table.schema) as w:
        at = 0
        for size in sizes:
            w.write_table(table.slice(at, int(size)))
            at += int(size)
    return {"onehot": onehot, "p3": p3, "p7": p7, "tags": tags, "tag_w": tag_w}


def plain(kjt, labels, dense, feats: list[str]) -> dict:
    """A batch's values as Python lists (no tensor of it kept)."""
    out = {"labels": labels.tolist(), "dense": dense.tolist()}
    for k in feats:
        jt = kjt[k]
        out[k] = (
            jt.lengths().tolist(),
            jt.values().tolist(),
            None if jt.weights_or_none() is None else jt.weights().tolist(),
        )
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_workers_and_this_process_give_the_rows_of_the_file(tmp_path, weighted):
    """Two worker processes (batches lent from reused slots) give the round robin of the same two streams read in
    this process; every row holds the file's values; a batch held while later ones arrive keeps its values."""
    rng = np.random.default_rng(5)
    n = 4000
    raw = write_file(tmp_path / "rows.parquet", n, rng)
    feats = ["rowid", "onehot", "p3", "p7", "tags"]
    cfg = TableSourceConfig(
        files=(str(tmp_path / "rows.parquet"),),
        label="y",
        dense=(DenseColumnConfig("x"),),
        categorical=tuple(
            CategoricalColumnConfig(f, weights="tag_w" if f == "tags" and weighted else None) for f in feats
        ),
        mapping="identity",
        eval_fraction=0.05,
    )
    tables = [
        TableConfig(f"t_{f}", n if f == "rowid" else 100, 4, (f,), weighted=weighted and f == "tags") for f in feats
    ]
    data = DataConfig(source="table", table=cfg, workers=2, shuffle_rows=700, prefetch=2)
    src = TableSource(cfg, data, tables, 333, 0, 0, 1)
    src.pin = False  # the CPU hand-over (lent slots) on any machine; test_data_stream covers the pinned one
    got, storages, held = [], set(), None
    for i, b in enumerate(itertools.islice(src.train_batches(), 40)):  # 3.5 epochs: carries across windows, epochs
        got.append(plain(b.sparse, b.labels, b.dense, feats))
        storages.add(b.sparse.values().untyped_storage().data_ptr())
        if i == 3:
            held = b  # kept: its slot must not be written again
    assert plain(held.sparse, held.labels, held.dense, feats) == got[3]
    assert len(storages) < 20  # slots reused (2 workers, 2 + 4 slots each), not a fresh block per batch
    cursors = [tuple(c) for c in src.position_at(0)["streams"]]
    here = itertools.islice(iter(_Train(src.train_plan, 0, cursors)), 40)
    for g, d in zip(got, here):
        kjt = KeyedJaggedTensor(
            keys=feats,
            values=torch.as_tensor(d["values"]),
            lengths=torch.as_tensor(d["lengths"]),
            weights=None if d["weights"] is None else torch.as_tensor(d["weights"]),
        )
        assert g == plain(kjt, torch.as_tensor(d["labels"]), torch.as_tensor(d["dense"]), feats)
    for b in got:
        rows = b["rowid"][1]
        assert b["onehot"][1] == raw["onehot"][rows].tolist()
        assert b["p3"][1] == raw["p3"][rows].ravel().tolist()
        assert b["p7"][1] == raw["p7"][rows].ravel().tolist()
        tags = [raw["tags"][r] or [] for r in rows]
        assert b["tags"][:2] == ([len(t) for t in tags], [i for t in tags for i in t])
        if weighted:
            w = [x for r in rows for x in (raw["tag_w"][r] or [])]
            assert b["tags"][2] == np.array(w, np.float32).tolist()
