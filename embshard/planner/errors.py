"""PlanningError: no plan fits. Messages give the numbers (needed vs available, per tier and rank) and fixes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from embshard.planner.choices import Choice, Item
from embshard.planner.problem import Problem
from embshard.planner.topology import GIB, Topology
from embshard.spec.tables import ConfigError, TableConfig


class PlanningError(ConfigError):
    """No placement satisfies the memory budgets; `details` holds the numbers of the message."""

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


def gib(x: float) -> str:
    """Bytes as GiB text (MiB or KiB below 0.01 GiB, so small budgets do not read as 0.00 GiB)."""
    if abs(x) >= 0.01 * GIB or x == 0:
        return f"{x / GIB:.2f} GiB"
    if abs(x) >= 1 << 20:
        return f"{x / (1 << 20):.1f} MiB"
    return f"{x / 1024:.1f} KiB"


def _budget_line(topo: Topology, budgets) -> str:
    b = budgets
    parts = []
    if topo.is_gpu:
        parts.append(
            f"GPU memory for embeddings per rank {gib(b.hbm)} = {gib(b.hbm_capacity)} capacity - {gib(b.hbm_reserve)} "
            f"reserve (dense model, activations) - {gib(b.batch_buffers)} batch buffers"
        )
    buffers = f" - {gib(b.batch_buffers)} batch buffers" if b.hbm_capacity == 0 and b.batch_buffers else ""
    parts.append(f"host memory per rank {gib(b.ddr)} = {gib(b.ddr_capacity)} - {gib(b.ddr_reserve)} reserve{buffers}")
    return "; ".join(parts)


def _fixes(topo: Topology, tables: Sequence[TableConfig]) -> list[str]:
    fixes = []
    if topo.is_gpu:
        fixes.append(
            "allow the uvm / uvm_caching tiers (host memory) for the largest tables if constraints forbid them"
        )
        fixes.append(
            "raise --ddr-gib if the hosts have more memory than assumed, or lower the reserve (--hbm-reserve-gib)"
        )
    else:
        fixes.append("raise --ddr-gib if the host has more memory than assumed")
    if any(t.data_type.bytes == 4 for t in tables):
        fixes.append("store the largest tables in fp16 (data_type: fp16) to halve their weights")
    fixes.append("use rowwise_adagrad (4 B of state per row) instead of adam/adagrad (4-8 B per element)")
    biggest = sorted(tables, key=lambda t: -t.weight_bytes)[:3]
    fixes.append("shrink the largest tables (num_embeddings of " + ", ".join(repr(t.name) for t in biggest) + ")")
    return fixes


def _steps(ch: Choice, k: int) -> str:
    """'; of which X step buffers' for block k of a choice (the ids, backward workspace and pooled rows of one
    step, counted in its memory), or '' when it has none."""
    return f"; of which {gib(ch.buffers[k])} step buffers" if ch.buffers[k] > 0 else ""


def too_large_for_a_rank(p: Problem, item: Item) -> PlanningError:
    """A table none of whose allowed options has blocks that fit one rank."""
    names, topo, budgets = p.names(item), p.topology, p.budgets
    lines = [
        f"table(s) {names} fit no rank under any allowed option: every option has a shard larger than a rank's "
        f"budget ({_budget_line(topo, budgets)})."
    ]
    for ch in item.choices:
        k = int(np.argmax(ch.hbm + ch.ddr))
        lines.append(
            f"  {ch.option.label:32s} largest shard: GPU {gib(ch.hbm.max())}, host {gib(ch.ddr.max())} "
            f"({ch.blocks} shard(s){_steps(ch, k)})"
        )
    fixes = [
        "allow row_wise or column_wise sharding for it (constraints: sharding_types) so it is split over ranks",
        *_fixes(topo, [p.tables[i] for i in item.tables]),
    ]
    lines.append("fixes: " + "; ".join(fixes))
    return PlanningError("\n".join(lines), {"tables": names, "hbm_budget": budgets.hbm, "ddr_budget": budgets.ddr})


def totals_do_not_fit(p: Problem) -> PlanningError:
    """Even the least-memory options of the tables exceed the summed budgets of a tier, or of both together."""
    items, usable, tables, topo, budgets = p.items, p.usable, p.tables, p.topology, p.budgets
    fill, W = p.settings.memory_fill, topo.world_size
    least = [min(u, key=lambda c, it=it: it.choices[c].total_hbm) for it, u in zip(items, usable)]
    min_hbm = sum(it.choices[c].total_hbm for it, c in zip(items, least))
    min_steps = sum(float(it.choices[c].buffers.sum()) for it, c in zip(items, least))
    steps = (
        f" (of which {gib(min_steps)} the step's buffers: ids, backward workspace, pooled rows)" if min_steps else ""
    )
    min_ddr = sum(min(it.choices[c].total_ddr for c in u) for it, u in zip(items, usable))
    min_both = sum(min(it.choices[c].total_hbm + it.choices[c].total_ddr for c in u) for it, u in zip(items, usable))
    cap_h, cap_d = W * budgets.hbm * fill, W * budgets.ddr * fill
    need_d = max(min_ddr, min_both - cap_h)
    lines = ["no plan fits the memory budgets:"]
    if topo.is_gpu:
        lines.append(
            f"  GPU memory: needed at least {gib(min_hbm)} (every table in its least-GPU-memory option){steps}, "
            f"available {gib(cap_h)} = {W} ranks x {gib(budgets.hbm)} x {fill:g} fill"
        )
    lines.append(
        f"  host memory: needed at least {gib(need_d)} (what GPU memory cannot hold), available {gib(cap_d)} = "
        f"{W} ranks x {gib(budgets.ddr)} x {fill:g} fill"
    )
    if topo.is_gpu:
        lines.append(f"  both together: needed at least {gib(min_both)}, available {gib(cap_h + cap_d)}")
    lines.append(f"  per rank: {_budget_line(topo, budgets)}")
    per_rank_h, per_rank_d = budgets.hbm * fill, budgets.ddr * fill
    ranks = max(
        math.ceil(min_hbm / per_rank_h) if per_rank_h > 0 else 0,
        math.ceil(min_both / (per_rank_h + per_rank_d)) if per_rank_h + per_rank_d > 0 else 0,
        W + 1,
    )
    fixes = [f"use at least {ranks} ranks (--world-size {ranks})", *_fixes(topo, tables)]
    lines.append("fixes: " + "; ".join(fixes))
    return PlanningError(
        "\n".join(lines),
        {
            "hbm_needed": min_hbm,
            "hbm_step_buffers": min_steps,
            "hbm_available": cap_h,
            "ddr_needed": need_d,
            "ddr_available": cap_d,
            "hbm_budget_per_rank": budgets.hbm,
            "ddr_budget_per_rank": budgets.ddr,
            "min_world_size": ranks,
        },
    )


def placement_failed(
    p: Problem, item: Item, tried: list[int], hbm_free: np.ndarray, ddr_free: np.ndarray
) -> PlanningError:
    """The totals fit but this table's shards find no rank with room (memory is fragmented)."""
    names, topo, budgets = p.names(item), p.topology, p.budgets
    lines = [f"table(s) {names} could not be placed: no rank has room left for any of its options."]
    for c in tried:
        ch = item.choices[c]
        k = int(np.argmax(ch.hbm + ch.ddr))
        lines.append(
            f"  {ch.option.label:32s} needs per shard: GPU {gib(ch.hbm.max())}, host {gib(ch.ddr.max())}"
            + (f" ({_steps(ch, k)[2:]})" if ch.buffers[k] > 0 else "")
        )
    lines.append("  free memory per rank (GPU / host):")
    for r in range(topo.world_size):
        lines.append(
            f"    rank {r}: {gib(hbm_free[r])} of {gib(budgets.hbm)} / {gib(ddr_free[r])} of {gib(budgets.ddr)}"
        )
    lines.append(
        "fixes: allow row_wise / column_wise for the largest tables so they spread evenly; lower "
        "planner settings memory_fill; use more ranks or more memory per rank (--hbm-gib, --ddr-gib)"
    )
    return PlanningError(
        "\n".join(lines), {"tables": names, "hbm_free": hbm_free.tolist(), "ddr_free": ddr_free.tolist()}
    )
