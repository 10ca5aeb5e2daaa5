"""Predict what a plan costs: memory per rank and tier, and step time per phase and rank (any ShardingPlan,
planned here or loaded from a file)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from embshard.planner import exchange as twrw
from embshard.planner import loads
from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.cost import CostModel
from embshard.planner.memory import Storage, TableStats
from embshard.planner.report import PlanReport, RankReport, TableReport
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import GIB, Topology
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import Exchange, LookupKernel, MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig, validate_tables


@dataclass(frozen=True)
class Budgets:
    """Memory per rank (bytes): capacity, what is kept back, and what embeddings may use."""

    hbm_capacity: float
    """GPU memory of one rank."""
    hbm_reserve: float
    """Kept for the CUDA context, dense model and activations (settings)."""
    batch_buffers: float
    """The rank's own batch: ids in and out, pooled rows and gradients (any plan)."""
    ddr_capacity: float
    """Host memory of one rank."""
    ddr_reserve: float
    """Host memory kept for the process and data loading."""

    @property
    def hbm(self) -> float:
        """GPU memory embeddings may use on each rank."""
        return max(0.0, self.hbm_capacity - self.hbm_reserve - self.batch_buffers)

    @property
    def ddr(self) -> float:
        """Host memory embeddings may use on each rank."""
        extra = self.batch_buffers if self.hbm_capacity == 0 else 0.0
        return max(0.0, self.ddr_capacity - self.ddr_reserve - extra)


def budgets(model: CostModel, tables: Sequence[TableConfig]) -> Budgets:
    """Per-rank memory budgets for these tables on the model's topology and settings."""
    topo, s = model.topo, model.settings
    hbm = float(topo.hbm_bytes) if topo.is_gpu else 0.0
    reserve = s.hbm_reserve_gib * GIB if s.hbm_reserve_gib is not None else s.hbm_reserve_fraction * hbm
    return Budgets(
        hbm_capacity=hbm,
        hbm_reserve=min(reserve, hbm),
        batch_buffers=model.batch_bytes(tables),
        ddr_capacity=float(topo.ddr_bytes),
        ddr_reserve=s.ddr_reserve_fraction * topo.ddr_bytes,
    )


