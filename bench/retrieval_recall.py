"""Recall@K of the two-tower model on the synthetic 1M-item catalog, trained the same number of steps with the full
softmax, global in-batch negatives and the sampled softmax (configs/two_tower_synthetic_1m.yaml).

    python -m bench.retrieval_recall                 # 2 GPUs (embshard train --nproc 2), about 2-3 minutes
    python -m bench.retrieval_recall --steps 100 --items 200000
    python -m bench.retrieval_recall --cpu           # 2 CPU processes, a 20,000-item catalog: checks the script

Each run is `embshard train configs/two_tower_synthetic_1m.yaml --nproc 2` with the loss overridden (in_batch gets
global_negatives: true, the strongest in-batch variant) and the same data, steps, optimizers and seed; the held-out
metrics (recall@K over the whole catalog, 2 held-out batches per rank) come from its metrics file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/two_tower_synthetic_1m.yaml"
LOSSES = {
    "full_softmax": ["model.two_tower.loss=full_softmax"],
    "in_batch (global)": ["model.two_tower.loss=in_batch", "model.two_tower.in_batch.global_negatives=true"],
    "sampled_softmax": ["model.two_tower.loss=sampled_softmax", "model.two_tower.sampled_softmax.num_negatives=8192"],
}
CPU = [
    "model.tables[0].num_embeddings=2000",
    "model.tables[1].num_embeddings=20000",
    "data.synthetic.affinity.clusters=100",
    "schedule.batch_size=64",
]


def run(label: str, overrides: list[str], folder: str, cpu: bool) -> tuple[dict, float]:
    metrics = os.path.join(folder, f"{label.split()[0]}.jsonl")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "embshard.cli", "train", CONFIG, "--nproc", "2", *overrides]
    cmd += [f"logging.metrics_file={metrics}", "logging.tensorboard_dir=null", "checkpoint.dir=null"]
    cmd += ["logging.progress_bar=false"]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{label} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    lines = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    return lines[-1], time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--items", type=int, default=1_000_000, help="catalog rows (a multiple of 1000, the groups)")
    ap.add_argument("--batch", type=int, default=8192, help="per GPU")
    ap.add_argument("--cpu", action="store_true", help="2 CPU processes, 20,000 items, batch 64, 40 steps")
    args = ap.parse_args()
    common = [f"schedule.steps={args.steps}", "schedule.eval_every=0", "schedule.eval_at_start=false"]
    if args.cpu:
        common = ["schedule.steps=40", "schedule.eval_every=0", "schedule.eval_at_start=false", *CPU]
    else:
        common += [f"model.tables[1].num_embeddings={args.items}", f"schedule.batch_size={args.batch}"]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, overrides in LOSSES.items():
            if args.cpu:  # 128 queries a step: fewer negatives than on the GPUs
                overrides = [o.replace("num_negatives=8192", "num_negatives=512") for o in overrides]
            m, seconds = run(label, common + overrides, folder, args.cpu)
            rows.append((label, m, seconds))
            print(f"{label}: {m}", flush=True)
    print()
    print(
        f"# bench/retrieval_recall.py {'--cpu ' if args.cpu else ''}({datetime.datetime.now():%Y-%m-%d %H:%M}): "
        f"{CONFIG} with {' '.join(common)}"
    )
    print("held-out loss: the model's own loss (in_batch: over the batch; full and sampled softmax: full softmax)")
    print("| loss | steps | held-out loss | recall@10 | recall@100 | wall s (incl. start-up) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, m, seconds in rows:
        print(
            f"| {label} | {m['step']} | {m['loss']:.4f} | {m['recall@10']:.4f} | {m['recall@100']:.4f} | {seconds:.0f} |"
        )
    full, in_batch = rows[0][1]["recall@10"], rows[1][1]["recall@10"]
    print(
        f"full softmax recall@10 {full:.4f} vs in-batch {in_batch:.4f}: {'higher' if full > in_batch else 'NOT higher'}"
    )


if __name__ == "__main__":
    main()
