"""Held-out AUC of raw-id tables (ids: raw, with eviction) against `hash mod rows` at the same memory.

Memory: a hashed table of R rows keeps R x (row + optimizer state) bytes; a raw-id table keeps, per row, the same
plus its id -> row map (`rawids.map_bytes_per_row`), so at equal bytes it gets fewer rows:
    R_raw = R x row_bytes / (row_bytes + map_bytes_per_row)      (row_bytes = dim x 4 + 4, row-wise Adagrad)

1. Zipf stream (in this process, one rank on the CPU): F features, each id drawn Zipf(1.05) from a vocabulary of
   10 x R distinct 64-bit ids (so 10x more distinct ids than the hashed table's rows); the label is
   Bernoulli(sigmoid(sum_f score_f(id))) with a fixed hidden score per id (N(0, 1.5^2)), so a model must learn
   each id's score. Model: pooled embeddings -> linear -> logit (row-wise Adagrad for the tables, Adam for the
   linear layer). Every step draws fresh samples (a stream: new ids keep coming); the held-out AUC is measured
   on fresh samples after training. Variants: hash (embshard-hash of the id mod R), raw lru, raw lfu, raw lru
   with admit_min_count 2, all at the hashed table's memory; and, for perspective, raw lru / lfu with R rows (the
   hashed table's rows, not its memory).
2. Criteo sample (data/criteo_sample.txt, 200 rows; 160 train, 40 held out): `embshard train` of
   configs/dlrm_criteo.yaml (26 tables) with every table at R rows hashed (`categorical: hash`) against raw ids
   (`categorical: raw`, ids: raw) at R_raw rows, several seeds. 40 held-out rows make its AUC noisy: read the
   Zipf stream for the comparison, this as an end-to-end check on real categorical data.

    python -m bench.raw_ids_quality                       # both, the numbers of docs/raw_ids.md (CPU, minutes)
    python -m bench.raw_ids_quality --part zipf --rows 2000 --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def raw_rows(rows: int, dim: int, eviction: str = "lru", min_count: int = 1) -> int:
    """Rows of a raw-id table that keeps the bytes of a `rows`-row hashed table (row-wise Adagrad state)."""
    from embshard.rawids import map_bytes_per_row

    row = dim * 4 + 4
    r = rows
    for _ in range(5):  # map bytes per row depend slightly on the rows
        r = int(rows * row / (row + map_bytes_per_row(r, eviction, min_count)))
    return max(r, 2)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic; ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    s = scores[order]
    i = 0
    while i < len(s):  # average the ranks of ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        if j > i:
            ranks[order[i : j + 1]] = (i + j + 2) / 2
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


# ---- 1. Zipf stream -------------------------------------------------------------------------------------------
class ZipfStream:
    """F features of Zipf ids over `vocab` distinct random 64-bit ids each; hidden per-id scores."""

    def __init__(self, features: int, vocab: int, exponent: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.F, self.vocab, self.a = features, vocab, exponent
        self.ids = [rng.integers(-(2**62), 2**62, vocab) for _ in range(features)]
        self.score = [rng.normal(0, 1.5, vocab) for _ in range(features)]

    def draw(self, rng: np.random.Generator, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(per feature the ids of n samples, labels)."""
        from embshard.data.synthetic import zipf_ranks

        ids, z = [], np.zeros(n)
        for f in range(self.F):
            k = zipf_ranks(rng, n, self.vocab, self.a)
            ids.append(self.ids[f][k])
            z += self.score[f][k]
        labels = (rng.random(n) < 1 / (1 + np.exp(-z / np.sqrt(self.F)))).astype(np.float32)
        return ids, labels


def zipf_run(variant: str, args, seed: int) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard import FusedOptimizerConfig, TableConfig, simple_plan
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.rawids.hashing import hash64

    torch.manual_seed(seed)
    stream = ZipfStream(args.features, args.rows * args.vocab_factor, args.zipf, seed)
    raw = variant != "hash"
    eviction = "lfu" if variant.startswith("raw lfu") else "lru"
    min_count = 2 if variant == "raw lru min2" else 1
    same_rows = variant.endswith("same rows")  # for perspective: the raw table without paying for its map
    rows = raw_rows(args.rows, args.dim, eviction, min_count) if raw and not same_rows else args.rows
    extra = {"ids": "raw", "eviction": eviction, "admit_min_count": min_count} if raw else {}
    tables = [TableConfig(f"t{f}", rows, args.dim, (f"f{f}",), **extra) for f in range(args.features)]
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=args.lr)
    ebc = ShardedEmbeddingBagCollection(tables, simple_plan(tables, 1), opt, device="cpu", seed=seed)
    head = torch.nn.Linear(args.features * args.dim, 1)
    dense_opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    keys = [f"f{f}" for f in range(args.features)]
    B = args.batch

    def kjt(ids: list[np.ndarray]) -> KeyedJaggedTensor:
        values = torch.from_numpy(np.concatenate(ids))
        if not raw:
            values = torch.remainder(hash64(values, 0x51ED27), rows)  # hash mod rows
        return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(len(values), dtype=torch.int32))

    rng = np.random.default_rng([seed, 1])
    t0 = time.time()
    for _ in range(args.steps):
        ids, labels = stream.draw(rng, B)
        logit = head(ebc(kjt(ids)).values()).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, torch.from_numpy(labels))
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
    train_s = time.time() - t0
    rng = np.random.default_rng([seed, 2])
    scores, all_labels = [], []
    with torch.no_grad():
        for _ in range(args.eval_batches):
            ids, labels = stream.draw(rng, B)
            scores.append(head(ebc(kjt(ids)).values()).squeeze(1).numpy())
            all_labels.append(labels)
    out = {
        "variant": variant,
        "rows": rows,
        "seed": seed,
        "auc": auc(np.concatenate(scores), np.concatenate(all_labels)),
    }
    if raw:
        st = ebc.raw_id_stats()
        out.update({k: sum(s[k] for s in st.values()) for k in ("admitted", "evicted", "resident")})
    out["train_s"] = round(train_s, 1)
    return out


