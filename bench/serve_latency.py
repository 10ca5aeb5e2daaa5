"""Serving latency and throughput: embshard's Predictor (FBGEMM's inference TBE) against TorchRec's quantized
EmbeddingBagCollection (`torchrec.inference.modules.quantize_embeddings`), same table type, same weights, same dense
model (DLRM), on the CPU or a CUDA GPU.

    python -m bench.serve_latency --out DIR [--device cpu|cuda] [--dtype int8] [--tables 26] [--rows 20000]
        [--dim 64] [--ids 4] [--reps 30] [--compile-dense default|max-autotune-no-cudagraphs]

On CUDA it also checks the GPU's scores against the CPU's; the CUDA-graph path (the default on CUDA) against the
eager one (`cuda_graphs=False`) at several batch sizes, padded ones included, with the ids on the GPU and on the
host; that a call with host ids makes no host sync and one with GPU ids one (the read of the graph's id check)
(`torch.cuda.set_sync_debug_mode`); with 2 or more GPUs the tables spread over all of them (`shard_over`, the
biggest split by rows) against one GPU. It times the eager path, the dense part in fp16 (`dense_dtype="fp16"`)
and the spread tables as extra sides; with --compile-dense, the dense part under torch.compile too (its scores
checked against the eager dense part's first).

A random-initialised DLRM is saved as a checkpoint and exported (fp32 and --dtype); TorchRec's float collection gets
the fp32 rows and is quantized to the same type. First a check: both give the same scores on the same batches
(PASS/FAIL). Then per batch size 1, 64, 512 the p50 / p99 latency of one scoring call (ids in, scores out, on the
device), and at 8192 the throughput, the two sides interleaved A B A B on the same fresh random batches. RESULT
lines and DIR/serve_latency.json."""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

TORCH_DTYPE = {"fp32": torch.float, "fp16": torch.half, "int8": torch.qint8, "int4": torch.quint4x2}


@dataclass(frozen=True)
class _Run:
    model: object


def make_artifacts(out: Path, args: argparse.Namespace):
    from embshard import FusedOptimizerConfig, TableConfig, simple_plan
    from embshard.checkpoint import Checkpointer, TrainState
    from embshard.config import DLRMConfig, ModelConfig
    from embshard.models.build import RecModel
    from embshard.serving import export_serving

    tables = tuple(
        TableConfig(f"t{i}", args.rows, args.dim, (f"f{i}",), ids_per_bag=float(args.ids)) for i in range(args.tables)
    )
    cfg = ModelConfig("dlrm", tables, DLRMConfig(bottom_mlp=(128,), top_mlp=(256, 128)))
    model = RecModel(cfg, 13, simple_plan(list(tables), 1, 1), FusedOptimizerConfig("sgd", lr=0.1),
                     torch.device("cpu"), 1)  # fmt: skip
    ckpt = Checkpointer(TrainState.of_model(model, None), str(out / "ck"), async_save=False, config=_Run(cfg))
    ckpt.save(1)
    ckpt.close()
    for dtype in sorted({"fp32", args.dtype}):
        export_serving(out / "ck" / "step_1", out / dtype, dtype, say=lambda _s: None)
    return cfg


def torchrec_model(cfg, fp32_dir: Path, predictor, dtype: str, device: torch.device):
    """(quantized TorchRec EBC, scoring function) with the fp32 rows of the artifact and the predictor's dense."""
    import torchrec
    from torchrec.inference.modules import quantize_embeddings

    from embshard.serving import artifact

    man = artifact.read_manifest(fp32_dir)
    configs = [torchrec.EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                           feature_names=list(t.feature_names)) for t in cfg.tables]  # fmt: skip
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=device)
    with torch.no_grad():
        for t in cfg.tables:
            rows = artifact.read_tensors(fp32_dir, man, artifact.table_file(t.name))["rows"]
            ebc.embedding_bags[t.name].weight.copy_(rows)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = ebc

    q = quantize_embeddings(Holder(), TORCH_DTYPE[dtype], inplace=False, output_dtype=torch.float).ebc
    F, D = len(cfg.tables), cfg.tables[0].embedding_dim

    @torch.inference_mode()
    def score(batch) -> torch.Tensor:
        kjt = batch.sparse.to(device)
        pooled = q(kjt).values().view(-1, F, D)
        return torch.sigmoid(predictor.dense(batch.dense.to(device), pooled))

    return score


