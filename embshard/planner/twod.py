"""2D sharding's group size: the tables are sharded over a group of G ranks and the W/G groups are data-parallel
replicas of each other (ShardingPlan.sharding_group_size; groups are contiguous rank ranges, so with G a multiple
of the ranks per host L the replicas of a shard sit one per host). `plan_at_scale` plans each candidate group size
with the search (search.py, on a topology of G ranks), adds what the group size changes, and keeps the fastest:

  embedding step   the search's prediction for one group (its exchanges span G ranks, (G-L)/G of them across
                   hosts; a flat plan is the group of all W ranks)
  replica sync     per rank, over the R = W/G replicas of its shards, one per host (dense.ring_allreduce_s):
                   exact     every step, the touched rows' gradients of each model-parallel shard: u_R rows of c
                             fp32 columns and their 8-byte ids, u_R = distinct rows among the R groups' n ids each
                             (access.distinct_rows; cost.py's n, r, c)
                   periodic  the shard's weights and optimizer state every replica_sync_every steps, amortized
                   data-parallel tables are replicas on every rank: their gradient all-reduce spans W ranks, not
                   G (the search priced G); the difference is added
                   the step pays its slowest rank's sync
  dense            compute and the gradient all-reduce over every rank (dense.py), the same for every candidate

Candidates: no 2D (a flat plan over W), and each divisor G of W with G a multiple of L (G < W), planned from the
largest (the flat plan) down. A group must hold the whole model: a group whose G ranks' summed GPU and host memory
budgets cannot hold the tables is skipped unplanned, and where a group cannot hold them (or the search finds no
plan that fits), no smaller group is planned; a group whose replica sync alone (`sync_floor_s`: a lower bound
without planning) plus the dense step reaches the best step so far
is not planned either; planning also stops once PATIENCE smaller groups in a row predicted slower steps than the
best (each smaller group has more replicas to synchronize, so past the best the steps
rarely fall again). A model that needs every rank's memory is thus planned once, flat, and one group below
(docs/planner.md, "Hot tables and 2D sharding").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from embshard.planner import balance
from embshard.planner.access import distinct_rows
from embshard.planner.choices import build_choices, step_floor
from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.cost import CostModel
from embshard.planner.dense import DenseSpec, dense_allreduce_s, dense_compute_s, ring_allreduce_s
from embshard.planner.errors import PlanningError
from embshard.planner.predict import budgets
from embshard.planner.report import PlanReport
from embshard.planner.search import plan_with_report
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig, validate_tables

SYNC_MODES = ("exact", "periodic")
PATIENCE = 2
"""Smaller groups planned after the best before the search over group sizes stops."""


@dataclass
class Candidate:
    """One group size, planned and priced (or skipped, with why)."""

    group_size: int
    """Ranks of one sharding group (world_size: no 2D)."""
    plan: ShardingPlan | None = None
    report: PlanReport | None = None
    """The search's report for one group (a topology of group_size ranks)."""
    embedding_s: float = 0.0
    sync_s: float = 0.0
    """Replica synchronization per step (slowest rank), data-parallel tables' wider all-reduce included."""
    dense_s: float = 0.0
    allreduce_s: float = 0.0
    skipped: str = ""
    """Why it was not planned ('' when planned)."""
    busy: list[float] = field(default_factory=list)
    """Each rank of a group: its lookups over a balanced rank's (balance.busy_shares)."""

    @property
    def step_s(self) -> float:
        """Predicted training step (s): embedding step + replica sync + dense compute + dense all-reduce; where the
        planner chose between the whole-step graph and the eager step (its report's graph_choice), the GPU work
        after the embedding step as that choice priced it (`PlanReport.step_with_dense_s`: an eager step's host time
        hides the dense-step graph's replay)."""
        after = self.sync_s + self.dense_s + self.allreduce_s
        if self.report is not None and self.report.graph_choice is not None:
            return self.report.step_with_dense_s(after, dense_graphed=True)
        return self.step_sum_s

    @property
    def step_sum_s(self) -> float:
        """The columns' sum: embedding step + replica sync + dense compute + dense all-reduce (s)."""
        return self.embedding_s + self.sync_s + self.dense_s + self.allreduce_s