def predict(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig | None = None,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None = None,
    settings: PlannerSettings | None = None,
    notes: Mapping[str, Sequence[str]] | None = None,
    compare_exchanges: bool = True,
) -> PlanReport:
    """Memory and step-time prediction of `plan` (formulas: embshard.planner.cost). `constraints` only supply
    hints (zipf_alpha); `notes` are the planner's per-table decisions, kept in the report. A plan with
    table-row-wise tables on several hosts of several ranks is also predicted under the other output exchange
    (`PlanReport.exchange_step_s`, with the bytes of each level: `exchange_bytes`), unless `compare_exchanges`
    is false."""
    tables = validate_tables(tables)
    plan.check(tables)
    if plan.world_size != topology.world_size or plan.local_world_size != topology.local_world_size:
        topology = topology.with_sizes(plan.world_size, plan.local_world_size)
    optimizer = optimizer or FusedOptimizerConfig()
    settings = settings or PlannerSettings()
    model = CostModel(topology, batch_size, optimizer, settings, plan.table_row_wise_exchange)
    cons = resolve_constraints(tables, constraints, topology.world_size)
    W, lws = topology.world_size, topology.local_world_size
    stats = TableStats.of(tables)
    hints = [cons[t.name].zipf_alpha for t in tables]
    alpha = np.array([settings.zipf_alpha if a is None else a for a in hints], dtype=float)
    # Every shard, grouped by (sharding, tier, cache size, kernel) for one vectorized cost-model call each.
    kinds: dict[tuple, list[tuple[int, int, int, int]]] = {}
    for i, t in enumerate(tables):
        tp = plan[t.name]
        key = (tp.sharding_type, tp.tier, tp.cache_load_factor, tp.kernel)
        kinds.setdefault(key, []).extend((i, s.rank, s.num_rows, s.num_cols) for s in tp.shards)
    total = np.zeros((loads.NROWS, W))
    fields = list(Storage.__dataclass_fields__)
    rank_mem = {f: np.zeros(W) for f in fields}
    table_hbm, table_ddr = np.zeros(len(tables)), np.zeros(len(tables))
    per_table: list[list] = [[] for _ in tables]
    alone = np.zeros(len(tables))
    groups: set[tuple] = set()
    hot: dict[tuple, float] = {}  # (sharding, tier, rank) of small-kernel groups -> the longest hot-row chain
    for (st, tier, clf, kernel), entries in kinds.items():
        ti, rk, rows, cols = (np.array(x) for x in zip(*entries))
        rows, cols = rows.astype(float), cols.astype(float)
        sub = TableStats(*(getattr(stats, f)[ti] for f in TableStats.__dataclass_fields__))
        wk = model.work(sub, st, tier, rows, cols, clf, alpha[ti], kernel)
        shape = (len(ti), loads.NROWS)
        blocks = np.bincount(ti, minlength=len(tables))[ti]
        owner, same, other = (np.broadcast_to(v, shape) for v in model.block_vecs(wk, st, blocks))
        total += loads.spread(rk, owner, same, other, W, lws)
        mem = model.storage(sub, st, tier, rows, cols, clf, kernel)
        for f in fields:
            np.add.at(rank_mem[f], rk, np.broadcast_to(getattr(mem, f), rows.shape))
        np.add.at(table_hbm, ti, np.broadcast_to(mem.hbm, rows.shape))
        np.add.at(table_ddr, ti, np.broadcast_to(mem.ddr, rows.shape))
        # A table's time alone: one shard -> each rank shows one of owner / same / other; else spread them.
        single = blocks == 1
        peak = owner[single]
        if lws > 1:
            peak = np.maximum(peak, same[single])
        if W > lws:
            peak = np.maximum(peak, other[single])
        alone[ti[single]] = np.maximum.reduceat(peak, loads.PHASE_START, axis=1).sum(axis=1)
        for k in np.flatnonzero(~single).tolist():
            per_table[ti[k]].append((rk[k], owner[k], same[k], other[k]))
        raw = np.asarray(sub.raw, dtype=bool)  # raw-id tables' shards form lookup groups of their own
        groups.update((st, tier, kernel, bool(w), int(r)) for w, r in set(zip(raw.tolist(), rk.tolist())))
        for r, h in zip(rk.tolist(), np.broadcast_to(wk.hot_s, rows.shape).tolist()):
            if kernel is LookupKernel.SMALL:
                hot[(st, tier, r)] = max(hot.get((st, tier, r), 0.0), h)
    table_reports = []
    for i, t in enumerate(tables):
        tp = plan[t.name]
        if per_table[i]:
            rk, ow, sa, ot = (np.array(x) for x in zip(*per_table[i]))
            alone[i] = loads.step_time(loads.spread(rk, ow, sa, ot, W, lws))
        table_reports.append(
            TableReport(
                name=t.name,
                rows=t.num_embeddings,
                dim=t.embedding_dim,
                sharding=tp.sharding_type.value,
                tier=tp.tier.value,
                kernel=tp.kernel.value,
                ranks=tuple(tp.ranks),
                cache_load_factor=tp.cache_load_factor if tp.tier is MemoryTier.UVM_CACHING else None,
                hbm_bytes=float(table_hbm[i]),
                ddr_bytes=float(table_ddr[i]),
                time_s=float(alone[i]),
                notes=tuple((notes or {}).get(t.name, ())),
            )
        )
    schemes: dict = {}
    for t in tables:
        sc = schemes.setdefault(plan[t.name].sharding_type, [0, 0])
        sc[0] += 1
        sc[1] += int(t.weighted)
    rank_mem_list = [Storage(*(float(rank_mem[f][r]) for f in fields)) for r in range(W)]
    for st, tier, kernel, raw, r in sorted(groups, key=lambda g: (g[0].value, g[1].value, g[2].value, g[3], g[4])):
        total[:, r] += model.group_fixed(st, tier, kernel, raw)
    for (_st, _tier, r), h in sorted(hot.items(), key=lambda g: (g[0][0].value, g[0][1].value, g[0][2])):
        total[loads.BWD, r] += h
    for st, (_n, nw) in schemes.items():
        total += model.scheme_fixed(st, nw > 0)[:, None]
    if any(st is not ShardingType.DATA_PARALLEL for st in schemes):
        total += model.step_fixed()[:, None]
    total += model.batch_loads(tables)[:, None]
    b = budgets(model, tables)
    phases = loads.phase_times(total)
    host = host_times(model, groups)
    ranks = [
        RankReport(
            rank=r,
            time_s=float(phases[:, r].sum()),
            phase_s=tuple(float(x) for x in phases[:, r]),
            storage=rank_mem_list[r],
            hbm_budget=b.hbm,
            ddr_budget=b.ddr,
            batch_buffers=b.batch_buffers,
            hbm_reserve=b.hbm_reserve,
            host_s=float(host[r]),
        )
        for r in range(W)
    ]
    exchange_step_s, exchange_level_bytes = {}, {}
    twrw_tables = any(tp.sharding_type is ShardingType.TABLE_ROW_WISE for tp in plan.tables)
    if compare_exchanges and twrw_tables and twrw.applies(topology):
        mine = plan.table_row_wise_exchange
        other = Exchange.FLAT if mine is Exchange.HIERARCHICAL else Exchange.HIERARCHICAL
        alt = replace(plan, table_row_wise_exchange=other)
        alt_s = predict(alt, tables, topology, batch_size, optimizer, cons, settings, compare_exchanges=False)
        exchange_step_s = {mine.value: max(loads.step_time(total), float(host.max())), other.value: alt_s.step_time_s}
        level = twrw.exchange_bytes(plan, tables, [batch_size] * W, int(model.out_bytes))
        exchange_level_bytes = {e.value: v for e, v in level.items()}
    return PlanReport(
        exchange_step_s=exchange_step_s,
        exchange_bytes=exchange_level_bytes,
        plan=plan,
        topology=topology,
        batch_size=batch_size,
        optimizer=optimizer,
        settings=settings,
        step_time_s=max(loads.step_time(total), float(host.max())),
        gpu_step_time_s=loads.step_time(total),
        host_step_time_s=float(host.max()),
        phase_s=tuple(float(x) for x in phases.max(axis=1)),
        ranks=ranks,
        tables=table_reports,
        loads=total,
        table_configs=tuple(tables),
        constraints=cons,
    )


