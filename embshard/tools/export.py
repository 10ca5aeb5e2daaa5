"""`embshard export serving CHECKPOINT --out DIR [--dtype fp16|int8|int4|fp32|auto] [--device cpu|cuda]
[--memory-gib N]`: a training checkpoint as a self-contained serving artifact (embshard/serving, docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embshard.checkpoint.files import escape
from embshard.spec.tables import ConfigError


def main(argv: list[str] | None = None) -> None:
    from embshard.serving.quantize import DTYPES

    ap = argparse.ArgumentParser(prog="embshard export", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("serving", help="quantized tables, dense weights, model description and checksums")
    p.add_argument("checkpoint", help="checkpoint folder (step_<N>), or a folder of them (the latest complete one)")
    p.add_argument("--out", required=True, help="artifact folder")
    p.add_argument("--dtype", choices=[*DTYPES, "auto"], default="fp16", help="table type (auto: under --memory-gib)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the device the artifact is served on")
    p.add_argument("--memory-gib", type=float, default=None, help="--dtype auto: the tables' budget (GiB)")
    p.add_argument("--config", default=None, help="the run's YAML config, for a checkpoint saved without one")
    args = ap.parse_args(argv)
    try:
        from embshard.serving.export import export_serving
        from embshard.tools.checkpoint import resolve

        path = resolve(args.checkpoint)
        model = export_serving(path, Path(args.out), args.dtype, args.device, args.memory_gib, args.config,
                               say=lambda s: print(escape(s)))  # fmt: skip
        total = sum(t["bytes"] for t in model["tables"])
        print(f"serving artifact {args.out}: {len(model['tables'])} tables, {total / (1 << 20):.2f} MiB of tables, "
              f"from {escape(str(path))} (step {model['source']['step']})")  # fmt: skip
    except ConfigError as e:
        print(f"error: {escape(str(e))}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