@dataclass
class ScalePlan:
    """The chosen plan at scale and every candidate group size."""

    world_size: int
    local_world_size: int
    batch_size: int
    best: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    replica_sync: str = "exact"
    replica_sync_every: int = 1

    @property
    def plan(self) -> ShardingPlan:
        """The chosen plan over every rank (sharding_group_size set for 2D)."""
        return self.best.plan

    @property
    def group_size(self) -> int | None:
        """The chosen sharding_group_size (None: no 2D)."""
        return self.best.plan.sharding_group_size

    @property
    def samples_per_s_per_gpu(self) -> float:
        """Predicted training samples per second per GPU: the batch per GPU over the predicted step."""
        return self.batch_size / self.best.step_s

    def busy_shares(self, tables: Sequence[TableConfig]) -> list[float]:
        """Each rank of a group: its lookups over a balanced rank's (balance.busy_shares)."""
        return balance.busy_shares(self.best.plan, tables, self.batch_size)

    def summary(self) -> str:
        """The candidates (one line each) and the chosen group size, step time and samples/s per GPU."""
        lines = [f"group sizes on {self.world_size} ranks ({self.world_size // self.local_world_size} host(s) x "
                 f"{self.local_world_size}), replica sync {self.replica_sync}"
                 + (f" every {self.replica_sync_every} steps" if self.replica_sync == "periodic" else "") + ":"]  # fmt: skip
        lines.append("  group  embedding ms  replica sync ms  dense ms  dense all-reduce ms  step ms  samples/s/GPU")
        for c in self.candidates:
            name = "none" if c.group_size == self.world_size else str(c.group_size)
            if c.skipped:
                lines.append(f"  {name:>5}  skipped: {c.skipped}")
                continue
            mark = "  <- chosen" if c is self.best else ""
            lines.append(
                f"  {name:>5}  {c.embedding_s * 1e3:12.3f}  {c.sync_s * 1e3:15.3f}  {c.dense_s * 1e3:8.3f}  "
                f"{c.allreduce_s * 1e3:19.3f}  {c.step_s * 1e3:7.3f}  {self.batch_size / c.step_s / 1e6:11.3f} M{mark}"
            )
        overlapped = [c for c in self.candidates if not c.skipped and c.step_s < c.step_sum_s * (1 - 1e-9)]
        if overlapped:
            lines.append(
                "  (step ms below the columns' sum: an eager step's host time, its embedding ms, hides the GPU work "
                "after its embedding step, the dense-step graph's replay)"
            )
        g = self.group_size
        busy = self.best.busy
        shown = " ".join(f"{b:.2f}" for b in busy[:16]) + (f" ... ({len(busy)} ranks)" if len(busy) > 16 else "")
        lines.append(f"lookups per rank of a group over a balanced rank's: busiest {max(busy):.2f}; {shown}")
        lines.append(
            f"chosen sharding_group_size: {g if g is not None else 'none (no 2D)'}; predicted step "
            f"{self.best.step_s * 1e3:.3f} ms, {self.samples_per_s_per_gpu / 1e6:.3f} M samples/s per GPU "
            f"({self.samples_per_s_per_gpu * self.world_size / 1e6:.1f} M in all), batch {self.batch_size} per GPU"
        )
        return "\n".join(lines)


def group_sizes(world_size: int, local_world_size: int) -> list[int]:
    """Candidate group sizes, smallest first, world_size (no 2D) last: the divisors of world_size that are
    multiples of local_world_size."""
    out = [g for g in range(local_world_size, world_size, local_world_size) if world_size % g == 0]
    return [*out, world_size]


