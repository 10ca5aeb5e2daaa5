"""Physical floor of a training step: the bytes it must move per GPU, to divide by the bandwidths measured on the
machine (bench/report.py does the division), and the dense model's floating-point work.

Counted per rank and step, for a plan (every table's shards) and uniform ids, without any overlap:
  GPU memory (hbm)   every looked-up row read once in forward (n ids x row bytes) and every touched row read and
                     written once by the fused optimizer in backward (2 x u x row bytes, u = r(1 - exp(-n/r)) distinct
                     rows of an r-row shard hit by n ids); data-parallel tables: a gradient row per id in backward
                     and one read-read-write pass of the update over the replica. Rows of tables small enough to
                     stay in L2 are counted as GPU-memory reads too (such tables can go below this floor).
  GPU links (link)   the pooled rows a rank sends in forward and receives as gradients in backward (or receives
                     and sends: the larger of the two directions, full duplex), the ids it receives, the
                     data-parallel gradients' all-reduce (2(W-1)/W x bytes) and, end to end, the dense model's.
  host link (host)   UVM-caching shards: every missed row fetched and written back (a cache of a fraction f of the
                     rows misses 1 - f of uniform ids); UVM shards: every lookup and update crosses it.
  batch copy (h2d)   end to end: the batch's dense features, labels, ids (int64) and lengths, host to GPU.
  dense (gflop)      end to end: 6 flop per weight and sample (forward 2, backward 4) of the dense model.

Printed as RESULT fields by bench/embshard_dmp.py and bench/train_e2e.py (lists: one value per rank, GB):
    floor_hbm_gb=... floor_link_gb=... floor_host_gb=... [floor_h2d_gb=... dense_gflop=...]

The command line prints the same fields for a workload planned for a preset GPU (how the transcribed results in
bench/results/ got theirs):
    python -m bench.floors --workload uniform26 --device h100 --world-size 2 [--hbm-gib 16]
    python -m bench.floors --e2e configs/dlrm_dcnv2_mlperf.yaml --device h100 --world-size 2
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

ID_BYTES = 8  # int64 ids
LENGTH_BYTES = 4


def _kind(tp) -> str:
    return getattr(tp.sharding_type, "value", str(tp.sharding_type))


def _tier(tp) -> str:
    return getattr(tp.tier, "value", str(tp.tier))


def embedding_bytes(tables: Sequence, plan, batch: int, pooled_bytes: int = 4) -> dict[str, list[float]]:
    """Bytes per rank and step {hbm, link, host} of the sharded embeddings: `tables` (TableConfig-like: name,
    num_embeddings, embedding_dim, feature_names, ids_per_bag, data_type.bytes), `plan` (ShardingPlan-like:
    world_size, tables with sharding_type, tier, shards(rank, num_rows, num_cols), cache_load_factor), `batch`
    samples per rank."""
    world = plan.world_size
    by_name = {tp.table: tp for tp in plan.tables}
    hbm, host = [0.0] * world, [0.0] * world
    out_rows, in_rows, in_ids, out_ids, reduce = ([0.0] * world for _ in range(5))
    for t in tables:
        tp = by_name[t.name]
        feats, per_bag, rows = len(t.feature_names), float(t.ids_per_bag), t.num_embeddings
        if _kind(tp) == "data_parallel":
            rb = t.embedding_dim * 4  # fp32 replica
            for s in tp.shards:
                n = batch * feats * per_bag
                hbm[s.rank] += 2 * n * rb + 3 * rows * rb
                reduce[s.rank] += 2 * (world - 1) / world * rows * rb
            continue
        elem = t.data_type.bytes
        for s in tp.shards:
            frac = s.num_rows / rows
            n = world * batch * feats * per_bag * frac
            rb = s.num_cols * elem
            u = s.num_rows * -math.expm1(-n / s.num_rows) if s.num_rows else 0.0
            lookups = n * rb + 2 * u * rb
            tier = _tier(tp)
            if tier == "uvm":
                host[s.rank] += lookups
            else:
                hbm[s.rank] += lookups
                if tier == "uvm_caching":
                    host[s.rank] += 2 * u * (1.0 - tp.cache_load_factor) * rb
            pooled = batch * feats * s.num_cols * pooled_bytes
            ids = batch * feats * per_bag * frac * ID_BYTES
            out_rows[s.rank] += (world - 1) * pooled
            in_ids[s.rank] += (world - 1) * ids
            for r in range(world):
                if r != s.rank:
                    in_rows[r] += pooled
                    out_ids[r] += ids
    link = [2 * max(o, i) + max(a, b) + c for o, i, a, b, c in zip(out_rows, in_rows, in_ids, out_ids, reduce)]
    return {"hbm": hbm, "link": link, "host": host}


def sequence_bytes(
    tables: Sequence, plan, batch: int, dedup: bool = False, out_bytes: int = 4
) -> dict[str, list[float]]:
    """Bytes per rank and step {hbm, link} of sharded sequence tables (one row per id, bench/embshard_ec.py):
    every id's row read (with `dedup`, each source rank's distinct ids per shard: r(1 - exp(-m/r)) of m ids over
    r rows) and every touched row read and written by the fused optimizer; over the links, the ids sent to each
    shard and a row of `out_bytes` per column back (gradients the other way; the larger direction, twice);
    data-parallel tables as embedding_bytes counts them. Uniform ids; `tables` and `plan` as embedding_bytes."""
    world = plan.world_size
    by_name = {tp.table: tp for tp in plan.tables}
    hbm = [0.0] * world
    out_rows, in_rows, in_ids, out_ids, reduce = ([0.0] * world for _ in range(5))
    for t in tables:
        tp = by_name[t.name]
        local = batch * len(t.feature_names) * float(t.ids_per_bag)
        rows = t.num_embeddings
        if _kind(tp) == "data_parallel":
            rb = t.embedding_dim * 4
            for s in tp.shards:
                hbm[s.rank] += 2 * local * rb + 3 * rows * rb
                reduce[s.rank] += 2 * (world - 1) / world * rows * rb
            continue
        elem = t.data_type.bytes
        for s in tp.shards:
            if not s.num_rows:
                continue
            m = local * s.num_rows / rows  # ids one source rank sends this shard
            sent = s.num_rows * -math.expm1(-m / s.num_rows) if dedup else m
            u = s.num_rows * -math.expm1(-world * m / s.num_rows)
            hbm[s.rank] += world * sent * s.num_cols * elem + 2 * u * s.num_cols * elem
            row = sent * s.num_cols * out_bytes
            out_rows[s.rank] += (world - 1) * row
            in_ids[s.rank] += (world - 1) * sent * ID_BYTES
            for r in range(world):
                if r != s.rank:
                    in_rows[r] += row
                    out_ids[r] += sent * ID_BYTES
    link = [2 * max(o, i) + max(a, b) + c for o, i, a, b, c in zip(out_rows, in_rows, in_ids, out_ids, reduce)]
    return {"hbm": hbm, "link": link}


def batch_copy_bytes(tables: Sequence, batch: int, num_dense: int) -> float:
    """Bytes of one rank's batch copied host to GPU: dense features and label (fp32), ids (int64), lengths."""
    ids = sum(len(t.feature_names) * float(t.ids_per_bag) for t in tables)
    bags = sum(len(t.feature_names) for t in tables)
    return batch * ((num_dense + 1) * 4 + ids * ID_BYTES + bags * LENGTH_BYTES)


