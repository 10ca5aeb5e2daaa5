"""`embshard serve DIR --port P`: a Predictor behind JSON over HTTP (the standard library's `http.server`), with
micro-batching: requests that arrive together are scored as one batch.

    POST /predict  {"dense": [[0.1, ...], ...],                  one row of num_dense floats per sample
                    "sparse": {"user": [[3], ...], "history": [[1, 5, 9], ...], ...},   per feature, ids per sample
                    "weights": {"query": [[0.5, 1.0], ...]}}     weighted features only (default 1.0 per id)
                -> {"scores": [0.73, ...]}
    GET /health -> {"ok": true, "features": [...], "num_dense": N, "tables": {name: type}}

Each request's handler thread puts its samples on a queue; one scoring thread takes what is queued (up to
`max_batch` samples, waiting at most `max_wait_ms` for more after the first), scores it in one call and hands each
request its rows. A malformed request gets status 400 and {"error": ...} naming the field; a failed scoring 500.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from embshard.data.common import Batch
from embshard.spec.tables import ConfigError

MAX_BODY = 64 << 20


def batch_from_json(obj: Any, features: list[str], weighted: set[str], num_dense: int) -> Batch:
    """A Batch of one request body (see the module docstring); ConfigError naming what is wrong."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(obj, dict):
        raise ConfigError("the body must be a JSON object with 'dense' and 'sparse'")
    dense = obj.get("dense")
    if not isinstance(dense, list) or not dense or not all(isinstance(r, list) and len(r) == num_dense for r in dense):
        raise ConfigError(f"'dense': give a non-empty list of rows of {num_dense} numbers, one per sample")
    B = len(dense)
    sparse, weights = obj.get("sparse"), obj.get("weights") or {}
    if not isinstance(sparse, dict) or not isinstance(weights, dict):
        raise ConfigError("'sparse' (and 'weights'): give an object of feature -> list of id lists, one per sample")
    missing = [f for f in features if f not in sparse]
    unknown = sorted(set(sparse) - set(features))
    if missing or unknown:
        raise ConfigError(
            f"'sparse': missing features {missing}, unknown features {unknown}; the model reads {features}"
        )
    lengths, values, wts = [], [], []
    for f in features:
        bags = sparse[f]
        if not isinstance(bags, list) or len(bags) != B or not all(isinstance(b, list) for b in bags):
            raise ConfigError(f"'sparse.{f}': give {B} lists of ids (one per sample, as many as 'dense' has rows)")
        w = weights.get(f)
        if w is not None and (f not in weighted or not isinstance(w, list) or len(w) != B):
            raise ConfigError(f"'weights.{f}': only weighted features take weights, one list per sample")
        for i, bag in enumerate(bags):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in bag):
                raise ConfigError(f"'sparse.{f}'[{i}]: ids are integers")
            lengths.append(len(bag))
            values.extend(bag)
            if f in weighted:
                bw = w[i] if w is not None else [1.0] * len(bag)
                if not isinstance(bw, list) or len(bw) != len(bag):
                    raise ConfigError(f"'weights.{f}'[{i}]: one weight per id of 'sparse.{f}'[{i}]")
                wts.extend(float(x) for x in bw)
            elif weighted:
                wts.extend([1.0] * len(bag))
    try:
        dense_BN = torch.tensor(dense, dtype=torch.float32)
    except (TypeError, ValueError):
        raise ConfigError("'dense': every value must be a number") from None
    kjt = KeyedJaggedTensor(
        keys=features, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.tensor(wts, dtype=torch.float32) if weighted else None, stride=B,
    )  # fmt: skip
    return Batch(dense_BN, kjt, torch.zeros(B))


def concat(batches: list[Batch], features: list[str]) -> Batch:
    """One Batch of several (the same features, in order), for one scoring call."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if len(batches) == 1:
        return batches[0]
    F = len(features)
    lengths = torch.cat([b.sparse.lengths().view(F, -1) for b in batches], dim=1)
    per = [torch.split(b.sparse.values(), b.sparse.length_per_key()) for b in batches]
    values = torch.cat([v for f in range(F) for v in (p[f] for p in per)])
    weights = None
    if batches[0].sparse.weights_or_none() is not None:
        pw = [torch.split(b.sparse.weights(), b.sparse.length_per_key()) for b in batches]
        weights = torch.cat([w for f in range(F) for w in (p[f] for p in pw)])
    kjt = KeyedJaggedTensor(features, values, weights, lengths=lengths.flatten(), stride=lengths.shape[1])
    return Batch(torch.cat([b.dense for b in batches]), kjt, torch.cat([b.labels for b in batches]))


class _Job:
    def __init__(self, batch: Batch) -> None:
        self.batch, self.done = batch, threading.Event()
        self.scores: list[float] | None = None
        self.error: str | None = None
        self.status = 200


class Server:
    """The HTTP server of a Predictor (`serve_forever` / `shutdown`); `port` is the bound port (0 picks one)."""

    def __init__(self, predictor: Any, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 4096,
                 max_wait_ms: float = 2.0) -> None:  # fmt: skip
        self.predictor, self.max_batch, self.max_wait = predictor, max_batch, max_wait_ms / 1000.0
        self.features = list(predictor.features)
        self.weighted = {f for f in self.features if predictor.table_of[f].weighted}
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.batches_scored = 0
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.port = self.httpd.server_address[1]
        self.worker = threading.Thread(target=self._score_loop, name="embshard-serve-scoring", daemon=True)
        self.worker.start()

    def _score_loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            group, n = [job], job.batch.size
            while n < self.max_batch:
                try:
                    more = self.jobs.get(timeout=self.max_wait)
                except queue.Empty:
                    break
                if more is None:
                    self.jobs.put(None)
                    break
                group.append(more)
                n += more.batch.size
            try:
                scores = self.predictor(concat([j.batch for j in group], self.features)).cpu().tolist()
                self.batches_scored += 1
                at = 0
                for j in group:
                    j.scores = scores[at : at + j.batch.size]
                    at += j.batch.size
            except Exception as e:  # noqa: BLE001  (the requests get the message; the server goes on)
                for j in group:  # ValueError: the ids (bounds check error), else the server's
                    j.error, j.status = f"{type(e).__name__}: {e}", 400 if isinstance(e, ValueError) else 500
            for j in group:
                j.done.set()

    def _handler(self) -> type:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # no line per request
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/health":
                    return self._reply(404, {"error": "GET /health or POST /predict"})
                p = server.predictor
                tables = {t["name"]: t["dtype"] for t in p.info["tables"]}
                self._reply(200, {"ok": True, "features": server.features, "num_dense": p.num_dense, "tables": tables,
                                  "scoring": p.describe()})  # fmt: skip

            def do_POST(self) -> None:
                if self.path != "/predict":
                    return self._reply(404, {"error": "POST /predict"})
                n = int(self.headers.get("Content-Length") or 0)
                if n <= 0 or n > MAX_BODY:
                    return self._reply(400, {"error": f"a JSON body of 1 to {MAX_BODY} bytes"})
                try:
                    obj = json.loads(self.rfile.read(n))
                    batch = batch_from_json(obj, server.features, server.weighted, server.predictor.num_dense)
                except ValueError as e:  # ConfigError is a ValueError, as is bad JSON
                    return self._reply(400, {"error": str(e)})
                job = _Job(batch)
                server.jobs.put(job)
                job.done.wait()
                if job.error is not None:
                    return self._reply(job.status, {"error": job.error})
                self._reply(200, {"scores": job.scores})

        return Handler

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.jobs.put(None)
        self.worker.join()
