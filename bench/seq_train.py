"""Training throughput and quality of the sequential recommender (model kind hstu) on the synthetic Markov-chain
histories (configs/sequential_synthetic.yaml): sequences/s and item ids/s of the training step, and held-out HR@10
and NDCG@10 against the popularity baseline at the end.

    python -m bench.seq_train --out DIR                  # every visible GPU (embshard train --nproc N), ~2 minutes
    python -m bench.seq_train --out DIR --items 1000000 --batch 2048 --max-length 200
    python -m bench.seq_train --out DIR --cpu            # 2 CPU processes, the config's own small size
    python -m bench.seq_train --out DIR --side           # configs/sequential_side.yaml: a per-position category
    python -m bench.seq_train --out DIR --cpu --visit-gap 3600 [--time-bias]   # visits in time; the time bias

One `embshard train` run with the sizes overridden; the rate is the training loop's samples/s (samples are user
sequences) of its last log line, measured from the first step (so it includes the warm-up); ids/s is that times the
mean items per sequence ((min_length + max_length + 1) / 2, the synthetic lengths being uniform). Prints RESULT
lines and PASS/FAIL: the run finished, the training loss fell, and HR@10 beats the popularity baseline's by at
least 0.2. Writes DIR/seq_train.md (the command, device, date, numbers) and DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/sequential_synthetic.yaml"
SIDE_CONFIG = "configs/sequential_side.yaml"  # its tables[2] (the categories) has the catalog's width


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for seq_train.md and the metrics file")
    p.add_argument("--cpu", action="store_true", help="2 CPU processes at the config's own size")
    p.add_argument(
        "--side", action="store_true", help="configs/sequential_side.yaml: item categories through the sequence tables"
    )
    p.add_argument("--nproc", type=int, default=None, help="processes (default: every visible GPU; --cpu: 2)")
    p.add_argument("--items", type=int, default=100_000, help="catalog rows")
    p.add_argument("--dim", type=int, default=64, help="model width (the catalog's embedding_dim)")
    p.add_argument("--batch", type=int, default=1024, help="sequences per rank and step")
    p.add_argument("--max-length", type=int, default=50, help="items of history per sequence at most")
    p.add_argument("--layers", type=int, default=2, help="HSTU layers")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 300; --cpu: 200)")
    p.add_argument("--margin", type=float, default=0.2, help="PASS: HR@10 at least this above popularity's")
    p.add_argument(
        "--visit-gap",
        type=float,
        default=None,
        help="data.sequences.visit_gap: seconds after which the synthetic chain starts a new visit afresh",
    )
    p.add_argument("--time-bias", action="store_true", help="model.sequential.time_bias: true")
    p.add_argument("--eval-batches", type=int, default=None, help="data.sequences.eval_batches (held-out batches)")
    p.add_argument("--attention", choices=["jagged", "padded"], default=None, help="model.sequential.attention")
    args = p.parse_args(argv)
    args.steps = args.steps or (200 if args.cpu else 300)
    args.config = SIDE_CONFIG if args.side else CONFIG
    return args


def overrides(args: argparse.Namespace, metrics: str) -> list[str]:
    common = [
        f"schedule.steps={args.steps}",
        f"schedule.eval_every={args.steps}",
        "schedule.eval_at_start=false",
        f"logging.log_every={max(1, args.steps // 5)}",
        f"logging.metrics_file={metrics}",
        "logging.progress_bar=false",
    ]
    if args.visit_gap is not None:
        common.append(f"data.sequences.visit_gap={args.visit_gap}")
    if args.time_bias:
        common.append("model.sequential.time_bias=true")
    if args.eval_batches:
        common.append(f"data.sequences.eval_batches={args.eval_batches}")
    if args.attention:
        common.append(f"model.sequential.attention={args.attention}")
    if args.cpu:
        return common
    return [
        *common,
        f"model.tables[0].num_embeddings={args.items}",
        f"model.tables[0].embedding_dim={args.dim}",
        *(
            [f"model.tables[2].embedding_dim={args.dim}", f"model.tables[2].max_length={args.max_length + 1}"]
            * args.side
        ),
        f"model.sequential.max_length={args.max_length}",
        f"model.sequential.num_layers={args.layers}",
        f"data.sequences.max_length={args.max_length}",
        f"schedule.batch_size={args.batch}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = str(out / "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            print("FAIL seq_train: no CUDA GPU visible (use --cpu for a CPU run)")
            return 1
        device = torch.cuda.get_device_name(0)
    nproc = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    cmd = [sys.executable, "-m", "embshard.cli", "train", args.config, "--nproc", str(nproc), *overrides(args, metrics)]
    print("command:", shlex.join(cmd), flush=True)
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if res.returncode:
        print(res.stdout[-4000:], res.stderr[-4000:])
        print(f"FAIL seq_train: embshard train exited with {res.returncode}")
        return 1
    train = re.findall(r"train step +(\d+)  loss (\S+)  ([\d,]+) samples/s", res.stdout)
    evals = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    final = evals[-1]
    seqs_per_s = float(train[-1][2].replace(",", ""))
    from embshard.config import load_config

    cfg = load_config(ROOT / args.config, overrides(args, metrics))
    sq = cfg.data.sequences
    mean_items = (sq.min_length + sq.max_length + 1) / 2
    lines = [
        f"RESULT seq_train sequences_per_s {seqs_per_s:.0f}",
        f"RESULT seq_train ids_per_s {seqs_per_s * mean_items:.0f}",
        f"RESULT seq_train hr@10 {final['hr@10']:.4f} pop_hr@10 {final['pop_hr@10']:.4f}",
        f"RESULT seq_train ndcg@10 {final['ndcg@10']:.4f} pop_ndcg@10 {final['pop_ndcg@10']:.4f}",
        f"RESULT seq_train held_out_loss {final['loss']:.4f} wall_s {wall:.1f}",
    ]
    first, last = float(train[0][1]), float(train[-1][1])
    checks = {
        "training loss falls": last < first,
        f"HR@10 beats popularity by {args.margin}": final["hr@10"] >= final["pop_hr@10"] + args.margin,
    }
    for name, ok in checks.items():
        lines.append(f"{'PASS' if ok else 'FAIL'} seq_train: {name}")
    print("\n".join(lines))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = [
        f"# seq_train ({stamp}, {nproc} x {device})",
        "",
        "```",
        shlex.join(cmd),
        "```",
        "",
        f"- catalog {cfg.model.tables[0].num_embeddings:,} items x {cfg.model.tables[0].embedding_dim}, batch "
        f"{cfg.schedule.batch_size} sequences per rank, {mean_items:.1f} items per sequence on average, "
        f"{cfg.schedule.steps} steps",
        *[f"- {line}" for line in lines],
    ]
    (out / "seq_train.md").write_text("\n".join(report) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
