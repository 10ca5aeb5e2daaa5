"""Measured embedding steps against the cost model: the cases of a JSON table (tests/planner/data/
measured_steps.json: GPU model, workload, the plan that ran, the measured ms/step and the logs they come from),
each rebuilt as the plan it ran and predicted with the GPU model's preset. A case with "ids": "raw" ran the
workload's tables as raw-id tables (ids: raw, capacity = their rows, its "eviction", default lru). "counts" says where
the steps' batch counts came from: "device" (gathered on the GPUs with one device sync a step; the default: every
case measured before bench/embshard_dmp.py had --counts) or "host" (counted on the CPU and gathered over a CPU
group, the training pipeline's way); each case is predicted with that PlannerSettings.batch_counts. "step": "graph"
says the step ran as one CUDA graph replay (bench/embshard_dmp.py --graph: host counts, the plan the planner makes
for the graph; PlannerSettings.whole_step_graph), default "eager". A plan's tables are in HBM unless "uvm_caching" or
"uvm" lists them, and on FBGEMM's kernel unless "small_kernel" lists them (table-wise tables) or "data_parallel_kernel"
names the data-parallel tables' kernel.
tests/planner/test_planner_measured.py pins the predictions within the table's tolerance of each case's median;
`bench/planner_predict.py --measured` prints the table.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from embshard.planner import cost
from embshard.planner.predict import predict
from embshard.planner.report import PlanReport
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import TableConfig


@dataclass(frozen=True)
class MeasuredCase:
    """One GPU model x workload x plan with its measured steps."""

    gpu: str
    world: int
    workload: str
    date: str
    measured_ms: tuple[float, ...]
    sources: tuple[str, ...]
    tables: tuple[TableConfig, ...]
    batch: int
    plan: ShardingPlan
    hbm_gib: float | None
    ids: str = "static"
    """'static', or 'raw': the tables ran as raw-id tables (ids: raw) evicting by `eviction`."""
    eviction: str = "lru"
    counts: str = "device"
    """Where the steps' batch counts came from: 'device' (one device sync a step) or 'host' (no device sync)."""
    step: str = "eager"
    """'eager', or 'graph': each step ran as one CUDA graph replay (PlannerSettings.whole_step_graph)."""

    @property
    def label(self) -> str:
        """The workload, for raw-id tables their ids and eviction, and host counts, e.g. 'uniform26 raw ids (lru)',
        'uniform26 host counts'."""
        raw = f" raw ids ({self.eviction})" if self.ids == "raw" else ""
        graph = " graphed" if self.step == "graph" else ""
        return self.workload + raw + (" host counts" if self.counts == "host" and not graph else "") + graph

    @property
    def median_ms(self) -> float:
        """The median of the measured steps (ms)."""
        return float(statistics.median(self.measured_ms))

    def report(self, **overrides: float) -> PlanReport:
        """The model's prediction of this case's plan on the GPU model's preset (`overrides`: Topology fields)."""
        topo = Topology.preset(self.gpu, self.world).with_sizes(self.world, hbm_gib=self.hbm_gib)
        if overrides:
            topo = replace(topo, **overrides)
        opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
        settings = PlannerSettings(batch_counts=self.counts, whole_step_graph=self.step == "graph")
        return predict(self.plan, list(self.tables), topo, self.batch, opt, settings=settings)


def workload_tables(spec: dict[str, Any]) -> list[TableConfig]:
    """Tables t0, t1, ... (features f0, f1, ...) from [[count, rows, dim, ids per bag], ...] (bench/embshard_dmp.py's
    naming)."""
    shapes = [(r, d, m) for count, r, d, m in spec["tables"] for _ in range(count)]
    return [TableConfig(f"t{i}", r, d, (f"f{i}",), ids_per_bag=m) for i, (r, d, m) in enumerate(shapes)]


def _plan(case: dict[str, Any], tables: list[TableConfig], where: str) -> ShardingPlan:
    ranks, world = case["plan"], int(case["world"])
    if len(ranks) != len(tables):
        raise ValueError(f"{where}: plan has {len(ranks)} characters for {len(tables)} tables (one per table)")
    tiers = {i: "uvm_caching" for i in case.get("uvm_caching", [])} | {i: "uvm" for i in case.get("uvm", [])}
    dp_kernel = case.get("data_parallel_kernel", "fbgemm")
    small = set(case.get("small_kernel", []))  # table-wise tables on embshard's small-table kernel
    entries = []
    for i, (t, r) in enumerate(zip(tables, ranks, strict=True)):
        tier = tiers.get(i, "hbm")
        on = list(range(world)) if r == "d" else [int(r)]
        entries.append(
            {
                "table": t.name,
                "sharding_type": "data_parallel" if r == "d" else "table_wise",
                "tier": tier,
                "shards": [
                    {
                        "rank": k,
                        "row_offset": 0,
                        "num_rows": t.num_embeddings,
                        "col_offset": 0,
                        "num_cols": t.embedding_dim,
                    }
                    for k in on
                ],
                "cache_load_factor": case.get("cache_load_factor") or 0.2,
                "kernel": dp_kernel if r == "d" else "small" if i in small else "fbgemm",
            }
        )
    return ShardingPlan.from_dict({"world_size": world, "local_world_size": world, "tables": entries})


