"""Data sets that no shipped config names, configured in YAML alone (data.source: table): an Avazu-like CSV with a
header, multi-valued text with per-id weights, a Parquet file written here (lists, nulls, identity ids, packed
ids), vocabularies (counted at start-up and from `embshard preprocess --vocab-only`), config errors, and one
end-to-end `embshard train` run. Every value is checked against an independent computation from the raw rows."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import paths
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from test_data import expected_row, ref_hash
from train_job import embshard_train

from embshard.config import load_config
from embshard.data import build_source
from embshard.data.preprocess import main as preprocess_main
from embshard.spec.tables import ConfigError

ROOT = paths.ROOT


def write_config(tmp: Path, tables: list[dict], data: dict, **extra) -> str:
    cfg = {
        "model": {"kind": "dlrm", "tables": tables, "dlrm": {"bottom_mlp": [8], "top_mlp": [8]}},
        "data": data,
        "schedule": {"batch_size": 8, "steps": 6},
        "logging": {"tensorboard_dir": None, "progress_bar": False, "log_every": 2},
        **extra,
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def source_of(path: str, rank: int = 0, world: int = 1, batch: int = 8):
    cfg = load_config(path)
    return build_source(cfg.data, list(cfg.model.tables), batch, cfg.seed, rank, world)


def epoch(src) -> list:
    return [next(it) for it in [src.train_batches()] for _ in range(src.steps_per_epoch)]


def avazu(tmp: Path, n: int = 240) -> tuple[Path, list[dict]]:
    """An Avazu-like CSV: id, click, hour, banner_pos, site_id, app_id, device_type, C14 (some fields empty)."""
    rng = np.random.default_rng(7)
    rows = []
    for i in range(n):
        rows.append(
            {
                "id": str(10**18 + i),
                "click": str(int(rng.random() < 0.3)),
                "hour": f"1410{21 + i % 9:02d}{i % 24:02d}",
                "banner_pos": "" if i % 11 == 0 else str(int(rng.integers(0, 7))),
                "site_id": f"{int(rng.integers(0, 40)):08x}",
                "app_id": "" if i % 7 == 0 else f"ecad{int(rng.integers(0, 9))}",
                "device_type": str(int(rng.integers(0, 5))),
                "C14": str(int(rng.integers(15000, 15100))),
            }
        )
    path = tmp / "avazu.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path, rows


AVAZU_TABLES = [
    {"name": "t_site", "num_embeddings": 64, "embedding_dim": 8, "feature_names": ["site_id"]},
    {"name": "t_app", "num_embeddings": 16, "embedding_dim": 8, "feature_names": ["app_id"]},
    {"name": "t_dev", "num_embeddings": 8, "embedding_dim": 8, "feature_names": ["device_type"]},
    {"name": "t_c14", "num_embeddings": 128, "embedding_dim": 8, "feature_names": ["c14"]},
]


def avazu_data(path: Path, **table) -> dict:
    return {
        "source": "table",
        "table": {
            "files": [str(path)],
            "label": "click",
            "dense": [{"column": "banner_pos", "fill": 0, "transform": "log1p"}, {"column": "device_type"}],
            "categorical": [
                {"column": "site_id"},
                {"column": "app_id"},
                {"column": "device_type"},
                {"column": "C14", "feature": "c14"},
            ],
            "eval_fraction": 0.2,
            **table,
        },
        "shuffle": False,
    }


def test_avazu_csv_from_yaml(tmp_path):
    path, rows = avazu(tmp_path)
    src = source_of(write_config(tmp_path, AVAZU_TABLES, avazu_data(path)))
    assert src.num_dense == 2 and src.steps_per_epoch == 192 // 8
    batches = epoch(src)
    labels = torch.cat([b.labels for b in batches])
    dense = torch.cat([b.dense for b in batches])
    assert labels.tolist() == [float(r["click"]) for r in rows[:192]]
    want = [[math.log1p(float(r["banner_pos"] or 0)), float(r["device_type"])] for r in rows[:192]]
    assert torch.allclose(dense, torch.tensor(want, dtype=torch.float32))
    rows_of = {"site_id": 64, "app_id": 16, "device_type": 8, "c14": 128}
    column = {"c14": "C14"}
    for f, n in rows_of.items():
        ids = torch.cat([b.sparse[f].values() for b in batches]).tolist()
        assert ids == [expected_row(r[column.get(f, f)], n) for r in rows[:192]], f
    assert 0 in torch.cat([b.sparse["app_id"].values() for b in batches]).tolist()  # empty app_id: row 0
    held = list(src.eval_batches())
    assert sum(b.size for b in held) == 48
    # shuffled: every epoch is a permutation of the same rows, different from the file order and between epochs
    shuffled = source_of(write_config(tmp_path, AVAZU_TABLES, {**avazu_data(path), "shuffle": True}))
    it = shuffled.train_batches()
    e1 = torch.cat([next(it).sparse["c14"].values() for _ in range(24)])
    e2 = torch.cat([next(it).sparse["c14"].values() for _ in range(24)])
    plain = torch.cat([b.sparse["c14"].values() for b in batches])
    assert sorted(e1.tolist()) == sorted(plain.tolist()) == sorted(e2.tolist())
    assert not torch.equal(e1, plain) and not torch.equal(e1, e2)


def test_multi_valued_text_with_weights(tmp_path):
    lines = ["label,tags,tag_w,user"]
    rng = np.random.default_rng(3)
    raw = []
    for i in range(64):
        k = int(rng.integers(0, 5))
        tags = [f"t{int(rng.integers(0, 30))}" for _ in range(k)]
        weights = [f"{float(rng.random()) + 0.5:.3f}" for _ in range(k)]
        if i == 5:
            tags, weights = ["a", "", "b"], ["1.5", "2", "0.25"]  # an empty part is dropped with its weight
        raw.append((tags, weights))
        lines.append(f"{i % 2},{'|'.join(tags)},{'|'.join(weights)},u{i % 9}")
    path = tmp_path / "tags.csv"
    path.write_text("\n".join(lines) + "\n")
    tables = [
        {"name": "t_tag", "num_embeddings": 50, "embedding_dim": 8, "feature_names": ["tags"], "weighted": True},
        {"name": "t_user", "num_embeddings": 20, "embedding_dim": 8, "feature_names": ["user"]},
    ]
    data = {
        "source": "table",
        "table": {
            "files": [str(path)],
            "label": "label",
            "categorical": [{"column": "tags", "separator": "|", "weights": "tag_w"}, {"column": "user"}],
            "eval_fraction": 0.25,
        },
        "shuffle": False,
    }
    src = source_of(write_config(tmp_path, tables, data))
    batches = epoch(src)
    kjt_lengths = torch.cat([b.sparse["tags"].lengths() for b in batches]).tolist()
    ids = torch.cat([b.sparse["tags"].values() for b in batches]).tolist()
    weights = torch.cat([b.sparse["tags"].weights() for b in batches]).tolist()
    want_len, want_ids, want_w = [], [], []
    for tags, w in raw[:48]:
        kept = [(t, float(x)) for t, x in zip(tags, w) if t]
        kept = kept or [("", 1.0)]  # an empty bag: one id of the missing row
        want_len.append(len(kept))
        want_ids += [expected_row(t, 50) for t, _ in kept]
        want_w += [x for _, x in kept]
    assert kjt_lengths == want_len and ids == want_ids
    assert weights == pytest.approx(want_w, rel=1e-6)
    user_w = torch.cat([b.sparse["user"].weights() for b in batches])
    assert (user_w == 1).all()  # an unweighted feature of a weighted batch gets weight 1


def test_parquet_written_here(tmp_path):
    """Lists of strings, int ids used as rows (identity), nulls, a float dense column with NaN, packed ids."""
    n = 90
    rng = np.random.default_rng(5)
    genres = [[f"g{int(x)}" for x in rng.integers(0, 12, int(rng.integers(1, 4)))] for _ in range(n)]
    genres[3] = None
    ids = rng.integers(0, 500, n)
    item = pa.array(ids, mask=(np.arange(n) % 10 == 4))  # nulls: empty bags with identity
    hist = rng.integers(0, 100, (n, 3)).astype(np.int32)
    packed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(12), n, [None, pa.py_buffer(hist.tobytes())])
    price = rng.random(n) * 10
    price[7] = np.nan
    table = pa.table({"y": pa.array(rng.random(n) < 0.5), "price": price, "genres": genres, "item": item})
    table = table.append_column(pa.field("hist", pa.binary(12), metadata={"embshard.packed": "int32"}), packed)
    path = tmp_path / "events.parquet"
    pq.write_table(table, path, row_group_size=25)
    tables = [
        {"name": "t_genre", "num_embeddings": 40, "embedding_dim": 8, "feature_names": ["genres"]},
        {"name": "t_item", "num_embeddings": 500, "embedding_dim": 8, "feature_names": ["item", "hist"]},
    ]
    data = {
        "source": "table",
        "table": {
            "files": [str(tmp_path / "*.parquet")],
            "label": "y",
            "dense": [{"column": "price", "fill": -1}],
            "categorical": [{"column": "genres"}, {"column": "item"}, {"column": "hist"}],
            "mapping": "hash",
            "eval_fraction": 0.1,
        },
        "shuffle": False,
    }
    src = source_of(write_config(tmp_path, tables, data))
    got = epoch(src)
    dense = torch.cat([b.dense for b in got])[:, 0]
    assert dense[7] == -1 and dense[0] == pytest.approx(price[0], rel=1e-6)
    g_len = torch.cat([b.sparse["genres"].lengths() for b in got]).tolist()
    assert g_len == [len(g) if g else 1 for g in genres[:80]]
    g_ids = torch.cat([b.sparse["genres"].values() for b in got]).tolist()
    assert g_ids == [expected_row(x, 40) for g in genres[:80] for x in (g or [""])]
    item_ids = torch.cat([b.sparse["item"].values() for b in got]).tolist()
    assert item_ids == [0 if i % 10 == 4 else 1 + ref_hash(str(ids[i])) % 499 for i in range(80)]  # ints as text
    # identity: ids are rows, nulls are empty bags, packed ids come out as 3 ids a row
    data["table"]["mapping"] = "identity"
    data["table"]["categorical"] = [{"column": "genres", "feature": "genres"}, {"column": "item"}, {"column": "hist"}]
    tables[0]["feature_names"] = ["genres"]
    with pytest.raises(ConfigError, match=r"column 'genres'.*not an integer"):
        epoch(source_of(write_config(tmp_path, tables, data)))
    data["table"]["categorical"] = [{"column": "item"}, {"column": "hist"}]
    src = source_of(write_config(tmp_path, tables[1:], data))
    got = epoch(src)
    item = torch.cat([b.sparse["item"].lengths() for b in got]).tolist()
    assert item == [0 if i % 10 == 4 else 1 for i in range(80)]
    assert torch.cat([b.sparse["item"].values() for b in got]).tolist() == [ids[i] for i in range(80) if i % 10 != 4]
    assert torch.cat([b.sparse["hist"].values() for b in got]).tolist() == hist[:80].ravel().tolist()


def test_vocab_from_preprocess_equals_counted_at_start(tmp_path):
    path, rows = avazu(tmp_path)
    data = avazu_data(path, mapping="vocab", vocab_min_count=2)
    config = write_config(tmp_path, AVAZU_TABLES, data)
    counted = epoch(source_of(config))
    preprocess_main([config, "--out", str(tmp_path / "pre"), "--vocab-only", "--workers", "2", "--no-progress"])
    assert sorted(p.name for p in (tmp_path / "pre" / "vocab").iterdir()) == [
        "C14.parquet",
        "app_id.parquet",
        "device_type.parquet",
        "site_id.parquet",
    ]
    data["table"]["vocab_dir"] = str(tmp_path / "pre" / "vocab")
    from_files = epoch(source_of(write_config(tmp_path, AVAZU_TABLES, data)))
    for a, b in zip(counted, from_files):
        assert torch.equal(a.sparse.values(), b.sparse.values())
    # independently: the rank of each training value by (count desc, value), min_count 2, 16 - 2 rows for app_id
    train = [r["app_id"] for r in rows[:192] if r["app_id"]]
    counts = {v: train.count(v) for v in set(train)}
    ranked = [v for v in sorted(counts, key=lambda v: (-counts[v], v)) if counts[v] >= 2][:14]
    want = [0 if not r["app_id"] else (2 + ranked.index(r["app_id"]) if r["app_id"] in ranked else 1) for r in rows]
    assert torch.cat([b.sparse["app_id"].values() for b in counted]).tolist() == want[:192]


def test_config_errors(tmp_path):
    path, _ = avazu(tmp_path)

    def error(data: dict, tables=AVAZU_TABLES) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(write_config(tmp_path, tables, data))
        return str(e.value)

    data = avazu_data(path)
    data["table"]["categorical"][0]["seperator"] = "|"
    assert "unknown key 'data.table.categorical[0].seperator'" in error(data)
    data = avazu_data(path)
    del data["table"]["categorical"][3]
    assert "data.table.categorical='3 columns' is invalid: features ['c14'] have no column" in error(data)
    data = avazu_data(path)
    data["table"]["categorical"].append({"column": "hour"})
    assert "data.table.categorical[4].feature='hour' is invalid: no table lists this feature" in error(data)
    data = avazu_data(path)
    data["table"]["categorical"][1]["weights"] = "hour"
    assert "data.table.categorical[1].weights='hour' is invalid: its table is not weighted" in error(data)
    data = avazu_data(path, format="tsv", header=False)
    assert "data.table.column_names=None is invalid: header: false needs the names" in error(data)
    data = avazu_data(path)
    data["table"]["dense"][0]["column"] = "nope"
    with pytest.raises(ConfigError, match=r"avazu.csv has no column\(s\) \['nope'\]; its columns: \['id', 'click'"):
        source_of(write_config(tmp_path, AVAZU_TABLES, data))
    data = avazu_data(path, files=[str(tmp_path / "x.bin")])
    (tmp_path / "x.bin").write_text("")
    with pytest.raises(ConfigError, match="cannot tell the format of .*x.bin.*set format"):
        source_of(write_config(tmp_path, AVAZU_TABLES, data))


def test_train_from_yaml_alone(tmp_path):
    """`embshard train` on the Avazu-like CSV: no shipped config names it."""
    path, _ = avazu(tmp_path, n=400)
    config = write_config(
        tmp_path,
        AVAZU_TABLES,
        avazu_data(path, eval_fraction=0.25),
        checkpoint={"dir": None},
        sparse_optimizer={"kind": "rowwise_adagrad", "lr": 0.05},
    )
    res = embshard_train([config, "schedule.steps=20", "data.workers=1"])
    assert "train step     20" in res.stdout and "auc" in res.stdout and "(100 samples)" in res.stdout
