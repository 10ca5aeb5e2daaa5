"""Predictions at scale, beside MLPerf's published figures: the MLPerf-shaped DLRM-DCNv2 job (bf16 dense model,
bf16 pooled embeddings, 8192 samples per GPU) planned by `embshard plan` at 2-512 GPUs of the h100 and h200
presets, with the sharding group size it picks (2D sharding) under exact and periodic replica sync. CPU only: the
planner and its cost model, no GPU.

    python -m bench.planner_at_scale [--out DIR] [--devices h100,h200] [--world-sizes 2,4,8,64,512]

Prints one Markdown table (docs/planner.md, "Predictions at scale") and, per case, the candidates' lines; with
--out, writes the table to DIR/planner_at_scale.md.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from embshard.planner.policy import search_plan
from embshard.planner.topology import Topology
from embshard.planner.twod import plan_at_scale
from embshard.tools import plan_scale
from embshard.tools.plan_inputs import training_planner_input_and_config

CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
OVERRIDES = ["training.precision=bf16", "lookup.output_dtype=bf16"]
PUBLISHED = {
    ("h100", 8): "1.95 M",
    ("h100", 64): "0.87 M",
    ("h100", 128): "0.59 M",
    ("h200", 8): "2.13-2.20 M",
}
"""MLPerf Training DLRM-DCNv2, NVIDIA HugeCTR run logs: samples/s per GPU (their own global batches)."""
SHORT = {"table_wise": "TW", "row_wise": "RW", "column_wise": "CW", "table_row_wise": "TWRW", "data_parallel": "DP"}


def layout(plan) -> str:
    """Sharding types of the plan's tables, counted: 'TW 12, RW 3, DP 11'."""
    n = Counter(SHORT[t.sharding_type.value] for t in plan.tables)
    return ", ".join(f"{k} {v}" for k, v in sorted(n.items()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="folder for planner_at_scale.md")
    p.add_argument("--devices", default="h100,h200")
    p.add_argument("--world-sizes", default="2,4,8,64,512")
    p.add_argument("--every", type=int, default=100, help="periodic replica sync: steps between syncs")
    args = p.parse_args(argv)
    inp, cfg = training_planner_input_and_config(CONFIG, OVERRIDES)
    dense = plan_scale.dense_spec(cfg)
    search = plan_scale.search_for(search_plan, inp)
    rows = [
        "| GPUs | replica sync | group size | layouts (tables per type) | busiest rank's lookups | embedding ms | "
        "replica sync ms | dense ms | dense all-reduce ms | step ms | predicted M samples/s per GPU | HugeCTR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for device in args.devices.split(","):
        for W in (int(w) for w in args.world_sizes.split(",")):
            topo = Topology.preset(device, W, min(W, 8))
            modes = [("exact", 1), ("periodic", args.every)] if topo.num_hosts > 1 else [("exact", 1)]
            for mode, every in modes:
                sp = plan_at_scale(
                    inp.tables, topo, inp.batch_size, inp.optimizer, inp.constraints, inp.settings, dense, mode,
                    every, search=search,
                )  # fmt: skip
                print(f"== {W} x {device}, replica sync {mode}")
                print(sp.summary(), flush=True)
                b = sp.best
                g = sp.group_size or "none"
                sync = "-" if topo.num_hosts == 1 else (mode if mode == "exact" else f"periodic / {every}")
                busy = max(sp.busy_shares(inp.tables))
                rows.append(
                    f"| {W} x {device.upper()} | {sync} | {g} | {layout(b.plan)} | {busy:.2f} | "
                    f"{b.embedding_s * 1e3:.2f} | {b.sync_s * 1e3:.2f} | {b.dense_s * 1e3:.2f} | "
                    f"{b.allreduce_s * 1e3:.2f} | {b.step_s * 1e3:.2f} | {sp.samples_per_s_per_gpu / 1e6:.2f} | "
                    f"{PUBLISHED.get((device, W), '')} |"
                )
    table = "\n".join(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "planner_at_scale.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
