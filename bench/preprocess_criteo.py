"""`embshard preprocess` on a generated Criteo-format TSV of --gib GiB: time, byte-identical rerun, same ids as the
loader's on-the-fly hashing.

Usage: python -m bench.preprocess_criteo [--gib 1] [--workers N] [--dir /tmp/embshard_pre]

Steps: (1) write a headerless TSV in the Criteo layout (label, I1..I13 with ~20% empty, C1..C26 as 8-digit hex
with ~10% empty, Zipf-skewed ids) with pyarrow's CSV writer; (2) `embshard preprocess` it with --workers processes
(MLPerf table sizes: 40M-row caps); (3) again into a second folder with one worker fewer and compare every output
byte; (4) read the raw TSV with on-the-fly hashing and the Parquet with identity mapping through the training loader
(shuffled, same seed) and compare every training and held-out batch. Prints a summary table.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import numpy as np
import yaml

ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4, 976,
    14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def hex8(x: np.ndarray):
    """uint32 values as 8-digit lower-case hex strings (an Arrow string array)."""
    import pyarrow as pa

    nibbles = (x[:, None] >> np.arange(28, -1, -4, dtype=np.uint32)) & 0xF
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(8), len(x), [None, pa.py_buffer(HEX[nibbles].tobytes())]
    ).cast(pa.string())


def write_tsv(path: Path, gib: float, seed: int = 0) -> int:
    """A Criteo-format TSV of about `gib` GiB; returns its rows."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    block, rows, target = 200_000, 0, int(gib * 2**30)
    with open(path, "wb") as f:
        while f.tell() < target:
            n = block
            cols = [pc.cast(pa.array((rng.random(n) < 0.26).astype(np.int8)), pa.string())]
            for _ in range(13):
                v = np.floor(rng.lognormal(1.0, 2.0, n)).astype(np.int64) - (rng.random(n) < 0.02)
                cols.append(pc.cast(pa.array(v, mask=rng.random(n) < 0.2), pa.string()))
            for j in range(26):
                vocab = max(4, min(ROWS[j], 2_000_000))
                ranks = np.minimum(rng.zipf(1.2, n) - 1, vocab - 1).astype(np.uint32)
                ids = (ranks * np.uint32(2654435761) + np.uint32(j * 977)).astype(np.uint32)
                text = hex8(ids)
                cols.append(pc.if_else(pa.array(rng.random(n) < 0.1), pa.nulls(n, pa.string()), text))
            table = pa.table(cols, names=[f"f{i}" for i in range(40)])
            opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
            pacsv.write_csv(table, f, opts)
            rows += n
    return rows


def config(folder: Path, tsv: Path) -> Path:
    cfg = {
        "model": {
            "kind": "dlrm",
            "tables": [
                {"name": f"t_C{i + 1}", "num_embeddings": r, "embedding_dim": 16, "feature_names": [f"C{i + 1}"]}
                for i, r in enumerate(ROWS)
            ],
        },
        "data": {"source": "criteo", "criteo": {"path": str(tsv), "format": "tsv", "eval_fraction": 0.05}},
        "schedule": {"batch_size": 8192, "steps": 1},
    }
    path = folder / "criteo_1g.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the generated TSV (GiB)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="embshard preprocess --workers")
    ap.add_argument("--dir", default="/tmp/embshard_pre", help="work folder (TSV, outputs)")
    ap.add_argument("--no-compare", action="store_true", help="skip step 4 (the loader comparison)")
    args = ap.parse_args()
    from embshard.config import load_config
    from embshard.config.data import DataConfig
    from embshard.config.schema import Source, build
    from embshard.data import build_source
    from embshard.data.preprocess import main as preprocess

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    tsv = folder / "day_0"
    t0 = time.perf_counter()
    if not tsv.exists() or tsv.stat().st_size < args.gib * 2**30:
        rows = write_tsv(tsv, args.gib)
    else:
        rows = sum(1 for _ in open(tsv, "rb"))
    t_gen = time.perf_counter() - t0
    size = tsv.stat().st_size
    print(f"TSV: {size / 2**30:.2f} GiB, {rows} rows ({t_gen:.0f} s)", flush=True)
    cfg = config(folder, tsv)
    timings = {}
    for name, workers in (("a", args.workers), ("b", max(1, args.workers - 1))):
        out = folder / f"out_{name}"
        t0 = time.perf_counter()
        preprocess([str(cfg), "--out", str(out), "--workers", str(workers), "--overwrite"])
        timings[name] = (workers, time.perf_counter() - t0)
        print(f"preprocess {out} with {workers} workers: {timings[name][1]:.1f} s", flush=True)
    a = sorted((folder / "out_a").rglob("*.parquet"))
    b = sorted((folder / "out_b").rglob("*.parquet"))
    identical = [p.relative_to(folder / "out_a") for p in a] == [p.relative_to(folder / "out_b") for p in b] and all(
        x.read_bytes() == y.read_bytes() for x, y in zip(a, b)
    )
    out_bytes = sum(p.stat().st_size for p in a)
    print(f"rerun byte-identical: {identical} ({len(a)} files, {out_bytes / 2**20:.0f} MiB)", flush=True)
    same, compared, t_cmp = None, 0, 0.0
    if not args.no_compare:
        t0 = time.perf_counter()
        train_cfg = load_config(cfg)
        tables = list(train_cfg.model.tables)
        data = yaml.safe_load((folder / "out_a" / "data.yaml").read_text())["data"]
        raw = build_source(train_cfg.data, tables, 8192, 0, 0, 1)
        pre = build_source(build(DataConfig, data, "data", Source("data.yaml")), tables, 8192, 0, 0, 1)
        same = raw.steps_per_epoch == pre.steps_per_epoch
        pairs = itertools.chain(
            itertools.islice(zip(raw.train_batches(), pre.train_batches()), raw.steps_per_epoch),
            zip(raw.eval_batches(), pre.eval_batches()),
        )
        for x, y in pairs:
            same = same and bool((x.sparse.values() == y.sparse.values()).all()) and bool((x.dense == y.dense).all())
            same = same and bool((x.labels == y.labels).all())
            compared += x.size
        t_cmp = time.perf_counter() - t0
        print(f"loader on the raw TSV (hashing) == loader on the Parquet (identity): {same} ({compared} rows)")
    print(f"\nsummary ({os.cpu_count()} CPUs)")
    print("| step | result |\n| --- | --- |")
    print(f"| TSV | {size / 2**30:.2f} GiB, {rows} rows |")
    for w, t in timings.values():
        print(f"| preprocess, {w} workers | {t:.1f} s, {size / 2**20 / t:.0f} MiB/s, {rows / t / 1e6:.2f} M rows/s |")
    print(f"| output | {len(a)} Parquet files, {out_bytes / 2**20:.0f} MiB |")
    print(f"| rerun byte-identical | {identical} |")
    if same is not None:
        print(f"| same ids and values as on-the-fly hashing | {same} ({compared} rows, {t_cmp:.0f} s) |")


if __name__ == "__main__":
    main()