def replica_sync_s(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    topo: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    settings: PlannerSettings,
    mode: str = "exact",
    every: int = 1,
) -> float:
    """Seconds per step of the slowest rank's replica synchronization under `plan` (world topo.world_size, group
    plan.shard_world_size; module docstring), data-parallel tables' wider all-reduce included; 0 without 2D."""
    W, L = topo.world_size, topo.local_world_size
    G = plan.shard_world_size
    R = W // G
    if R <= 1:
        return 0.0
    per_host = max(1, L // G)  # replicas of one shard on a host: 1 when G is a multiple of L
    by_name = {t.name: t for t in tables}
    sync_bytes = [0.0] * G
    dp_bytes = 0.0
    for tp in plan.tables:
        t = by_name[tp.table]
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            dp_bytes += t.num_embeddings * (t.embedding_dim + 1) * 4
            continue
        per = balance.table_ids_per_sample(t) * batch_size * G
        row_split = tp.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
        alpha = settings.zipf_alpha
        for s in tp.shards:
            n = per * (s.num_rows / t.num_embeddings if row_split else 1.0)
            if mode == "exact":
                u = float(distinct_rows(R * n, s.num_rows, alpha))
                sync_bytes[s.rank] += u * (s.num_cols * 4 + 8)
            else:
                sb = optimizer.state_bytes_per_row(s.num_cols)
                sync_bytes[s.rank] += s.num_rows * (s.num_cols * t.data_type.bytes + sb) / every
    worst = max(ring_allreduce_s(b, R, per_host, topo) for b in sync_bytes)
    dp_extra = ring_allreduce_s(dp_bytes, W, L, topo) - ring_allreduce_s(dp_bytes, G, min(L, G), topo)
    return worst + max(0.0, dp_extra)


def _row_bytes(t: TableConfig, optimizer: FusedOptimizerConfig) -> int:
    """Bytes one row of `t` stores: its weights and optimizer state."""
    return t.embedding_dim * t.data_type.bytes + optimizer.state_bytes_per_row(t.embedding_dim)


def _fits(tables: Sequence[TableConfig], topo: Topology, batch_size: int, optimizer, settings) -> tuple[str, float]:
    """('' when the group's summed memory budgets can hold the tables in some tier, else why not; a rank's GPU
    memory budget in bytes)."""
    b = budgets(CostModel(topo, batch_size, optimizer, settings), tables)
    need = sum(t.num_embeddings * _row_bytes(t, optimizer) for t in tables)
    have = topo.world_size * (b.hbm + b.ddr) * settings.memory_fill
    if need > have:
        why = f"{topo.world_size} ranks hold {have / 2**30:.1f} GiB of embeddings in all, the tables need {need / 2**30:.1f} GiB"
        return why, b.hbm
    return "", b.hbm


def sync_floor_s(
    tables: Sequence[TableConfig],
    topo: Topology,
    group_size: int,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    settings: PlannerSettings,
    hbm_budget: float,
    mode: str = "exact",
    every: int = 1,
) -> float:
    """A lower bound of `replica_sync_s` over every plan of groups of `group_size`, without planning: every table's
    sync bytes but those of the tables that could be data-parallel (replicas need no sync of their own, and all of
    them must fit one rank's GPU budget `hbm_budget`: the most sync bytes per replica byte first, the last one in
    part: a fractional knapsack, which no choice of whole tables beats), spread evenly over the group's ranks (the
    slowest rank syncs at least the mean; a table's touched rows are as many whole as in row blocks, for uniform
    ids)."""
    W, L = topo.world_size, topo.local_world_size
    R = W // group_size
    if R <= 1:
        return 0.0
    total, items = 0.0, []
    for t in tables:
        D = t.embedding_dim
        if mode == "exact":
            n = balance.table_ids_per_sample(t) * batch_size * group_size
            b = float(distinct_rows(R * n, t.num_embeddings, settings.zipf_alpha)) * (D * 4 + 8)
        else:
            b = t.num_embeddings * _row_bytes(t, optimizer) / every
        total += b
        items.append((b, t.num_embeddings * (D * 4 + optimizer.state_bytes_per_row(D))))  # (sync, replica) bytes
    room = hbm_budget
    for b, replica in sorted(items, key=lambda x: -x[0] / max(x[1], 1.0)):
        if room <= 0:
            break
        share = min(1.0, room / max(replica, 1.0))
        total -= share * b
        room -= share * replica
    return ring_allreduce_s(max(0.0, total) / group_size, R, max(1, L // group_size), topo)


def embedding_floor_s(
    tables: Sequence[TableConfig],
    topo: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None,
    settings: PlannerSettings,
) -> float:
    """A lower bound of the embedding step of every plan of the tables on `topo` (one group), without placing:
    the batch's loads and each table's least work in the phases of one row, spread evenly (choices.step_floor)."""
    model = CostModel(topo, batch_size, optimizer, settings)
    items, table = build_choices(model, tables, resolve_constraints(tables, constraints, topo.world_size))
    return step_floor(model.batch_loads(tables), items, table)


def plan_at_scale(
    tables: Sequence[TableConfig],
    topology: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig | None = None,
    constraints: Mapping[str, ParameterConstraints | Mapping] | None = None,
    settings: PlannerSettings | None = None,
    dense: DenseSpec | None = None,
    replica_sync: str = "exact",
    replica_sync_every: int = 1,
    group_size: int | None = None,
    search: Callable[..., tuple[ShardingPlan, PlanReport]] | None = None,
) -> ScalePlan:
    """Choose the sharding group size and plan each table inside the group (module docstring). `dense`: the dense
    model's work (None: the embedding step alone); `group_size`: only this candidate (world_size: no 2D);
    `search`: plans one group, called as plan_with_report (the default) with the group's topology."""
    search = search or plan_with_report
    if replica_sync not in SYNC_MODES:
        raise ConfigError(f"replica_sync={replica_sync!r} is invalid: choose one of {list(SYNC_MODES)}")
    if isinstance(replica_sync_every, bool) or not isinstance(replica_sync_every, int) or replica_sync_every < 1:
        raise ConfigError(f"replica_sync_every={replica_sync_every!r} is invalid: give an integer >= 1 (steps)")
    tables = validate_tables(tables)
    optimizer = optimizer or FusedOptimizerConfig()
    settings = settings or PlannerSettings()
    W, L = topology.world_size, topology.local_world_size
    sizes = group_sizes(W, L)
    if group_size is not None:
        if group_size not in sizes:
            raise ConfigError(
                f"group size {group_size} is invalid for {W} ranks of {L} per host: choose one of {sizes} ({W}: no 2D)"
            )
        sizes = [group_size]
    dense_s = dense_compute_s(dense, topology, batch_size) if dense else 0.0
    ar_s = dense_allreduce_s(dense, topology) if dense else 0.0
    out: list[Candidate] = []
    best: Candidate | None = None
    worse = 0
    short = ""  # why the groups from here down are not planned
    for G in reversed(sizes):  # the flat plan first, then ever smaller groups
        c = Candidate(G, dense_s=dense_s, allreduce_s=ar_s)
        out.append(c)
        if short or worse >= PATIENCE:
            c.skipped = (
                short or f"{PATIENCE} larger groups in a row predicted slower steps than group {best.group_size}"
            )
            continue
        if G < W:  # a group smaller than the constraints ask for (column blocks, ranks): this size and smaller
            try:
                resolve_constraints(tables, constraints, G)
            except ConfigError as e:
                c.skipped = f"not planned: the constraints need more ranks than a group of {G}: {e}"
                short = f"the constraints need more ranks than a group of {G}, and so of fewer"
                continue
        gtopo = topology.with_sizes(G, min(L, G))
        why, hbm = _fits(tables, gtopo, batch_size, optimizer, settings) if G < W else ("", 0.0)  # W: the search's
        if not why and best is not None:
            sync = sync_floor_s(
                tables, topology, G, batch_size, optimizer, settings, hbm, replica_sync, replica_sync_every
            )
            floor, what = dense_s + ar_s + sync, "its replica sync alone"
            if floor < best.step_s:  # the embedding step's floor too (the group's choices, no placement)
                floor += embedding_floor_s(tables, gtopo, batch_size, optimizer, constraints, settings)
                what = "its replica sync and its embedding step's floor"
            if floor >= best.step_s:
                c.skipped = (
                    f"not planned: at least {floor * 1e3:.3f} ms with {what}, group "
                    f"{best.group_size} predicts {best.step_s * 1e3:.3f} ms"
                )
                worse += 1
                continue
        if not why:
            try:
                gplan, rep = search(tables, gtopo, batch_size, optimizer, constraints, settings)
            except PlanningError as e:
                if G == W:
                    raise  # nothing fits: the search's own message, with its numbers and fixes
                why = str(e).strip().splitlines()[0]
        if why:
            c.skipped = why
            short = f"a group of {G} ranks could not hold the tables, nor can a smaller one"
            continue
        kw = {"sharding_group_size": G, "replica_sync": replica_sync, "replica_sync_every": replica_sync_every}
        c.plan = replace(gplan, world_size=W, local_world_size=L, **(kw if G < W else {}))
        c.report = rep
        c.embedding_s = rep.step_time_s
        c.busy = balance.busy_shares(c.plan, tables, batch_size)
        c.sync_s = replica_sync_s(c.plan, tables, topology, batch_size, optimizer, settings, replica_sync,
                                  replica_sync_every)  # fmt: skip
        if best is None or c.step_s < best.step_s * (1 - 1e-9):
            best, worse = c, 0
        else:
            worse += 1
    out.reverse()
    if best is None:
        raise PlanningError(
            f"no sharding group size of {sizes} on {W} ranks can hold the tables: "
            + "; ".join(c.skipped for c in out)
            + " (add ranks, or give the planner more memory per rank)"  # fmt: skip
        )
    return ScalePlan(W, L, batch_size, best, out, replica_sync, replica_sync_every)