def host_times(model: CostModel, groups: set[tuple]) -> np.ndarray:
    """[W]: the host's time to issue an eager step on each rank (seconds): topology.host_step_s, plus
    host_group_s per lookup group on FBGEMM's TBE (model- or data-parallel; a group on embshard's small-table
    kernel is a few Triton launches: no host cost measured) and host_dp_group_s per data-parallel group on the
    rank (`groups`: (sharding, tier, kernel, raw, rank) of every group), plus host_sync_s with device batch counts
    (the host waits for the device there before it issues the rest of the step). Zeros on CPUs (the host runs the
    lookups, priced as such), for a step replayed as one CUDA graph (the host launches the graph, not the
    operators) and for a topology without host constants."""
    topo = model.topo
    W = topo.world_size
    priced = topo.host_step_s or topo.host_group_s or topo.host_dp_group_s
    if not topo.is_gpu or model.settings.whole_step_graph is True or not priced:
        return np.zeros(W)
    out = np.full(W, topo.host_step_s)
    for st, _tier, kernel, _raw, r in groups:
        out[r] += (topo.host_group_s if kernel is not LookupKernel.SMALL else 0.0) + (
            topo.host_dp_group_s if st is ShardingType.DATA_PARALLEL else 0.0
        )
    if any(g[0] is not ShardingType.DATA_PARALLEL for g in groups):
        out += model.step_fixed().max()  # the device sync of device batch counts: the host waits it out too
    return out