def fields(parts: dict[str, list[float]], **extra: float) -> str:
    """RESULT fields: floor_<part>_gb=v0,v1,... per rank, then the extra ones (e.g. dense_gflop)."""
    text = [f"floor_{k}_gb=" + ",".join(f"{v / 1e9:.5g}" for v in vals) for k, vals in parts.items()]
    text += [f"{k}={v:.4g}" for k, v in extra.items()]
    return " ".join(text)


def e2e_fields(tables: Sequence, plan, batch: int, num_dense: int, dense_weights: int, pooled_bytes: int) -> str:
    """The end-to-end step's floor fields: embeddings, the dense gradients' all-reduce, the batch copy, and the dense
    model's work (6 flop per weight and sample)."""
    parts = embedding_bytes(tables, plan, batch, pooled_bytes)
    world = plan.world_size
    allreduce = 2 * (world - 1) / world * dense_weights * 4
    parts["link"] = [v + allreduce for v in parts["link"]]
    parts["h2d"] = [batch_copy_bytes(tables, batch, num_dense)] * world
    return fields(parts, dense_gflop=6 * dense_weights * batch / 1e9)


def single_gpu_e2e_fields(config, scale: float, batch: int, pooled_bytes: int) -> str:
    """e2e_fields of a DLRM-DCNv2 training config on one GPU (every table table-wise on it), read from its YAML
    alone; rows scaled as bench/train_e2e.py --scale does."""
    from types import SimpleNamespace as NS

    import yaml

    cfg = yaml.safe_load(open(config))
    model, num_dense = cfg["model"], cfg["data"]["synthetic"]["num_dense"]
    tables, shards = [], []
    for t in model["tables"]:
        rows = max(min(t["num_embeddings"], 16), math.ceil(t["num_embeddings"] * scale))
        dim = t["embedding_dim"]
        tables.append(NS(name=t["name"], num_embeddings=rows, embedding_dim=dim, feature_names=t["feature_names"],
                         ids_per_bag=t.get("ids_per_bag", 1), data_type=NS(bytes=4)))  # fmt: skip
        shards.append(NS(table=t["name"], sharding_type="table_wise", tier="hbm", cache_load_factor=0.2,
                         shards=[NS(rank=0, num_rows=rows, num_cols=dim)]))  # fmt: skip
    dim = model["tables"][0]["embedding_dim"]
    interaction = (sum(len(t["feature_names"]) for t in model["tables"]) + 1) * dim
    widths = [num_dense, *model["dlrm"]["bottom_mlp"], dim]
    top = [interaction, *model["dlrm"]["top_mlp"], 1]
    weights = sum(a * b for a, b in zip(widths, widths[1:])) + sum(a * b for a, b in zip(top, top[1:]))
    weights += model["dcn"]["num_layers"] * 2 * interaction * model["dcn"]["low_rank"]
    return e2e_fields(tables, NS(world_size=1, tables=shards), batch, num_dense, weights, pooled_bytes)


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", help="an embedding-step workload of bench/embshard_dmp.py")
    p.add_argument("--e2e", help="a training config (end-to-end step, the dense model counted too)")
    p.add_argument("--device", default="h100", help="planner preset (h100, h200, ...)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hbm-gib", type=float, default=0.0, help="GPU memory the planner may plan for (0: the preset's)")
    p.add_argument("--pooled-bytes", type=int, default=4, help="end to end: 2 with lookup.output_dtype=bf16")
    args = p.parse_args(argv)
    from embshard.planner import Topology, plan_with_report
    from embshard.spec.optim import FusedOptimizerConfig

    topo = Topology.preset(args.device, args.world_size).with_sizes(hbm_gib=args.hbm_gib or None)
    if args.workload:
        from bench.workloads import WORKLOADS, workload_tables

        tables, batch = workload_tables(args.workload), WORKLOADS[args.workload][1]
        plan, report = plan_with_report(
            tables, topo, batch_size=batch, optimizer=FusedOptimizerConfig("rowwise_adagrad")
        )
        print(f"predicted_ms={report.step_time_s * 1e3:.2f} " + fields(embedding_bytes(tables, plan, batch)))
    if args.e2e:
        from embshard.config import load_config
        from embshard.models.registry import model_kind

        cfg = load_config(args.e2e)
        tables, batch, num_dense = list(cfg.model.tables), cfg.schedule.batch_size, cfg.data.synthetic.num_dense
        pl = cfg.planner
        plan, report = plan_with_report(tables, topo, batch, cfg.sparse_optimizer, pl.constraints, pl.settings)
        dense = model_kind(cfg.model.kind).build_dense(cfg.model, num_dense)
        weights = sum(p.numel() for p in dense.parameters() if p.dim() >= 2)
        print(
            f"predicted_embedding_ms={report.step_time_s * 1e3:.2f} "
            + e2e_fields(tables, plan, batch, num_dense, weights, args.pooled_bytes)
        )


if __name__ == "__main__":
    _main()
