"""Every bad-row path: by default an error naming file, line (CSV, blank lines counted) or row (Parquet), column,
value and rule; with on_bad_row: skip the row is dropped, counted per file and reported once per file, the other
rows come through intact, evaluation still yields the same number of batches, and errors raised in worker
processes reach the training process with their message."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embshard.config.data import CategoricalColumnConfig, DataConfig, DenseColumnConfig, TableSourceConfig
from embshard.data.source import TableSource
from embshard.spec.tables import ConfigError, TableConfig

HEADER = "label,x,cat,tags,tw"
TABLES = [TableConfig("t_cat", 100, 4, ("cat",)), TableConfig("t_tag", 100, 4, ("tags",), weighted=True)]


def good_line(i: int) -> str:
    return f"{i % 2},{i * 0.5},c{i % 13},a{i % 5}|b{i % 3},0.5|2"


def csv_source(tmp: Path, bad: dict[int, str], n: int = 60, blank_at: tuple[int, ...] = (), **data) -> TableSource:
    """A CSV of n data rows; row i (0-based) replaced by bad[i]; blank lines before rows in blank_at."""
    lines = [HEADER]
    for i in range(n):
        if i in blank_at:
            lines.append("")
        lines.append(bad.get(i, good_line(i)))
    path = tmp / "d.csv"
    path.write_text("\n".join(lines) + "\n")
    cfg = TableSourceConfig(
        files=(str(path),),
        label="label",
        dense=(DenseColumnConfig("x"),),
        categorical=(CategoricalColumnConfig("cat"), CategoricalColumnConfig("tags", separator="|", weights="tw")),
        eval_fraction=0.25,
        chunk_rows=16,
    )
    return TableSource(cfg, DataConfig(source="table", table=cfg, shuffle=False, **data), TABLES, 5, 0, 0, 1)


def first_error(src: TableSource) -> str:
    with pytest.raises(ConfigError) as e:
        list(itertools.islice(src.train_batches(), 40))
    return str(e.value)


CASES = [
    ("1,2.0,c1", "3 fields, expected 5"),
    ("1,abc,c1,a|b,1|1", "column 'x'='abc': not a number"),
    (",2.0,c1,a|b,1|1", "column 'label': the label is missing"),
    ("2,2.0,c1,a|b,1|1", "column 'label'=2.0: a label must be in [0, 1] (set label_threshold to binarize)"),
    ("1,inf,c1,a|b,1|1", "column 'x'=inf: a dense value must be finite"),
    ("1,2.0,c1,a|b|c,1|1", "column 'tw': 2 weights for 3 ids of column 'tags'"),
    ("1,2.0,c1,a|b,1|x", "column 'tw'=nan: a weight must be a finite number"),
]


@pytest.mark.parametrize("line,what", CASES, ids=[w.split(":")[0] for _, w in CASES])
def test_error_names_file_line_column_and_value(tmp_path, line, what):
    msg = first_error(csv_source(tmp_path, {20: line}))
    assert msg.startswith(f"{tmp_path / 'd.csv'}:22: {what}"), msg  # line 22: the header is line 1
    assert "on_bad_row: skip" in msg


def test_line_numbers_count_blank_lines(tmp_path):
    msg = first_error(csv_source(tmp_path, {20: "1,abc,c1,a|b,1|1"}, blank_at=(3, 18)))
    assert msg.startswith(f"{tmp_path / 'd.csv'}:24: column 'x'='abc'"), msg


def test_skip_drops_counts_and_reports(tmp_path, capsys):
    bad = {i: line for i, (line, _) in zip((3, 8, 20, 21, 33), CASES)}
    src = csv_source(tmp_path, bad, on_bad_row="skip")
    batches = list(itertools.islice(src.train_batches(), 8))  # 45 training rows less 5 bad: 40 rows, 8 batches
    x = np.concatenate([b.dense[:, 0].numpy() for b in batches])
    want = [i * 0.5 for i in range(45) if i not in bad]
    assert x.tolist() == want
    tags = batches[0].sparse["tags"]
    assert tags.weights().tolist()[:2] == [0.5, 2.0]
    path = str(tmp_path / "d.csv")
    assert src.skipped_rows == {path: 5}
    err = capsys.readouterr().err
    assert err.count("skipped bad rows in") == 1 and f"(first: {path}:5: 3 fields, expected 5)" in err
    # the next epoch skips them again (counted again)
    list(itertools.islice(src.train_batches(batches[-1].position), 8))
    assert src.skipped_rows[path] == 10


def test_eval_keeps_its_batch_count_when_rows_are_skipped(tmp_path):
    bad = {i: "1,abc,c1,a|b,1|1" for i in range(45, 56)}  # 11 of the 15 held-out rows
    src = csv_source(tmp_path, bad, on_bad_row="skip")
    sizes = [b.size for b in src.eval_batches()]
    assert sizes == [4, 0, 0]  # 15 rows would make 3 batches of 5: every rank yields 3
    assert sum(sizes) == 4


def test_error_from_a_worker_process(tmp_path):
    src = csv_source(tmp_path, {40: "1,abc,c1,a|b,1|1"}, workers=2)
    msg = first_error(src)
    assert msg.startswith(f"{tmp_path / 'd.csv'}:42: column 'x'='abc': not a number"), msg
    assert "Traceback" not in msg


def parquet_source(tmp: Path, table: pa.Table, **data) -> TableSource:
    path = tmp / "p.parquet"
    pq.write_table(table, path, row_group_size=10)
    cfg = TableSourceConfig(
        files=(str(path),),
        label="y",
        categorical=(CategoricalColumnConfig("id"), CategoricalColumnConfig("ids")),
        mapping="identity",
        eval_fraction=0.2,
    )
    tables = [TableConfig("t_id", 100, 4, ("id",)), TableConfig("t_ids", 100, 4, ("ids",))]
    return TableSource(cfg, DataConfig(source="table", table=cfg, shuffle=False, **data), tables, 4, 0, 0, 1)


def ids_table(n: int = 40) -> dict:
    return {
        "y": pa.array(np.arange(n) % 2, pa.float32()),
        "id": pa.array(np.arange(n)),
        "ids": pa.array([[i, i + 1] for i in range(n)]),
    }


def test_parquet_rows_and_identity_ranges(tmp_path):
    cols = ids_table()
    cols["id"] = pa.array([150 if i == 13 else i for i in range(40)])
    msg = first_error(parquet_source(tmp_path, pa.table(cols)))
    assert msg.startswith(f"{tmp_path / 'p.parquet'}, row 13 (counting from 0): column 'id'=150: an id must be in "), (
        msg
    )
    assert "[0, 100) (table 't_id' has 100 rows)" in msg
    cols = ids_table()
    cols["ids"] = pa.array([[i, -1 if i == 7 else i] for i in range(40)])
    assert "row 7 (counting from 0): column 'ids'=-1: an id must be in [0, 100)" in first_error(
        parquet_source(tmp_path, pa.table(cols))
    )
    cols = ids_table()
    cols["y"] = pa.array([None if i == 25 else float(i % 2) for i in range(40)], pa.float32())
    assert "row 25 (counting from 0): column 'y': the label is missing" in first_error(
        parquet_source(tmp_path, pa.table(cols))
    )
    src = parquet_source(tmp_path, pa.table(cols), on_bad_row="skip")
    got = np.concatenate([b.sparse["id"].values().numpy() for b in itertools.islice(src.train_batches(), 7)])
    assert got.tolist() == [i for i in range(29) if i != 25]
    assert src.skipped_rows == {str(tmp_path / "p.parquet"): 1}


def test_identity_text_that_is_not_an_integer(tmp_path):
    path = tmp_path / "i.csv"
    path.write_text("y,id\n" + "".join(f"{i % 2},{'x7' if i == 9 else i}\n" for i in range(30)))
    cfg = TableSourceConfig(
        files=(str(path),), label="y", categorical=(CategoricalColumnConfig("id"),), mapping="identity"
    )
    src = TableSource(cfg, DataConfig(source="table", table=cfg), [TableConfig("t", 50, 4, ("id",))], 4, 0, 0, 1)
    assert first_error(src).startswith(f"{path}:11: column 'id'='x7': not an integer")


def test_training_with_a_rank_whose_held_out_rows_were_all_bad(tmp_path):
    """2 processes; rank 1's held-out rows are all bad and skipped: it evaluates on an empty batch (every rank takes
    part in every exchange), the loss stays finite and counts rank 0's rows only."""
    import yaml
    from train_job import embshard_train

    lines = ["label,x,cat"] + [f"{i % 2},{'abc' if i >= 90 else i * 0.1},c{i % 21}" for i in range(100)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    cfg = {
        "model": {
            "kind": "dlrm",
            "tables": [{"name": "t_cat", "num_embeddings": 32, "embedding_dim": 8, "feature_names": ["cat"]}],
            "dlrm": {"bottom_mlp": [8], "top_mlp": [8]},
        },
        "data": {
            "source": "table",
            "table": {
                "files": [str(tmp_path / "d.csv")],
                "label": "label",
                "dense": [{"column": "x"}],
                "categorical": [{"column": "cat"}],
                "eval_fraction": 0.2,  # rows 80-99: rank 0 reads 80-89, rank 1 90-99 (all bad)
            },
            "on_bad_row": "skip",
        },
        "schedule": {"batch_size": 10, "steps": 4, "eval_at_start": True},
        "logging": {"tensorboard_dir": None, "progress_bar": False, "log_every": 2},
        "checkpoint": {"dir": None},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    res = embshard_train([str(tmp_path / "run.yaml")], nproc=2)
    evals = [line for line in res.stdout.splitlines() if line.startswith("eval")]
    assert len(evals) == 2 and all("(10 samples)" in e and "loss nan" not in e for e in evals), evals
    assert "rank 1: data.table: skipped bad rows" in res.stderr
