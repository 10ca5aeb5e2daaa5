"""Data files from others: ids beyond int64 (CSV text, Parquet uint64), empty files, and Parquet pages damaged
after `embshard preprocess` wrote them (page checksums written and verified)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from embshard.config.data import CategoricalColumnConfig, DataConfig, TableSourceConfig
from embshard.config.schema import Source, build
from embshard.data import build_source
from embshard.data.preprocess import main as preprocess_main
from embshard.data.source import TableSource
from embshard.spec.tables import ConfigError, TableConfig

BIG = 2**63 + 5
TABLES = [TableConfig("t", 100, 4, ("id",))]


def source(path: Path, **data) -> TableSource:
    cfg = TableSourceConfig(
        files=(str(path),), label="y", categorical=(CategoricalColumnConfig("id"),), mapping="identity"
    )
    return TableSource(cfg, DataConfig(source="table", table=cfg, shuffle=False, **data), TABLES, 4, 0, 0, 1)


def first_error(src: TableSource) -> str:
    with pytest.raises(ConfigError) as e:
        list(itertools.islice(src.train_batches(), 10))
    return str(e.value)


def test_csv_id_above_int64_names_file_line_column_and_value(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("y,id\n" + "".join(f"{i % 2},{BIG if i == 3 else i}\n" for i in range(30)))
    msg = first_error(source(path))
    assert msg.startswith(f"{path}:5: column 'id'='{BIG}': not an integer in the int64 range"), msg
    got = [
        b.sparse["id"].values().tolist() for b in itertools.islice(source(path, on_bad_row="skip").train_batches(), 2)
    ]
    assert got == [[0, 1, 2, 4], [5, 6, 7, 8]]  # the row is dropped, the others come through


def test_parquet_uint64_id_above_int64_names_file_row_column_and_value(tmp_path):
    path = tmp_path / "d.parquet"
    ids = pa.array([BIG if i == 6 else i for i in range(30)], pa.uint64())
    pq.write_table(pa.table({"y": pa.array(np.arange(30) % 2, pa.float32()), "id": ids}), path)
    msg = first_error(source(path))
    assert msg.startswith(f"{path}, row 6 (counting from 0): column 'id'={BIG}: an integer above the int64 range"), msg
    got = np.concatenate(
        [b.sparse["id"].values().numpy() for b in itertools.islice(source(path, on_bad_row="skip").train_batches(), 4)]
    )
    assert got.tolist() == [i for i in range(17) if i != 6]


def test_empty_files_say_they_are_empty(tmp_path):
    (tmp_path / "e.csv").write_text("y,id\n")
    pq.write_table(pa.table({"y": pa.array([], pa.float32()), "id": pa.array([], pa.int64())}), tmp_path / "e.parquet")
    for name in ("e.csv", "e.parquet"):
        with pytest.raises(
            ConfigError, match=rf"data\.table\.files: {tmp_path / name}: the file is empty \(no data rows\)"
        ):
            source(tmp_path / name)


def _preprocess(tmp: Path) -> Path:
    csv = tmp / "d.csv"
    csv.write_text("y,id\n" + "".join(f"{i % 2},{(i * 7) % 100}\n" for i in range(64)))
    cfg = {
        "model": {
            "kind": "dlrm",
            "tables": [{"name": "t", "num_embeddings": 100, "embedding_dim": 4, "feature_names": ["id"]}],
            "dlrm": {"bottom_mlp": [4], "top_mlp": [4]},
        },
        "data": {
            "source": "table",
            "table": {"files": [str(csv)], "label": "y", "categorical": [{"column": "id"}], "mapping": "identity"},
        },
        "schedule": {"batch_size": 4, "steps": 2},
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp / "out"
    preprocess_main(
        [str(tmp / "run.yaml"), "--out", str(out), "--no-progress", "--workers", "1", "--compression", "none"]
    )
    return out


def test_preprocess_writes_page_checksums_and_a_flipped_byte_is_an_error_naming_the_file(tmp_path):
    out = _preprocess(tmp_path)
    data = yaml.safe_load((out / "data.yaml").read_text())["data"]
    cfg = build(DataConfig, {**data, "shuffle": False}, "data", Source("data.yaml"))
    src = build_source(cfg, TABLES, 4, 0, 0, 1)
    clean = [v for b in itertools.islice(src.train_batches(), src.steps_per_epoch) for v in b.sparse["id"].values()]
    [part] = sorted(out.glob("train/*.parquet"))
    meta = pq.ParquetFile(part).metadata
    ids = next(i for i in range(meta.num_columns) if meta.schema.column(i).name == "id")
    chunk = meta.row_group(0).column(ids)
    end = chunk.data_page_offset + chunk.total_compressed_size  # the id column's page ends with its plain values
    before = pq.read_table(part, columns=["id"])["id"].to_pylist()
    raw = bytearray(part.read_bytes())
    raw[end - 4] ^= 0x01  # the low byte of the last int32 id
    part.write_bytes(bytes(raw))
    after = pq.read_table(part, columns=["id"])["id"].to_pylist()  # a reader that does not verify: a silent change
    assert after[:-1] == before[:-1] and after[-1] == before[-1] ^ 1 and len(clean) == src.steps_per_epoch * 4
    with pytest.raises(ConfigError, match=rf"{part}: row group 0 cannot be read \(.*\): the file is damaged"):
        list(itertools.islice(build_source(cfg, TABLES, 4, 0, 0, 1).train_batches(), 20))
