"""Serving quality and size: a DLRM trained on synthetic data with a planted signal (configs/dlrm_synthetic.yaml,
the labels a fixed hidden function of the dense features and each bag's first id), saved, exported at fp32, fp16,
int8 and int4, and scored on the same held-out samples; the AUC of each type against fp32's and the tables' bytes.

    python -m bench.serve_quality --out DIR [--steps 300] [--device cpu|cuda] [--eval-batches 40]

PASS when |AUC - AUC fp32| is within 0.0002 (fp16), 0.001 (int8), 0.003 (int4), and the int8 / int4 tables are
at least 3x / 5x smaller than fp32 (the 4 bytes of scale and bias per row keep them from 4x / 8x for narrow rows).
The int8 artifact is also scored with the dense part in fp16 and in bf16 (`dense_dtype`; rows `int8+fp16dense`,
`int8+bf16dense`), each within int8's 0.001 of fp32's AUC.
Prints one RESULT line per type and writes DIR/serve_quality.json."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LIMITS = {"fp16": 0.0002, "int8": 0.001, "int4": 0.003, "int8+fp16dense": 0.001, "int8+bf16dense": 0.001}
DENSE = {"int8+fp16dense": "fp16", "int8+bf16dense": "bf16"}
"""Rows scored from the int8 artifact with the dense part in another type."""
RATIOS = {"int8": 3.0, "int4": 5.0}


def train(out: Path, steps: int, device: torch.device, eval_batches: int) -> tuple:
    from embshard import simple_plan
    from embshard.checkpoint import Checkpointer, TrainState
    from embshard.config import load_config
    from embshard.data import build_source
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(str(root / "configs/dlrm_synthetic.yaml"),
                      ["planner={}", f"data.synthetic.eval_batches={eval_batches}", "schedule.batch_size=256"])  # fmt: skip
    tables = list(cfg.model.tables)
    source = build_source(cfg.data, tables, cfg.schedule.batch_size, cfg.seed, 0, 1, workers=0)
    plan = simple_plan(tables, 1, 1, tier="hbm" if device.type == "cuda" else "host")  # host tier: CPU compute only
    model = RecModel(cfg.model, source.num_dense, plan, cfg.sparse_optimizer, device, 1, cfg.seed)
    opt = make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters())
    batches = source.train_batches(0)
    start = time.perf_counter()
    for _ in range(steps):
        step = model.step(next(batches).to(device))
        opt.zero_grad(set_to_none=True)
        step.loss.backward()
        opt.step()
    print(f"trained {steps} steps in {time.perf_counter() - start:.1f} s, last loss {step.loss.item():.4f}", flush=True)
    ckpt = Checkpointer(TrainState.of_model(model, opt), str(out / "ck"), async_save=False, config=cfg)
    ckpt.save(steps)
    ckpt.close()
    return list(source.eval_batches()), model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=40, help="held-out batches of 256 samples")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from embshard.serving import export_serving, load
    from embshard.serving.batch_scoring import binary_auc

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    held, model = train(out, args.steps, device, args.eval_batches)
    labels = torch.cat([b.labels for b in held]).numpy()
    with torch.no_grad():
        trained = torch.cat([torch.sigmoid(model.step(b.to(device)).scores).cpu() for b in held]).numpy()
    results, ok = {"trained_model_auc": binary_auc(trained, labels), "samples": len(labels)}, True
    infos: dict[str, dict] = {}
    for dtype in ("fp32", "fp16", "int8", "int4", *DENSE):
        if dtype in DENSE:
            info = infos["int8"]
            predictor = load(out / "int8", device, dense_dtype=DENSE[dtype])
        else:
            info = infos[dtype] = export_serving(out / "ck" / f"step_{args.steps}", out / dtype, dtype,
                                                 say=lambda _s: None)  # fmt: skip
            predictor = load(out / dtype, device)
        start = time.perf_counter()
        scores = torch.cat([predictor(b).cpu() for b in held]).numpy()
        seconds = time.perf_counter() - start
        auc = binary_auc(scores, labels)
        results[dtype] = {"auc": auc, "table_bytes": sum(t["bytes"] for t in info["tables"]), "score_s": seconds}
    base = results["fp32"]
    for dtype in ("fp32", "fp16", "int8", "int4", *DENSE):
        r = results[dtype]
        r["delta_auc"] = r["auc"] - base["auc"]
        r["size_ratio"] = base["table_bytes"] / r["table_bytes"]
        good = abs(r["delta_auc"]) <= LIMITS.get(dtype, 1e-6) and r["size_ratio"] >= RATIOS.get(dtype, 1.0)
        ok &= good
        print(f"RESULT serve_quality dtype={dtype} auc={r['auc']:.5f} delta_auc={r['delta_auc']:+.5f} "
              f"table_bytes={r['table_bytes']} size_ratio={r['size_ratio']:.2f} score_s={r['score_s']:.2f} "
              f"{'PASS' if good else 'FAIL'}", flush=True)  # fmt: skip
    print(f"trained model (eval forward) AUC {results['trained_model_auc']:.5f} on {len(labels)} held-out samples")
    print("PASS serve_quality" if ok else "FAIL serve_quality")
    (out / "serve_quality.json").write_text(json.dumps(results, indent=1))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
