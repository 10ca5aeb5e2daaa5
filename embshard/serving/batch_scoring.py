"""`embshard predict DIR DATA --out scores.parquet`: score a data source's rows with a serving artifact.

DATA is either data files (Parquet, CSV or TSV paths or globs) read with the training run's own data config
(model.json's `data`: its columns, hashing and dense transforms; the files replace its own), or a YAML file with a
`data:` section as `embshard train` reads (docs/config.md; any source, synthetic included). `split` all scores
every row of the files; held_out the training run's held-out rows of that source (its eval_fraction or
eval_files: the same rows `embshard train` evaluated on). Output: one row per sample, in data order: `row`, `score`
(probability), `label` (as the data has it). The AUC is printed when the labels have both classes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import yaml

from embshard.config.data import DataConfig
from embshard.config.schema import Source, build
from embshard.data.common import Batch
from embshard.spec.tables import ConfigError


@dataclass
class Scored:
    rows: int
    seconds: float
    auc: float | None
    path: str

    @property
    def samples_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


def data_config(data: str, trained: dict | None) -> tuple[DataConfig, list[str] | None]:
    """(the data config, the data files given on the command line or None)."""
    if data.endswith((".yaml", ".yml")):
        try:
            doc = yaml.safe_load(Path(data).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"DATA {data!r}: cannot read it as YAML ({e})") from None
        section = doc.get("data", doc) if isinstance(doc, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"{data}: no `data:` section (as a training config has)")
        return build(DataConfig, section, "data", Source(data)), None
    if not isinstance(trained, dict):
        raise ConfigError(
            f"DATA {data!r}: the artifact holds no training data config; give a YAML with a data: section"
        )
    return build(DataConfig, json.loads(json.dumps(trained)), "data", Source("model.json of the artifact")), [data]


def source_batches(
    cfg: DataConfig, files: list[str] | None, tables: list, batch_size: int, split: str
) -> Iterator[Batch]:
    """The batches to score (see the module docstring)."""
    from embshard.data import build_source, table_config

    if split not in ("all", "held_out"):
        raise ConfigError(f"--split {split!r}: give all or held_out")
    if cfg.source == "synthetic":
        if split == "all":
            raise ConfigError("--split all: a synthetic source has no fixed rows; use --split held_out")
        yield from build_source(cfg, tables, batch_size, 0, 0, 1, workers=0).eval_batches()
        return
    from embshard.data.layout import detect_format, resolve_files, scan
    from embshard.data.source import TableSource, read_spec

    tcfg = table_config(cfg, tables)
    if tcfg.mapping == "vocab":
        raise ConfigError("mapping: vocab: the vocabulary is built from the training rows, which the artifact does "
                          "not carry; score with hash or identity mapping")  # fmt: skip
    if files is not None:
        tcfg = replace(tcfg, files=tuple(files), eval_files=None)
    if split == "all":
        tcfg = replace(tcfg, eval_files=tcfg.files, eval_fraction=None)  # every row is held out, once
    paths = resolve_files(tcfg.files, "DATA")
    fmt = detect_format(paths, tcfg.format, "DATA")
    spec = read_spec(tcfg, tables, fmt, cfg.on_bad_row, "DATA")
    rows = scan(paths, fmt, tcfg.header, tcfg.column_names, spec.delimiter, spec.chunk_rows).rows
    if tcfg.eval_files is None:  # the held-out rows are the files' last ones: the rest is the training part
        rows -= max(1, round(rows * tcfg.held_out_fraction))
    batch_size = max(1, min(batch_size, rows))  # the source wants a whole training batch; scoring reads eval rows
    data = replace(cfg, shuffle=False, workers=0)
    yield from TableSource(tcfg, data, tables, batch_size, 0, 0, 1, "DATA").eval_batches()


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (ties count half), None without both classes."""
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    s = scores[order]
    i = 0
    while i < len(s):  # average ranks of ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def score(
    predictor: Callable[[Batch], torch.Tensor],
    batches: Iterator[Batch],
    out: str,
    progress: bool = True,
) -> Scored:
    """Score every batch, write `out` (Parquet: row, score, label); what was done."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    scores, labels = [], []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit=" samples", file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    for batch in batches:
        scores.append(predictor(batch).detach().float().cpu().numpy())
        labels.append(batch.labels.float().cpu().numpy())
        if bar is not None:
            bar.update(batch.size)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    s = np.concatenate(scores) if scores else np.zeros(0, np.float32)
    y = np.concatenate(labels) if labels else np.zeros(0, np.float32)
    table = pa.table({"row": np.arange(len(s), dtype=np.int64), "score": s, "label": y})
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
    except OSError as e:
        raise ConfigError(f"--out {out!r}: cannot write it ({e})") from None
    return Scored(len(s), seconds, binary_auc(s, y), out)
