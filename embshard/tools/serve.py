"""`embshard serve DIR --port P`: score JSON requests over HTTP with a serving artifact (embshard/serving/http.py,
docs/serving.md)."""

from __future__ import annotations

import argparse
import sys

from embshard.checkpoint.files import escape
from embshard.spec.tables import ConfigError
from embshard.tools.predict import add_gpu_options, load_predictor


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard serve", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="serving artifact folder (embshard export serving)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the scores are computed")
    ap.add_argument(
        "--shard-over", default=None, help="comma-separated devices to spread the tables over (cuda:0,cuda:1)"
    )
    ap.add_argument(
        "--row-wise-gib", type=float, default=None, help="with --shard-over: split tables over N GiB by rows"
    )
    ap.add_argument("--max-batch", type=int, default=4096, help="most samples scored in one call")
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="wait for more requests after the first (ms)")
    ap.add_argument("--bounds-check", choices=["error", "drop"], default=None)
    add_gpu_options(ap)
    args = ap.parse_args(argv)
    try:
        from embshard.serving.http import Server

        server = Server(load_predictor(args), args.host, args.port, args.max_batch, args.max_wait_ms)
    except (ConfigError, OSError) as e:
        print(f"error: {escape(str(e))}", file=sys.stderr)
        sys.exit(2)
    print(f"serving {escape(args.dir)} on http://{args.host}:{server.port} (POST /predict, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
