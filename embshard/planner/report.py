"""PlanReport: what the planner predicts for a plan (memory per rank and tier, step time per phase and rank, per
table costs and the planner's reasons), printable and saved apart from the ShardingPlan, which stays the contract
with the distributed module."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embshard.planner.loads import PHASES
from embshard.planner.memory import Storage
from embshard.planner.settings import PlannerSettings
from embshard.planner.step_choice import GraphChoice
from embshard.planner.topology import GIB, Topology
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan, ranks_text


@dataclass(frozen=True)
class TableReport:
    """One table's placement and predicted cost."""

    name: str
    rows: int
    dim: int
    sharding: str
    tier: str
    ranks: tuple[int, ...]
    cache_load_factor: float | None
    hbm_bytes: float
    """GPU memory over all its shards (bytes)."""
    ddr_bytes: float
    """Host memory over all its shards (bytes)."""
    time_s: float
    """Step time the table would take alone with this placement (s), fixed costs excluded."""
    notes: tuple[str, ...] = ()
    """Why the planner placed it so."""
    kernel: str = "fbgemm"
    """Lookup kernel of its shards: fbgemm, or small (embshard's small-table kernel)."""


@dataclass(frozen=True)
class RankReport:
    """One rank's memory and predicted time."""

    rank: int
    time_s: float
    """Its own busy time per step (s)."""
    phase_s: tuple[float, ...]
    """Busy time per phase (loads.PHASES)."""
    storage: Storage
    """Embedding memory on the rank by tier and kind (bytes)."""
    hbm_budget: float
    """GPU memory embeddings may use (bytes)."""
    ddr_budget: float
    """Host memory embeddings may use (bytes)."""
    batch_buffers: float = 0.0
    """The rank's own batch buffers, any plan (bytes; GPU memory, host memory on CPU)."""
    hbm_reserve: float = 0.0
    """GPU memory kept for the dense model and activations (bytes)."""
    host_s: float = 0.0
    """The host's time to issue this rank's eager step (s; predict.host_times); 0 when not priced."""

    @property
    def peak_hbm(self) -> float:
        """Predicted peak GPU memory of the sharded embeddings on this rank (bytes): the shards' weights, state and
        caches, every buffer their step allocates (ids, backward workspace, pooled rows, data-parallel gradients)
        and the rank's own batch buffers; the dense model and the CUDA context are not included."""
        return float(self.storage.hbm) + (self.batch_buffers if self.hbm_budget or self.storage.hbm else 0.0)

    @property
    def over_budget(self) -> bool:
        """Whether the predicted peak exceeds what embeddings may use (capacity - reserve), GPU or host memory."""
        return float(self.storage.hbm) > self.hbm_budget + 1 or float(self.storage.ddr) > self.ddr_budget + 1