def random_batch(cfg, B: int, ids: int, rng: np.random.Generator, device: torch.device):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.data.common import Batch

    F = len(cfg.tables)
    lengths = torch.from_numpy(rng.poisson(ids - 1, F * B) + 1).to(torch.int32)
    values = torch.cat([torch.from_numpy(rng.integers(0, t.num_embeddings, int(n)))
                        for t, n in zip(cfg.tables, lengths.view(F, B).sum(1))])  # fmt: skip
    kjt = KeyedJaggedTensor([f for t in cfg.tables for f in t.feature_names], values, lengths=lengths, stride=B)
    return Batch(torch.randn(B, 13), kjt, torch.zeros(B)).to(device)


def count_syncs(fn, batch) -> list[str]:
    """Where `fn(batch)` makes a synchronizing CUDA operation once warm (torch.cuda.set_sync_debug_mode's warnings,
    each as the Python line that called the operation; not torch's one notice that the mode is a prototype): one call
    first, so a bucket's capture is not counted."""
    fn(batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in seen if "called a synchronizing" in str(w.message)]


def graph_checks(cfg, predictor, eager, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """PASS/FAIL: graphed scores equal eager ones (GPU and host ids, padded batch sizes too); no host sync in a
    call with host ids, one (the id check's read) with GPU ids."""
    print(f"serve_latency embshard scoring: {predictor.describe()}", flush=True)
    gap, sizes = 0.0, (1, 3, 64, 300, 512, 5000, 8192)
    for B in sizes:
        host = random_batch(cfg, B, args.ids, rng, torch.device("cpu"))
        for b in (host, host.to(predictor.device)):
            gap = max(gap, (predictor(b) - eager(b)).abs().max().item())
    ok = gap <= 1e-5 and predictor.graphs is not None and predictor.graphs.last_fallback is None
    print(f"{'PASS' if ok else 'FAIL'} serve_latency graphed vs eager scores: max difference {gap:.2e} at batches "
          f"{list(sizes)} (tolerance 1e-5); {predictor.describe()}", flush=True)  # fmt: skip
    host = random_batch(cfg, 512, args.ids, rng, torch.device("cpu"))
    on_gpu = host.to(predictor.device)
    predictor(host), predictor(on_gpu)  # the buckets captured before counting
    at_host, at_gpu = count_syncs(predictor, host), count_syncs(predictor, on_gpu)
    print(
        f"{'PASS' if not at_host and len(at_gpu) <= 1 else 'FAIL'} serve_latency host syncs in a graphed call: "
        f"{len(at_host)} with host ids (expected 0){' at ' + ', '.join(at_host) if at_host else ''}, {len(at_gpu)} "
        f"with GPU ids (expected at most 1: the id check's count){' at ' + ', '.join(at_gpu) if at_gpu else ''}",
        flush=True,
    )


def _time(fn, batch, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPE), default="int8")
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=4, help="mean ids per bag")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compile-dense", default=None, help="also time the dense part under this torch.compile mode")
    args = ap.parse_args(argv)
    from embshard.serving import load

    out, device = Path(args.out), torch.device(args.device)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_artifacts(out, args)
    predictor = load(out / args.dtype, device)
    torchrec_score = torchrec_model(cfg, out / "fp32", predictor, args.dtype, device)
    sides = {"embshard": predictor, "torchrec": torchrec_score}
    rng = np.random.default_rng(0)
    check = [random_batch(cfg, 256, args.ids, rng, device) for _ in range(3)]
    diff = max((predictor(b) - torchrec_score(b)).abs().max().item() for b in check)
    tol = 1e-4 if args.dtype in ("fp32", "fp16") else 2e-3
    print(f"{'PASS' if diff <= tol else 'FAIL'} serve_latency same scores: max |embshard - torchrec| = {diff:.2e} "
          f"(tolerance {tol:g}), {args.dtype}, {args.device}", flush=True)  # fmt: skip
    results: dict = {"dtype": args.dtype, "device": str(device), "max_score_diff": diff, "latency": {}}
    if device.type == "cuda":  # the GPU's scores against the CPU's; the tables over every GPU of the host
        cpu = load(out / args.dtype, "cpu")
        gap = max((predictor(b).cpu() - cpu(b)).abs().max().item() for b in check)
        print(f"{'PASS' if gap <= 1e-4 else 'FAIL'} serve_latency cuda vs cpu scores: max difference {gap:.2e}")
        eager = load(out / args.dtype, device, cuda_graphs=False)
        graph_checks(cfg, predictor, eager, args, rng)
        sides["embshard_eager"] = eager
        half = load(out / args.dtype, device, dense_dtype="fp16")  # fp16 TBE output and dense part
        gap = max((half(b) - predictor(b)).abs().max().item() for b in check)
        print(f"{'PASS' if gap <= 1e-2 else 'FAIL'} serve_latency fp16 dense part vs fp32: max score difference "
              f"{gap:.2e} (tolerance 1e-2; its AUC: bench/serve_quality.py)", flush=True)  # fmt: skip
        sides["embshard_fp16dense"] = half
    if args.compile_dense:
        start = time.perf_counter()
        compiled = load(out / args.dtype, device, compile_dense=args.compile_dense)
        gap = max((compiled(b) - predictor(b)).abs().max().item() for b in check)
        print(f"{'PASS' if gap <= 1e-4 else 'FAIL'} serve_latency compiled dense part ({args.compile_dense}) vs eager: "
              f"max score difference {gap:.2e} (first calls {time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
        sides["embshard_compiled"] = compiled
        if torch.cuda.device_count() >= 2:
            gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            limit = args.rows * args.dim / (1 << 30)  # under one table's bytes (all of one size): all row-wise
            sharded = load(out / args.dtype, "cuda:0", shard_over=gpus, row_wise_gib=limit)
            gap = max((sharded(b) - predictor(b)).abs().max().item() for b in check)
            split = sorted({b.table for b in sharded.lookup.blocks if b.r1 - b.r0 < args.rows})
            print(f"{'PASS' if gap <= 1e-4 else 'FAIL'} serve_latency tables over {len(gpus)} GPUs ({len(split)} "
                  f"row-wise) vs one: max difference {gap:.2e}", flush=True)  # fmt: skip
            sides["embshard_sharded"] = sharded
    for B in (1, 64, 512, 8192):
        reps = args.reps if B < 8192 else max(5, args.reps // 3)
        times: dict[str, list[float]] = {k: [] for k in sides}
        graphed = [fn for fn in sides.values() if getattr(fn, "graphs", None) is not None]
        for _ in range(8):  # embshard's graphs of this batch size captured (a server does so when it starts)
            warm = random_batch(cfg, B, args.ids, rng, device)
            for fn in graphed:
                fn(warm)
        for i in range(reps + 3):
            batch = random_batch(cfg, B, args.ids, rng, device)
            for name, fn in sides.items():  # A B A B on the same batch
                t = _time(fn, batch, device)
                if i >= 3:  # warm-up
                    times[name].append(t)
        for name, ts in times.items():
            a = np.array(ts) * 1e3
            row = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                   "samples_per_s": B * len(a) / (a.sum() / 1e3)}  # fmt: skip
            results["latency"][f"{name}_B{B}"] = row
            what = f"throughput={row['samples_per_s']:.0f}/s" if B == 8192 else f"p50_ms={row['p50_ms']:.3f}"
            print(f"RESULT serve_latency side={name} batch={B} {what} p99_ms={row['p99_ms']:.3f} "
                  f"dtype={args.dtype} device={args.device}", flush=True)  # fmt: skip
    (out / "serve_latency.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
