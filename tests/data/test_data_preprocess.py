"""`embshard preprocess` on a Criteo-format TSV (small; bench/preprocess_criteo.py does 1 GB): the Parquet it writes
gives the training loader exactly the batches of on-the-fly hashing (same rows, same shuffle), a rerun with another
worker count writes byte-identical files, a deleted part is redone alone, another configuration is refused, and
bad rows are skipped and reported."""

from __future__ import annotations

import csv
import itertools
import json
import os
from pathlib import Path

import paths
import pytest
import torch
import yaml

from embshard.config import load_config
from embshard.config.data import DataConfig
from embshard.config.schema import Source, build
from embshard.data import build_source
from embshard.data.preprocess import main as preprocess_main
from embshard.spec.tables import ConfigError

ROOT = paths.ROOT
DENSE = [f"I{i}" for i in range(1, 14)]
CAT = [f"C{i}" for i in range(1, 27)]


def criteo_tsv(path: Path, repeats: int = 6) -> int:
    """The sample's 200 rows, repeated with a per-copy suffix on the ids, as the headerless TSV release."""
    with open(ROOT / "data" / "criteo_sample.txt", newline="") as f:
        rows = list(csv.reader(f))[1:]
    lines = []
    for k in range(repeats):
        for r in rows:
            r = r[:14] + [f"{v}{k}" if v else "" for v in r[14:]]
            lines.append("\t".join(r))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def config(tmp: Path, tsv: Path, rows: int = 1000, **data) -> str:
    """A training config reading the TSV through data.source: table (the Criteo layout written out)."""
    cfg = {
        "model": {
            "kind": "dlrm",
            "tables": [
                {"name": f"t_{c}", "num_embeddings": rows, "embedding_dim": 8, "feature_names": [c]} for c in CAT
            ],
            "dlrm": {"bottom_mlp": [8], "top_mlp": [8]},
        },
        "data": {
            "source": "table",
            "table": {
                "files": [str(tsv)],
                "format": "tsv",
                "header": False,
                "column_names": ["label", *DENSE, *CAT],
                "label": "label",
                "dense": [{"column": c, "fill": 0, "min": 0, "transform": "log1p"} for c in DENSE],
                "categorical": [{"column": c} for c in CAT],
                "eval_fraction": 0.1,
                "chunk_rows": 100,
            },
            **data,
        },
        "schedule": {"batch_size": 16, "steps": 10},
    }
    path = tmp / f"cfg{len(list(tmp.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def run(cfg: str, out: Path, *extra: str) -> None:
    preprocess_main([cfg, "--out", str(out), "--no-progress", "--part-rows", "300", *extra])


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))}


def test_preprocess_equals_on_the_fly_and_is_deterministic(tmp_path):
    tsv = tmp_path / "day_0"
    n = criteo_tsv(tsv)
    cfg = config(tmp_path, tsv)
    run(cfg, tmp_path / "a", "--workers", "2")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and sum(p["rows"] for p in manifest["parts"]) == n
    assert len(manifest["parts"]) == 4  # 12 groups of 100 lines, 300 rows a part
    run(cfg, tmp_path / "b", "--workers", "1")
    first = files(tmp_path / "a")
    assert first == files(tmp_path / "b") and len(first) == 4  # byte-identical, whatever the workers
    # the loader on the Parquet (identity) gives the batches of on-the-fly hashing, shuffle included
    raw_cfg = load_config(cfg)
    tables = list(raw_cfg.model.tables)
    data = yaml.safe_load((tmp_path / "a" / "data.yaml").read_text())["data"]
    pre = build_source(build(DataConfig, data, "data", Source("data.yaml")), tables, 16, 0, 0, 1)
    raw = build_source(raw_cfg.data, tables, 16, 0, 0, 1)
    assert pre.steps_per_epoch == raw.steps_per_epoch
    for a, b in itertools.islice(zip(raw.train_batches(), pre.train_batches()), 2 * raw.steps_per_epoch):
        assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    held = [(a.sparse.values(), b.sparse.values()) for a, b in zip(raw.eval_batches(), pre.eval_batches())]
    assert len(held) == 8 and all(torch.equal(a, b) for a, b in held)


def test_resume_per_part_and_refusal(tmp_path):
    tsv = tmp_path / "day_0"
    criteo_tsv(tsv)
    cfg = config(tmp_path, tsv)
    out = tmp_path / "out"
    run(cfg, out, "--workers", "2")
    before = files(out)
    parts = sorted(out.glob("train/*.parquet"))
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    os.remove(parts[2])
    run(cfg, out, "--workers", "2")
    assert files(out) == before
    assert [p.stat().st_mtime_ns == stamps[p] for p in parts] == [True, True, False, True]  # only the lost part
    other = config(tmp_path, tsv, rows=500)
    with pytest.raises(SystemExit):
        run(other, out)
    run(other, out, "--overwrite")
    assert files(out) != before


def test_bad_rows_skipped_and_reported(tmp_path, capsys):
    tsv = tmp_path / "day_0"
    n = criteo_tsv(tsv, repeats=2)
    lines = tsv.read_text().splitlines()
    lines[57] = "\t".join(lines[57].split("\t")[:20])  # line 58: 20 fields
    lines[310] = "x" + lines[310]  # line 311: label 'x0' or 'x1'
    tsv.write_text("\n".join(lines) + "\n")
    cfg = config(tmp_path, tsv)
    with pytest.raises(SystemExit):
        run(cfg, tmp_path / "strict")
    assert f"error: {tsv}:58: 20 fields, expected 40" in capsys.readouterr().err
    run(cfg, tmp_path / "skip", "data.on_bad_row=skip")
    manifest = json.loads((tmp_path / "skip" / "manifest.json").read_text())
    assert sum(p["rows"] for p in manifest["parts"]) == n - 2
    skipped = manifest["skipped_this_run"]
    assert sum(c for c, _ in skipped.values()) == 2
    assert any(f"{tsv}:311: column 'label'=" in m for _, m in skipped.values())
    with pytest.raises(ConfigError, match="data.source is synthetic"):
        from embshard.data.preprocess import preprocess

        preprocess(
            type("A", (), {"config": str(ROOT / "configs" / "dlrm_synthetic.yaml"), "overrides": [], "out": "x"})()
        )