@dataclass
class PlanReport:
    """Predictions for one plan."""

    plan: ShardingPlan
    topology: Topology
    batch_size: int
    optimizer: FusedOptimizerConfig
    settings: PlannerSettings
    step_time_s: float
    """Predicted step time of the embedding part (s): the GPUs' time (`gpu_step_time_s`), or the host's where it
    issues an eager step slower (`host_step_time_s`)."""
    phase_s: tuple[float, ...]
    """Slowest rank's time per phase (s)."""
    ranks: list[RankReport]
    tables: list[TableReport]
    loads: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    """[resource rows, ranks] (loads.py)."""
    planner_seconds: float | None = None
    """Time the planner took (s)."""
    gpu_step_time_s: float = 0.0
    """The step as the GPUs run it (s): sum over phases of the slowest rank (what the search minimises)."""
    host_step_time_s: float = 0.0
    """The slowest rank's host time to issue an eager step (s; topology host_step_s, host_group_s,
    host_dp_group_s); 0 when not priced (a CUDA graph replay, CPUs, a topology without host constants)."""
    search_step_time_s: float | None = None
    """Step time the search computed incrementally; equals gpu_step_time_s (a consistency check); None when the
    planner switched the table-row-wise exchange after the search (the search priced the other one)."""
    table_configs: tuple = ()
    """The TableConfigs planned (for explain)."""
    constraints: dict = field(default_factory=dict)
    """Per-table ParameterConstraints used (for explain)."""
    exchange_step_s: dict[str, float] = field(default_factory=dict)
    """Table-row-wise tables on several hosts: the predicted step time (s) under each output exchange, flat and
    hierarchical, for this placement (the plan's is `plan.table_row_wise_exchange`); empty otherwise."""
    exchange_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """With exchange_step_s: bytes the table-row-wise output exchange moves per step and direction, summed over
    the ranks, under each exchange: {"flat": {"intra_host": ..., "cross_host": ...}, "hierarchical": ...}."""
    graph_choice: GraphChoice | None = None
    """settings.whole_step_graph auto (training.cuda_graph auto on GPUs): the whole-step graph's plan against the
    eager step's, both predicted, and which this plan is (step_choice.py); None otherwise."""

    def table(self, name: str) -> TableReport:
        """The report of one table."""
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r} in the plan; tables: {[t.name for t in self.tables][:20]}")

    def step_with_dense_s(self, after_s: float, dense_graphed: bool) -> float:
        """The training step (s) with `after_s` more GPU work after the embedding step (the dense part, its
        all-reduce, a replica sync). The GPUs run it after the embedding step's operators. The host issues them as
        one CUDA graph replay where `dense_graphed` (the dense-step graph of the eager step that training.cuda_graph
        auto runs, or the whole-step graph), so the host's time to issue an eager embedding step hides that much of
        it; otherwise the host issues the dense operators too, and the step adds it to the host's time."""
        if dense_graphed:
            return max(self.host_step_time_s, self.gpu_step_time_s + after_s)
        return self.step_time_s + after_s

    @property
    def slowest_rank(self) -> int:
        """Rank with the largest own time."""
        return max(self.ranks, key=lambda r: (r.time_s, -r.rank)).rank

    @property
    def peak_hbm(self) -> float:
        """Largest predicted peak GPU memory of any rank (bytes; RankReport.peak_hbm)."""
        return max(r.peak_hbm for r in self.ranks)

    @property
    def over_budget(self) -> list[int]:
        """Ranks whose predicted memory exceeds their budget (a loaded plan; planned ones never do)."""
        return [r.rank for r in self.ranks if r.over_budget]

    # ---- text ---------------------------------------------------------------------------------------------
    def summary(self) -> str:
        """A few lines: step time, phases, memory peaks."""
        phases = ", ".join(f"{name} {t * 1e3:.3f}" for name, t in zip(PHASES, self.phase_s) if t > 0)
        lines = [
            f"predicted step time {self.step_time_s * 1e3:.3f} ms (embedding part; batch {self.batch_size} per rank, "
            f"{self.optimizer.kind.value}); slowest rank {self.slowest_rank}",
            f"  per phase (ms, slowest rank each): {phases}",
            self._memory_line(),
            f"  topology: {self.topology.describe()}",
        ]
        if self.topology.is_gpu:
            lines.append(self.step_line())
        if self.graph_choice is not None:
            lines.append(self.graph_choice.line())
        if self.exchange_step_s:
            lines.append(self.exchange_line())
        if self.over_budget:
            lines.append(
                f"  OVER BUDGET on rank(s) {self.over_budget}: the step would need more memory than the budget "
                "(weights, state, caches and step buffers against capacity - reserve)"
            )
        if self.planner_seconds is not None:
            lines.append(f"  planned in {self.planner_seconds:.3f} s")
        return "\n".join(lines)

    def step_line(self) -> str:
        """How the step is priced on GPUs: as one CUDA graph replay (settings.whole_step_graph), or eager: the
        GPUs' time, or the host's where it issues the step slower (the topology's host constants)."""
        if self.settings.whole_step_graph is True:
            return "  step: one CUDA graph replay (the host's work per operator and bag not charged)"
        graph = (
            "the whole-step CUDA graph (training.cuda_graph with graph_scope step; planner.settings.whole_step_graph) "
            "takes the host away"
        )
        if self.host_step_time_s <= 0:
            return (
                "  step: eager; priced as the GPU runs it: where the host issues a step slower (many small kernels, a "
                f"slow host), the step waits for the host, which this topology does not price; {graph}"
            )
        bound = "the host's" if self.host_step_time_s > self.gpu_step_time_s else "the GPUs'"
        return (
            f"  step: eager; the GPUs run it in {self.gpu_step_time_s * 1e3:.3f} ms, the host issues it in "
            f"{self.host_step_time_s * 1e3:.3f} ms (slowest rank): {bound} time is the step's; {graph}"
        )

    def exchange_line(self) -> str:
        """The table-row-wise output exchange: the plan's, and both exchanges' predicted step times and bytes per
        level (empty when the plan has no table-row-wise table on several hosts of several ranks)."""
        if not self.exchange_step_s:
            return ""
        mine = self.plan.table_row_wise_exchange.value
        parts = []
        for name in sorted(self.exchange_step_s, key=lambda n: n != mine):
            b = self.exchange_bytes.get(name, {})
            parts.append(
                f"{name} {self.exchange_step_s[name] * 1e3:.3f} ms ({_b(b.get('intra_host', 0))} inside hosts, "
                f"{_b(b.get('cross_host', 0))} between hosts per step and direction)"
            )
        return f"  table-row-wise exchange: {mine}; predicted step: " + "; ".join(parts)

    def _memory_line(self) -> str:
        r0 = self.ranks[0]
        host = max(float(r.storage.ddr) for r in self.ranks)
        if not self.topology.is_gpu:
            return f"  host memory: largest rank {_b(host)} of {_b(r0.ddr_budget)} embedding budget"
        shards = max(float(r.storage.hbm) for r in self.ranks)
        steps = max(float(r.storage.hbm_buffers) for r in self.ranks)
        return (
            f"  GPU memory: largest rank {_b(shards)} (of which up to {_b(steps)} step buffers) of "
            f"{_b(r0.hbm_budget)} embedding budget, + {_b(r0.batch_buffers)} own batch buffers = peak "
            f"{_b(self.peak_hbm)} of {_b(r0.hbm_budget + r0.batch_buffers)} ({_b(r0.hbm_reserve)} more kept for the "
            f"dense model); host memory: largest rank {_b(host)} of {_b(r0.ddr_budget)}"
        )

    def format_tables(self) -> str:
        """One line per table."""
        kernels = any(t.kernel != "fbgemm" for t in self.tables)  # a kernel column when any table is not FBGEMM's
        rows = [("table", "rows x dim", "sharding", "tier", *(("kernel",) * kernels), "ranks", "GPU mem", "host mem")]
        rows[0] += ("alone ms", "why")
        for t in self.tables:
            tier = t.tier + (f"({t.cache_load_factor:g})" if t.cache_load_factor is not None else "")
            why = t.notes[-1] if t.notes else ""
            rows.append(
                (
                    t.name,
                    f"{t.rows}x{t.dim}",
                    t.sharding,
                    tier,
                    *((t.kernel,) * kernels),
                    ranks_text(t.ranks),
                    _b(t.hbm_bytes),
                    _b(t.ddr_bytes),
                    f"{t.time_s * 1e3:.3f}",
                    why[:70],
                )
            )
        return _columns(rows)

    def format_ranks(self) -> str:
        """One line per rank: memory by tier and kind, predicted time and its largest phase."""
        gpu = self.topology.is_gpu
        head = ["rank", "time ms", "largest phase"]
        if gpu:
            head += ["GPU: weights+state", "cache", "buffers", "total / budget"]
        head += ["host: weights+state", "total / budget"]
        rows = [tuple(head)]
        for r in self.ranks:
            s = r.storage
            big = int(np.argmax(r.phase_s))
            row = [str(r.rank), f"{r.time_s * 1e3:.3f}", f"{PHASES[big]} {r.phase_s[big] * 1e3:.3f}"]
            if gpu:
                row += [
                    _b(s.hbm_weights + s.hbm_state),
                    _b(s.hbm_cache),
                    _b(s.hbm_buffers),
                    f"{_b(s.hbm)} / {_b(r.hbm_budget)} ({100 * s.hbm / max(r.hbm_budget, 1):.0f}%)",
                ]
            row += [_b(s.ddr_weights + s.ddr_state), f"{_b(s.ddr)} / {_b(r.ddr_budget)}"]
            rows.append(tuple(row))
        return _columns(rows)

    def __str__(self) -> str:
        return "\n\n".join([str(self.plan), self.format_tables(), self.format_ranks(), self.summary()])

    # ---- data ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (the plan itself under 'plan')."""
        return {
            "step_time_ms": self.step_time_s * 1e3,
            "phase_ms": {n: t * 1e3 for n, t in zip(PHASES, self.phase_s)},
            "peak_hbm_gib": self.peak_hbm / GIB,
            "over_budget_ranks": self.over_budget,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer.kind.value,
            "planner_seconds": self.planner_seconds,
            "table_row_wise_exchange": {
                "plan": self.plan.table_row_wise_exchange.value,
                "step_ms": {k: v * 1e3 for k, v in self.exchange_step_s.items()},
                "bytes": self.exchange_bytes,
            },
            "graph_choice": None if self.graph_choice is None else self.graph_choice.to_dict(),
            "topology": self.topology.to_dict(),
            "ranks": [
                {
                    "rank": r.rank,
                    "time_ms": r.time_s * 1e3,
                    "phase_ms": [x * 1e3 for x in r.phase_s],
                    "hbm_gib": {k: float(v) / GIB for k, v in vars(r.storage).items() if k.startswith("hbm")},
                    "ddr_gib": {k: float(v) / GIB for k, v in vars(r.storage).items() if k.startswith("ddr")},
                    "peak_hbm_gib": r.peak_hbm / GIB,
                    "batch_buffers_gib": r.batch_buffers / GIB,
                    "hbm_budget_gib": r.hbm_budget / GIB,
                    "ddr_budget_gib": r.ddr_budget / GIB,
                }
                for r in self.ranks
            ],
            "tables": [
                {
                    "name": t.name,
                    "sharding": t.sharding,
                    "tier": t.tier,
                    "kernel": t.kernel,
                    "ranks": list(t.ranks),
                    "hbm_gib": t.hbm_bytes / GIB,
                    "ddr_gib": t.ddr_bytes / GIB,
                    "alone_ms": t.time_s * 1e3,
                    "notes": list(t.notes),
                }
                for t in self.tables
            ],
            "plan": self.plan.to_dict(),
        }

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        """Write as JSON (.json) or YAML."""
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(self.to_json())
        else:
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _b(x: float) -> str:
    x = float(x)
    if x >= GIB:
        return f"{x / GIB:.2f} GiB"
    if x >= 1 << 20:
        return f"{x / (1 << 20):.1f} MiB"
    if x > 0:
        return f"{x / 1024:.1f} KiB"
    return "0"


def _columns(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
