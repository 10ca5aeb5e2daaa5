"""Why a table was placed where it was: its placement, memory and predicted cost, the planner's notes, and
every option it had, with the cost model's numbers for each."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from embshard.planner import loads
from embshard.planner.choices import build_items
from embshard.planner.constraints import ParameterConstraints
from embshard.planner.cost import CostModel, TableStats
from embshard.planner.predict import budgets
from embshard.planner.report import PlanReport, _b, _columns
from embshard.spec.plan import ShardingType, ranks_text

_TW = (ShardingType.TABLE_WISE,)


def explain(report: PlanReport, table: str) -> str:
    """A few paragraphs about one table of a report (from plan_with_report or predict)."""
    tr = report.table(table)
    cfg = next(t for t in report.table_configs if t.name == table)
    tp = report.plan[table]
    model = CostModel(
        report.topology, report.batch_size, report.optimizer, report.settings, report.plan.table_row_wise_exchange
    )
    bud = budgets(model, report.table_configs)
    lines = [
        f"table {cfg.name!r}: {cfg.num_embeddings:,} rows x {cfg.embedding_dim} {cfg.data_type.value}, "
        f"{len(cfg.feature_names)} feature(s), {cfg.ids_per_bag:g} ids per bag (hint)"
        + (", weighted" if cfg.weighted else ""),
        f"placed: {tr.sharding} in {tr.tier}"
        + (f" (cache {tr.cache_load_factor:g} of rows)" if tr.cache_load_factor is not None else "")
        + (f" with kernel {tr.kernel}" if tr.kernel != "fbgemm" else "")
        + f" on rank(s) {ranks_text(tr.ranks)}, {len(tp.shards)} shard(s): "
        + ", ".join(f"r{s.rank}:{s.num_rows}x{s.num_cols}" for s in tp.shards[:4])
        + (" ..." if len(tp.shards) > 4 else ""),
        f"memory: {_b(tr.hbm_bytes)} GPU, {_b(tr.ddr_bytes)} host over all shards "
        f"(per rank budget {_b(bud.hbm)} GPU, {_b(bud.ddr)} host)",
    ]
    hint = (report.constraints.get(table) or ParameterConstraints()).zipf_alpha
    alone = _phases(model, cfg, tp, model.settings.zipf_alpha if hint is None else hint)
    lines.append(
        f"predicted: {tr.time_s * 1e3:.4f} ms per step if it were alone ("
        + ", ".join(f"{n} {t * 1e3:.4f}" for n, t in zip(loads.PHASES, alone) if t > 0)
        + f"); the whole plan: {report.step_time_s * 1e3:.3f} ms"
    )
    if tr.notes:
        lines.append("why:")
        lines += [f"  - {n}" for n in tr.notes]
    cons = report.constraints.get(table) or ParameterConstraints()
    if cons.colocate_with is not None:
        lines.append(f"co-located with {cons.colocate_with!r}: only table-wise options, placed together")
    alone = replace(
        cons,
        colocate_with=None,
        sharding_types=cons.sharding_types or _TW if cons.colocate_with else cons.sharding_types,
    )
    item = build_items(model, [cfg], {table: alone})[0]
    rows = [("option", "balanced ms", "GPU mem", "host mem", "largest shard fits", "")]
    for ch in sorted(item.choices, key=lambda c: c.avg):
        fits = ch.hbm_max <= bud.hbm + 0.5 and ch.ddr_max <= bud.ddr + 0.5
        chosen = (ch.option.sharding.value, ch.option.tier.value, ch.option.kernel.value) == (
            tr.sharding,
            tr.tier,
            tr.kernel,
        )
        if ch.option.sharding.value == "column_wise" and chosen:
            chosen = ch.blocks == len(tp.shards)
        rows.append(
            (
                ch.option.label,
                f"{ch.avg * 1e3:.4f}",
                _b(ch.total_hbm),
                _b(ch.total_ddr),
                "yes" if fits else "no",
                "<- chosen" if chosen else "",
            )
        )
    lines.append(
        "options (balanced ms: the step time the table adds if its work were spread evenly over the ranks; "
        "memory over all shards; 'small': on the small-table kernel, which the planner considers where it is "
        "predicted 10% faster for the table alone):"
    )
    lines += ["  " + line for line in _columns(rows).splitlines()]
    return "\n".join(lines)


def _phases(model: CostModel, cfg, tp, alpha: float) -> np.ndarray:
    stats = TableStats.one(cfg)
    rows = np.array([s.num_rows for s in tp.shards], dtype=float)
    cols = np.array([s.num_cols for s in tp.shards], dtype=float)
    wk = model.work(stats, tp.sharding_type, tp.tier, rows, cols, tp.cache_load_factor, alpha, tp.kernel)
    shape = (len(rows), loads.NROWS)
    topo = model.topo
    vecs = (np.broadcast_to(v, shape) for v in model.block_vecs(wk, tp.sharding_type, len(rows)))
    matrix = loads.spread(np.array(tp.ranks), *vecs, topo.world_size, topo.local_world_size)
    return loads.phase_times(matrix).max(axis=1)