def load_cases(path: str | Path) -> tuple[list[MeasuredCase], float]:
    """The cases of a measured-steps JSON file and its tolerance (relative)."""
    data = json.loads(Path(path).read_text())
    cases = []
    for k, c in enumerate(data["cases"]):
        where = f"{path}: case {k} ({c['gpu']} {c['workload']})"
        w = data["workloads"][c["workload"]]
        tables = workload_tables(w)
        ids, eviction = c.get("ids", "static"), c.get("eviction", "lru")
        if ids not in ("static", "raw") or eviction not in ("lru", "lfu"):
            raise ValueError(
                f"{where}: ids {ids!r}, eviction {eviction!r}: ids must be 'static' or 'raw' and eviction 'lru' or "
                "'lfu' (raw-id tables)"
            )
        counts = c.get("counts", "device")
        if counts not in ("device", "host"):
            raise ValueError(
                f"{where}: counts {counts!r}: it must be 'device' (batch counts gathered on the GPUs, one device sync "
                "a step; the default) or 'host' (counted on the CPU: bench/embshard_dmp.py --counts host)"
            )
        step = c.get("step", "eager")
        if step not in ("eager", "graph") or (step == "graph" and counts != "host"):
            raise ValueError(
                f"{where}: step {step!r} with counts {counts!r}: step must be 'eager' (the default) or 'graph' (one "
                "CUDA graph replay a step: bench/embshard_dmp.py --graph, which counts on the host)"
            )
        if ids == "raw":
            tables = [replace(t, ids="raw", eviction=eviction) for t in tables]
        cases.append(
            MeasuredCase(
                gpu=c["gpu"],
                world=int(c["world"]),
                workload=c["workload"],
                date=c.get("date", ""),
                measured_ms=tuple(float(x) for x in c["measured_ms"]),
                sources=tuple(c.get("sources", ())),
                tables=tuple(tables),
                batch=int(w["batch"]),
                plan=_plan(c, tables, where),
                hbm_gib=c.get("hbm_gib"),
                ids=ids,
                eviction=eviction,
                counts=counts,
                step=step,
            )
        )
    return cases, float(data.get("tolerance", 0.10))


