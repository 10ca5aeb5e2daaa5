"""`embshard predict DIR DATA --out scores.parquet`: score data with a serving artifact (embshard/serving,
docs/serving.md): DATA is data files read with the training run's data config, or a YAML with a `data:` section."""

from __future__ import annotations

import argparse
import sys

from embshard.checkpoint.files import escape
from embshard.spec.tables import ConfigError


def shards(text: str | None) -> list[str] | None:
    """The devices of --shard-over (None: one device)."""
    return [d for d in text.split(",") if d] if text else None


def add_gpu_options(ap: argparse.ArgumentParser) -> None:
    """--no-cuda-graphs and --dense-dtype (docs/serving.md, "On a GPU")."""
    ap.add_argument("--no-cuda-graphs", action="store_true", help="on CUDA, score eagerly (no CUDA graphs)")
    ap.add_argument("--dense-dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="type of the dense part and the pooled embeddings (scores stay fp32)")  # fmt: skip


def load_predictor(args: argparse.Namespace) -> object:
    """The Predictor of the parsed arguments (dir, device, bounds, shards, the GPU options)."""
    from embshard.serving.predictor import load

    return load(args.dir, args.device, args.bounds_check, shards(args.shard_over), args.row_wise_gib,
                cuda_graphs=False if args.no_cuda_graphs else None, dense_dtype=args.dense_dtype)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard predict", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="serving artifact folder (embshard export serving)")
    ap.add_argument("data", help="Parquet/CSV/TSV files (path or glob), or a YAML file with a data: section")
    ap.add_argument("--out", required=True, help="output Parquet file: row, score, label")
    ap.add_argument("--split", choices=["all", "held_out"], default="all", help="every row, or the held-out rows")
    ap.add_argument("--batch-size", type=int, default=4096, help="samples scored at once")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the scores are computed")
    ap.add_argument(
        "--shard-over", default=None, help="comma-separated devices to spread the tables over (cuda:0,cuda:1)"
    )
    ap.add_argument(
        "--row-wise-gib", type=float, default=None, help="with --shard-over: split tables over N GiB by rows"
    )
    ap.add_argument("--bounds-check", choices=["error", "drop"], default=None,
                    help="ids outside their table (default: the training run's lookup.bounds_check)")  # fmt: skip
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_gpu_options(ap)
    args = ap.parse_args(argv)
    try:
        from embshard.serving.batch_scoring import data_config, score, source_batches

        predictor = load_predictor(args)
        cfg, files = data_config(args.data, predictor.info.get("data"))
        batches = source_batches(cfg, files, predictor.tables, args.batch_size, args.split)
        done = score(predictor, batches, args.out, progress=not args.no_progress)
        auc = f", AUC {done.auc:.4f}" if done.auc is not None else ""
        print(f"scored {done.rows} samples in {done.seconds:.2f} s ({done.samples_per_s:,.0f} samples/s){auc} "
              f"-> {escape(done.path)}")  # fmt: skip
    except ConfigError as e:
        print(f"error: {escape(str(e))}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