def zipf_part(args) -> list[dict]:
    results = []
    variants = ["hash", "raw lru", "raw lfu", "raw lru min2", "raw lru same rows", "raw lfu same rows"]
    for seed in range(args.seeds):
        for v in variants:
            r = zipf_run(v, args, seed)
            print(json.dumps(r), flush=True)
            results.append(r)
    print(f"\nZipf stream: {args.features} features, {args.rows} hashed rows of {args.dim} (same memory: raw rows "
          f"as listed), vocabulary {args.vocab_factor}x rows per feature, Zipf {args.zipf}, {args.steps} steps of "
          f"{args.batch}, {args.seeds} seeds")  # fmt: skip
    for v in variants:
        a = [r["auc"] for r in results if r["variant"] == v]
        rows = next(r["rows"] for r in results if r["variant"] == v)
        print(f"  {v:18s} rows {rows:6d}  held-out AUC {np.mean(a):.4f} +- {np.std(a):.4f}")
    return results


# ---- 2. Criteo sample -----------------------------------------------------------------------------------------
def criteo_run(raw: bool, rows: int, seed: int, tmp: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "configs/dlrm_criteo.yaml").read_text())
    dim = cfg["model"]["tables"][0]["embedding_dim"]
    n = raw_rows(rows, dim) if raw else rows
    for t in cfg["model"]["tables"]:
        t["num_embeddings"] = n
        if raw:
            t["ids"] = "raw"
    cfg["data"]["criteo"]["path"] = str(ROOT / "data/criteo_sample.txt")
    cfg["data"]["criteo"]["categorical"] = "raw" if raw else "hash"
    metrics = tmp / f"m_{raw}_{rows}_{seed}.jsonl"
    cfg["logging"] = {"tensorboard_dir": None, "progress_bar": False, "metrics_file": str(metrics), "log_every": 100}
    cfg["checkpoint"] = {"dir": None}
    cfg["schedule"]["eval_every"] = 0
    cfg["seed"] = seed
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "embshard.cli", "train", str(path)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
    last = json.loads(metrics.read_text().strip().splitlines()[-1])
    return {"variant": "raw lru" if raw else "hash", "rows": n, "seed": seed, "auc": last["auc"], "loss": last["loss"]}


def criteo_part(args) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.criteo_rows:
            for seed in range(args.seeds):
                for raw in (False, True):
                    r = criteo_run(raw, rows, seed, Path(tmp))
                    print(json.dumps(r), flush=True)
                    results.append({**r, "hash_rows": rows})
    print(f"\nCriteo sample (160 train, 40 held-out rows), 26 tables of 16, {args.seeds} seeds:")
    for rows in args.criteo_rows:
        for v in ("hash", "raw lru"):
            sel = [r for r in results if r["hash_rows"] == rows and r["variant"] == v]
            a = [r["auc"] for r in sel]
            print(f"  memory of {rows:5d} hashed rows: {v:8s} rows {sel[0]['rows']:5d}  held-out AUC "
                  f"{np.mean(a):.4f} +- {np.std(a):.4f}  loss {np.mean([r['loss'] for r in sel]):.4f}")  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "zipf", "criteo"), default="all")
    ap.add_argument("--rows", type=int, default=2000, help="Zipf: rows of the hashed tables")
    ap.add_argument("--dim", type=int, default=32, help="Zipf: embedding width")
    ap.add_argument("--features", type=int, default=4)
    ap.add_argument("--vocab-factor", type=int, default=10, help="Zipf: distinct ids per feature / hashed rows")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--eval-batches", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--criteo-rows", type=int, nargs="+", default=[32, 128, 1000], help="hashed rows per table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part in ("all", "zipf"):
        zipf_part(args)
    if args.part in ("all", "criteo"):
        criteo_part(args)


if __name__ == "__main__":
    main()