def table(cases: list[MeasuredCase], **overrides: float) -> list[str]:
    """Markdown rows: GPU, workload, plan mix, measured median (range, n), predicted, error."""
    rows = [
        "| GPU | workload | date | measured ms (median; range; n) | predicted ms | error |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for c in cases:
        p = c.report(**overrides).step_time_s * 1e3
        m = c.median_ms
        rng = f"{min(c.measured_ms):.2f}-{max(c.measured_ms):.2f}"
        rows.append(
            f"| {c.world} x {c.gpu.upper()} | {c.label} | {c.date} | {m:.2f} ({rng}; n={len(c.measured_ms)}) | "
            f"{p:.2f} | {p / m - 1:+.1%} |"
        )
    return rows


def _prices_host(gpu: str) -> bool:
    """Whether the GPU model's preset prices the host's time of an eager step (host_step_s): its batch_bag_s is 0,
    the host floor carrying the host's per-step work, and its cases fit that floor (`fit_host_floor`)."""
    return Topology.preset(gpu, 2).host_step_s > 0


def fit_host_and_bag(cases: list[MeasuredCase]) -> tuple[float, dict[str, float], list[str]]:
    """Refit the per-bag cost of the own batch (batch_bag_s) of the GPU models whose preset does not price the
    host's floor (`_prices_host`: the H200), to their static device-count cases, by least squares on the relative
    errors, with the device sync's cost (host_sync_s, a host's, the same on every GPU model) as the preset has it:
    0.63 ms, fitted with batch_bag to both GPU models' device-count steps before the H100's eager steps were priced
    by its host's floor, whose device-count cases it still fits (`fit_host_floor`). Returns host_sync_s,
    {gpu: batch_bag_s} and the table before -> after."""
    import numpy as np

    cases = [c for c in cases if c.ids == "static" and c.counts == "device" and not _prices_host(c.gpu)]
    if not cases:
        raise ValueError("no static device-count case of a GPU model without a host floor to fit batch_bag to")
    sync = Topology.preset(cases[0].gpu, cases[0].world).host_sync_s
    bags, lines = {}, []
    for gpu in sorted({c.gpu for c in cases}):
        mine = [c for c in cases if c.gpu == gpu]
        bare = np.array([c.report(batch_bag_s=0.0).gpu_step_time_s for c in mine])
        n = np.array([c.batch * sum(len(t.feature_names) for t in c.tables) for c in mine], dtype=float)
        m = np.array([c.median_ms * 1e-3 for c in mine])
        bags[gpu] = float(np.sum((m - bare) * n / m**2) / np.sum(n * n / m**2))
        lines.append(f"{gpu}: batch_bag {bags[gpu] * 1e9:.3f} ns (host_sync {sync * 1e6:.0f} us as the preset's)")
        for c, b, k in zip(mine, bare, n, strict=True):
            before, after = c.report().step_time_s * 1e3, (b + bags[gpu] * k) * 1e3
            lines.append(
                f"{c.world} x {c.gpu} {c.workload:9s} measured {c.median_ms:6.2f} ms  predicted {before:6.2f} "
                f"({before / c.median_ms - 1:+.1%}) -> {after:6.2f} ({after / c.median_ms - 1:+.1%})"
            )
    return float(sync), bags, lines


def _host_groups(case: MeasuredCase) -> list[tuple[int, int]]:
    """Per rank: its lookup groups on FBGEMM's TBE and its data-parallel groups, as predict.host_times counts them
    (read off two predictions that charge 1 s a group of one kind and nothing else)."""
    probe = {"host_step_s": 0.0, "host_sync_s": 0.0}
    tbe = case.report(**probe, host_group_s=1.0, host_dp_group_s=0.0).ranks
    dp = case.report(**probe, host_group_s=0.0, host_dp_group_s=1.0).ranks
    return [(round(a.host_s), round(b.host_s)) for a, b in zip(tbe, dp, strict=True)]


def fit_host_floor(cases: list[MeasuredCase], gpu: str) -> tuple[dict[str, float], list[str]]:
    """Refit the host's time to issue an eager step (Topology host_step_s, host_group_s, host_dp_group_s) to the
    eager cases of static tables on `gpu`, with the GPUs' time as the preset prices it: the prediction is max(the
    GPUs' step, the slowest rank's host time (+ host_sync_s with device counts)), so the fit is a grid search
    (steps of 50 us): the least worst relative error (within half a percent), then the least squared ones. Returns
    the fields and the table before -> after."""
    import numpy as np

    cases = [c for c in cases if c.gpu == gpu and c.ids == "static" and c.step == "eager"]
    if not cases:
        raise ValueError(f"no eager case of static tables on {gpu} to fit the host's time to")
    off = {"host_step_s": 0.0, "host_group_s": 0.0, "host_dp_group_s": 0.0}
    gpu_s = np.array([c.report(**off).gpu_step_time_s for c in cases])
    sync = np.array([c.report().topology.host_sync_s if c.counts == "device" else 0.0 for c in cases])
    m = np.array([c.median_ms * 1e-3 for c in cases])
    grid = np.arange(0, 8e-3 + 1e-9, 50e-6)
    S, G, D = np.meshgrid(grid, grid[:41], grid[:61], indexing="ij", sparse=True)  # G <= 2 ms, D <= 3 ms
    worst, squares = 0.0, 0.0
    for k, c in enumerate(cases):
        host = np.max([S + G * a + D * b for a, b in _host_groups(c)], axis=0) + sync[k]
        rel = (np.maximum(gpu_s[k], host) - m[k]) / m[k]
        worst, squares = np.maximum(worst, np.abs(rel)), squares + rel**2
    best = worst <= np.min(worst) + 0.005  # within half a percent of the least worst error
    i, j, k = np.unravel_index(np.argmin(np.where(best, squares, np.inf)), worst.shape)
    fit = {"host_step_s": float(grid[i]), "host_group_s": float(grid[j]), "host_dp_group_s": float(grid[k])}
    lines = [f"{gpu}: " + ", ".join(f"{f.removesuffix('_s')} {v * 1e3:.2f} ms" for f, v in fit.items())]
    for c in cases:
        before, after = c.report().step_time_s * 1e3, c.report(**fit).step_time_s * 1e3
        lines.append(
            f"{c.world} x {c.gpu} {c.label:24s} measured {c.median_ms:6.2f} ms  predicted {before:6.2f} "
            f"({before / c.median_ms - 1:+.1%}) -> {after:6.2f} ({after / c.median_ms - 1:+.1%})"
        )
    return fit, lines


@contextmanager
def raw_id_bytes(value: float) -> Iterator[None]:
    """The cost model with cost.RAW_ID_BYTES set to `value` inside the block (restored after)."""
    old = cost.RAW_ID_BYTES
    cost.RAW_ID_BYTES = value
    try:
        yield
    finally:
        cost.RAW_ID_BYTES = old


def raw_breakdown(case: MeasuredCase) -> list[str]:
    """The prediction of a raw-id case split into the static tables' step (the same plan with static ids) and the
    remap's terms on the slowest rank (ms): per id, per row (LRU order / LFU sort), reset, the lookup groups'
    launches (RAW_KERNELS * kernel_s each)."""
    import numpy as np

    static = replace(case, tables=tuple(replace(t, ids="index") for t in case.tables), ids="static")
    report = case.report()
    topo = report.topology
    model = cost.CostModel(topo, case.batch, FusedOptimizerConfig("rowwise_adagrad", lr=0.01))
    terms = {"ids": np.zeros(case.world), "rows": np.zeros(case.world), "reset": np.zeros(case.world)}
    groups = set()
    by_name = {t.name: t for t in case.tables}
    for tp in case.plan.tables:
        one = cost.TableStats.one(by_name[tp.table])
        for sh in tp.shards:
            n, _ = model.volumes(one, tp.sharding_type, float(sh.num_rows))
            rb = sh.num_cols * one.elem
            parts = model.raw_terms(one, tp.tier, n, float(sh.num_rows), rb, model.state_bytes(sh.num_cols))
            for k, v in parts.items():
                terms[k][sh.rank] += float(one.raw * v)
            if one.raw:
                groups.add((tp.sharding_type, tp.tier, tp.kernel, sh.rank))
    launches = np.zeros(case.world)
    for *_, r in groups:
        launches[r] += cost.RAW_KERNELS * topo.kernel_s
    r = max(range(case.world), key=lambda k: report.ranks[k].time_s)
    s_ms = static.report().gpu_step_time_s * 1e3  # the GPUs' time: the static step's host floor is not a term
    ms = {k: v[r] * 1e3 for k, v in terms.items()}
    remap = sum(ms.values()) + launches[r] * 1e3
    return [
        f"{case.world} x {case.gpu} {case.label}: predicted {report.step_time_s * 1e3:.2f} ms = static tables "
        f"{s_ms:.2f} + remap {remap:.2f} (rank {r}: ids {ms['ids']:.2f} [{cost.RAW_ID_BYTES:g} B/id], rows "
        f"{ms['rows']:.2f} [{cost.RAW_ROW_BYTES} B/row], reset {ms['reset']:.2f}, launches {launches[r] * 1e3:.2f} "
        f"[{cost.RAW_KERNELS} x {topo.kernel_s * 1e6:g} us per group]); measured {case.median_ms:.2f} "
        f"({report.step_time_s * 1e3 / case.median_ms - 1:+.1%})"
    ]


def fit_raw_id_bytes(cases: list[MeasuredCase]) -> tuple[float, list[str]]:
    """Refit cost.RAW_ID_BYTES (the remap's time per id, as bytes at the copy bandwidth) to the raw-id cases, the
    other constants as they are (the static ones fitted to the static cases), by least squares on the relative
    errors (the prediction is linear in it while the slowest rank stays the same). Returns the value and the
    table before -> after."""
    raw = [c for c in cases if c.ids == "raw"]
    if not raw:
        raise ValueError('no raw-id case ("ids": "raw") to fit RAW_ID_BYTES to')
    probe = 1000.0
    with raw_id_bytes(0.0):
        base = [c.report().gpu_step_time_s for c in raw]
    with raw_id_bytes(probe):
        slope = [(c.report().gpu_step_time_s - b) / probe for c, b in zip(raw, base, strict=True)]
    num = sum((c.median_ms * 1e-3 - b) * s / (c.median_ms * 1e-3) ** 2 for c, b, s in zip(raw, base, slope))
    den = sum(s * s / (c.median_ms * 1e-3) ** 2 for c, s in zip(raw, slope, strict=True))
    fitted = num / den
    lines = [f"raw_id_bytes {cost.RAW_ID_BYTES:g} -> {fitted:.0f} B/id (raw-id cases; the other constants as they are)"]
    for c, b, s in zip(raw, base, slope, strict=True):
        before, after = c.report().step_time_s * 1e3, (b + fitted * s) * 1e3
        lines.append(
            f"{c.world} x {c.gpu} {c.label} measured {c.median_ms:6.2f} ms  predicted {before:6.2f} "
            f"({before / c.median_ms - 1:+.1%}) -> {after:6.2f} ({after / c.median_ms - 1:+.1%})"
        )
    return float(fitted), lines
