"""The plan of a training job: its config's `planner:` section (PlannerConfig) says where the plan comes from, a
saved file (plan_file), the search (strategy auto: search.py on the topology of topology_file or of this machine) or
the simple placement (strategy simple: simple.py), and `plan_for_job` makes it, checked against the tables.

The section is the planner's own dataclass, as its constraints and settings are: the training config
(embshard.config) composes it, and the planner never imports the config package, which sits above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from embshard.planner.constraints import ParameterConstraints, resolve_constraints
from embshard.planner.dense import DenseSpec, dense_allreduce_s, dense_compute_s
from embshard.planner.errors import PlanningError
from embshard.planner.predict import predict
from embshard.planner.report import PlanReport
from embshard.planner.search import plan_with_report
from embshard.planner.settings import PlannerSettings
from embshard.planner.simple import simple_plan
from embshard.planner.step_choice import GraphChoice
from embshard.planner.topology import Topology
from embshard.spec.graph_rules import plan_refusal
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import GRAPH_SHARDING_TYPES, MemoryTier, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, FieldError, TableConfig, validate_tables


@dataclass(frozen=True)
class PlannerConfig:
    """How the sharding plan is made: a saved plan file, the planner (strategy auto, docs/planner.md) or the simple
    table-wise placement (strategy simple)."""

    strategy: Literal["auto", "simple"] = "auto"
    """auto: the cost-model planner (embshard.planner) picks sharding type, tier and ranks per table; simple: the
    greedy placement of embshard.planner.simple (table-wise unless constrained; for tests and debugging)."""
    plan_file: str | None = None
    """Load this saved ShardingPlan (YAML or JSON, from `embshard plan --out` or ShardingPlan.save) instead of
    planning; strategy and the other planner keys are then not used."""
    topology_file: str | None = None
    """auto: plan for the machine described in this topology YAML (from `embshard calibrate`), with the job's rank
    counts; unset: read this machine (GPU model and memory, host memory)."""
    hbm_gib: float | None = None
    """auto: GPU memory per rank to plan for (GiB); unset: the topology's (detected: the GPU's total memory)."""
    ddr_gib: float | None = None
    """auto: host memory per rank to plan for (GiB); unset: the topology's (detected: host memory / local ranks)."""
    settings: PlannerSettings = field(default_factory=PlannerSettings)
    """auto: planner settings, e.g. hbm_reserve_gib (GPU memory per rank kept for the dense model, GiB)."""
    tier: MemoryTier | None = None
    """simple: memory tier of every table without a tiers constraint; unset: host on CPU, hbm on GPU."""
    column_shards: int | None = None
    """simple: column blocks per column-wise table (count); unset: 2."""
    constraints: dict[str, ParameterConstraints] | None = None
    """Per-table constraints and hints, keyed by table name or glob pattern (t_*); simple honours only the first
    sharding type, the first tier and the first rank."""

    def __post_init__(self) -> None:
        if self.column_shards is not None and self.column_shards < 1:
            raise FieldError("column_shards", self.column_shards, "it must be >= 1")
        if self.hbm_gib is not None and not self.hbm_gib > 0:
            raise FieldError("hbm_gib", self.hbm_gib, "it must be > 0 GiB (or unset: detect)")
        if self.ddr_gib is not None and not self.ddr_gib > 0:
            raise FieldError("ddr_gib", self.ddr_gib, "it must be > 0 GiB (or unset: detect)")
        if self.plan_file is not None:
            return
        if self.strategy == "auto":
            for key in ("tier", "column_shards"):
                if getattr(self, key) is not None:
                    raise FieldError(
                        key,
                        getattr(getattr(self, key), "value", getattr(self, key)),
                        f"{key} is a setting of strategy simple; with strategy auto use planner.settings.tiers / "
                        "planner.constraints.<table>.tiers (or column_shards there), or set planner.strategy=simple",
                    )
        else:
            for key in ("topology_file", "hbm_gib", "ddr_gib"):
                if getattr(self, key) is not None:
                    raise FieldError(key, getattr(self, key), "it is a setting of strategy auto, not simple")
            default = PlannerSettings()
            changed = {f.name: getattr(self.settings, f.name) for f in fields(default)}
            changed = {k: v for k, v in changed.items() if v != getattr(default, k)}
            if changed:
                raise FieldError("settings", changed, "planner settings apply to strategy auto, not simple")


def settings_for_lookup(settings: PlannerSettings, lookup) -> PlannerSettings:
    """`settings` with `pooled_bytes` taken from a job's lookups (`LookupOptions.output_dtype`: 4 for fp32, 2 for
    fp16/bf16) where the config leaves it unset: the plan is priced as the job will run."""
    if settings.pooled_bytes is not None:
        return settings
    fp32 = getattr(lookup.output_dtype, "value", lookup.output_dtype) in ("fp32", "auto")  # auto unresolved: fp32
    return replace(settings, pooled_bytes=4 if fp32 else 2)


def settings_for_counts(settings: PlannerSettings, batch_counts: str | None) -> PlannerSettings:
    """`settings` with `batch_counts` taken from a job (TrainConfig.batch_counts: 'host' under training.pipeline
    sparse_dist / semi_sync, 'device' under none, with lookup.bounds_check drop or a retrieval catalog) where the
    config leaves it unset: the step is priced with the device sync only where it runs one."""
    if settings.batch_counts is not None or batch_counts is None:
        return settings
    return replace(settings, batch_counts=batch_counts)


def settings_for_graph(settings: PlannerSettings, whole_step_graph: bool | Literal["auto"]) -> PlannerSettings:
    """`settings` with `whole_step_graph` taken from a job (whether its training step is captured whole:
    training.cuda_graph with graph_scope step on CUDA GPUs; "auto": training.cuda_graph auto, the faster of the
    two) where the config leaves it unset."""
    if settings.whole_step_graph is not None:
        return settings
    return replace(settings, whole_step_graph=whole_step_graph)


def graph_settings(settings: PlannerSettings) -> PlannerSettings | str:
    """`settings` narrowed to the options a whole-step CUDA graph can hold (`GRAPH_SHARDING_TYPES`, no UVM caching),
    within what `settings` already allows; a string saying why when it allows none of them."""
    types = tuple(t for t in (settings.sharding_types or tuple(ShardingType)) if t in GRAPH_SHARDING_TYPES)
    tiers = tuple(t for t in (settings.tiers or tuple(MemoryTier)) if t is not MemoryTier.UVM_CACHING)
    if not types or not tiers:  # an empty tuple would mean "every option"
        return (
            f"planner.settings allow sharding types {[t.value for t in settings.sharding_types]} and tiers "
            f"{[t.value for t in settings.tiers]}, none of which the graph holds"
        )
    return replace(settings, sharding_types=types, tiers=tiers)


def search_plan(
    tables: Sequence[TableConfig],
    topo: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    constraints: dict[str, ParameterConstraints] | None,
    settings: PlannerSettings,
    say: Callable[[str], None] | None = None,
    dense: DenseSpec | None = None,
) -> tuple[ShardingPlan, PlanReport]:
    """The search's (plan, report); with settings.whole_step_graph, first among the options a whole-step graph can
    hold (`graph_settings`), then, if none of those fits, among all (`say` gets why); with whole_step_graph auto on
    GPUs, both ways, the faster kept (`_graph_or_eager`: the report's graph_choice says which), each step priced
    with the dense part of `dense` (the training config's dense model, its compute and gradient all-reduce; None:
    the embedding step alone). An eager plan whose step the host sets and whose data-parallel tables cost the host
    most is planned again without them, and the faster kept (`_without_replicas_if_faster`)."""
    tables = validate_tables(tables)  # once for every search below

    def search(s: PlannerSettings) -> tuple[ShardingPlan, PlanReport]:
        return plan_with_report(tables, topo, batch_size, optimizer, constraints, s)

    if settings.whole_step_graph == "auto":
        if topo.is_gpu:
            dense_s = (
                0.0 if dense is None else dense_compute_s(dense, topo, batch_size) + dense_allreduce_s(dense, topo)
            )
            return _graph_or_eager(tables, topo, batch_size, optimizer, constraints, settings, search, say, dense_s)
        settings = replace(settings, whole_step_graph=False)  # CPUs run no CUDA graph

    if settings.whole_step_graph:
        narrowed = graph_settings(settings)
        why = narrowed if isinstance(narrowed, str) else None
        if why is None:
            try:
                return search(narrowed)
            except (PlanningError, ConfigError) as e:
                why = str(e).strip().splitlines()[0]
        (say or (lambda _text: None))(
            "planner: no plan that the whole-step CUDA graph can hold fits (table_wise, column_wise and data_parallel "
            f"tables, no uvm_caching): {why}; planning with every option, so the step runs without "
            "the whole-step graph"
        )
        settings = replace(settings, whole_step_graph=False)  # the step runs eagerly: priced so
    return _without_replicas_if_faster(search(settings), settings, search, say)


def _graph_or_eager(
    tables: Sequence[TableConfig],
    topo: Topology,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    constraints: dict[str, ParameterConstraints] | None,
    settings: PlannerSettings,
    search: Callable[[PlannerSettings], tuple[ShardingPlan, PlanReport]],
    say: Callable[[str], None] | None,
    dense_s: float = 0.0,
) -> tuple[ShardingPlan, PlanReport]:
    """settings.whole_step_graph auto on GPUs: the best plan the whole-step graph holds, priced as one replay, and
    the best plan with every option, priced as an eager step (the host's floor included), each with the dense
    part's `dense_s` of GPU time after the embedding step (`PlanReport.step_with_dense_s`: an eager step runs it as
    the dense-step graph's replay); the faster is kept, and its report's `graph_choice` says which and why. An eager
    winner that the graph holds as well is priced as a replay (it runs graphed). Without a graph plan that fits, the
    eager plan (as `search_plan` with whole_step_graph true)."""
    narrowed = graph_settings(settings)
    why = narrowed if isinstance(narrowed, str) else None
    graphed = None
    if why is None:
        try:
            graphed = search(replace(narrowed, whole_step_graph=True))
        except (PlanningError, ConfigError) as e:
            why = str(e).strip().splitlines()[0]
    eager_settings = replace(settings, whole_step_graph=False)
    try:
        eager = _without_replicas_if_faster(search(eager_settings), eager_settings, search, say)
    except (PlanningError, ConfigError):
        if graphed is None:
            raise
        eager = None
    same = False
    if eager is not None and plan_refusal(tables, eager[0]) is None:  # the graph holds it: replayed, it may win
        notes = {t.name: t.notes for t in eager[1].tables}
        replayed = replace(settings, whole_step_graph=True)
        report = predict(eager[0], tables, topo, batch_size, optimizer, constraints, replayed, notes)
        if graphed is None or report.step_time_s < graphed[1].step_time_s:
            graphed, same = (eager[0], report), True
    eager_s = None if eager is None else eager[1].step_with_dense_s(dense_s, dense_graphed=True)
    if graphed is None:
        choice = GraphChoice(False, None, eager_s, why_no_graph=why or "", dense_step_s=dense_s)
    else:
        graph_s = graphed[1].step_with_dense_s(dense_s, dense_graphed=True)
        faster = eager_s is None or graph_s <= eager_s
        choice = GraphChoice(faster, graph_s, eager_s, same, dense_step_s=dense_s)
    plan, report = graphed if choice.graph else eager
    report.graph_choice = choice
    return plan, report


def _without_replicas_if_faster(
    planned: tuple[ShardingPlan, PlanReport],
    settings: PlannerSettings,
    search: Callable[[PlannerSettings], tuple[ShardingPlan, PlanReport]],
    say: Callable[[str], None] | None,
) -> tuple[ShardingPlan, PlanReport]:
    """An eager step the host sets, whose plan has data-parallel tables: the search prices the GPUs' time alone,
    where a data-parallel lookup group costs the host most (topology host_dp_group_s); the same search without
    data-parallel tables (`search` with those settings), kept when its predicted step is shorter (`say` gets both)."""
    plan, report = planned
    has_dp = any(tp.sharding_type is ShardingType.DATA_PARALLEL for tp in plan.tables)
    if not has_dp or report.host_step_time_s <= report.gpu_step_time_s:
        return planned
    types = tuple(t for t in (settings.sharding_types or tuple(ShardingType)) if t is not ShardingType.DATA_PARALLEL)
    if not types:  # an empty tuple would mean "every type"
        return planned
    try:
        alt = search(replace(settings, sharding_types=types))
    except (PlanningError, ConfigError):
        return planned
    if alt[1].step_time_s >= report.step_time_s:
        return planned
    (say or (lambda _text: None))(
        f"planner: the eager step's host sets it ({report.host_step_time_s * 1e3:.2f} ms against the GPUs' "
        f"{report.gpu_step_time_s * 1e3:.2f} ms) and its data-parallel tables cost the host most: planned without "
        f"them, predicted {alt[1].step_time_s * 1e3:.2f} ms a step against {report.step_time_s * 1e3:.2f}"
    )
    return alt


def plan_for_job(
    tables: Sequence[TableConfig],
    planner_cfg: PlannerConfig,
    world_size: int,
    local_world_size: int,
    device_type: str,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    log: Callable[[str], None] | None = None,
    lookup=None,
    batch_counts: str | None = None,
    whole_step_graph: bool | Literal["auto"] = False,
    on_report: Callable[[PlanReport], None] | None = None,
    dense: DenseSpec | None = None,
) -> ShardingPlan:
    """The sharding plan (checked against `tables`): loaded from planner.plan_file, else made by the planner
    (strategy auto: the search on the topology of planner.topology_file or of this machine, for `batch_size`
    samples per rank and the sparse `optimizer`), else by the simple placement (strategy simple: each table's first
    allowed sharding type, tier and rank, planner.tier and planner.column_shards for the rest). `log` gets the
    plan and, for auto, the predicted memory and time per rank and the predicted step time. `lookup`: the job's
    LookupOptions, whose output dtype prices the pooled rows unless planner.settings.pooled_bytes is set
    (`settings_for_lookup`); `batch_counts`: where the job's steps take their batch counts from
    (TrainConfig.batch_counts, 'host' or 'device'), which says whether the step pays the device sync, unless
    planner.settings.batch_counts is set (`settings_for_counts`); `whole_step_graph`: the job captures its whole
    step as one CUDA graph, so a plan that the graph can hold is looked for first ("auto": both ways, the faster
    kept, each step priced with the dense part of `dense`, the job's dense model), unless
    planner.settings.whole_step_graph is set (`settings_for_graph`); `on_report` gets the search's PlanReport
    (not called for a loaded or simple plan). Deterministic; a training job still makes it on rank 0 only and
    broadcasts it (train.plan_on_rank0)."""
    say = log or (lambda _text: None)
    tables = validate_tables(tables)  # once: the planner and the plan's checks take these Tables as they are
    if planner_cfg.plan_file:
        plan = ShardingPlan.load(planner_cfg.plan_file)
        if (plan.world_size, plan.local_world_size) != (world_size, local_world_size):
            raise ConfigError(
                f"planner.plan_file={planner_cfg.plan_file!r} is a plan for world_size={plan.world_size}, "
                f"local_world_size={plan.local_world_size}, but this job has {world_size} and {local_world_size}: "
                "re-plan for this job (`embshard plan CONFIG --world-size N --out FILE`), or leave plan_file unset"
            )
        plan.check(tables)
        say(f"plan loaded from {planner_cfg.plan_file}")
        say(str(plan))
        return plan
    if planner_cfg.strategy == "simple":
        try:
            constraints = resolve_constraints(tables, planner_cfg.constraints, world_size)
        except ConfigError as e:
            raise ConfigError(f"planner.{e}") from None
        tier = planner_cfg.tier or (MemoryTier.HOST if device_type == "cpu" else MemoryTier.HBM)
        columns = planner_cfg.column_shards or 2
        plan = simple_plan(
            tables, world_size, local_world_size, tier=tier, column_shards=columns, constraints=constraints
        )
        say(str(plan))
        return plan
    topo = topology_for(planner_cfg, world_size, local_world_size, device_type)
    try:
        settings = settings_for_lookup(planner_cfg.settings, lookup) if lookup is not None else planner_cfg.settings
        settings = settings_for_graph(settings_for_counts(settings, batch_counts), whole_step_graph)
        plan, report = search_plan(tables, topo, batch_size, optimizer, planner_cfg.constraints, settings, say, dense)
    except PlanningError as e:
        raise PlanningError(
            f"planner: no sharding plan fits {topo.describe()}:\n{e}\n(in a training config: planner.hbm_gib and "
            "planner.ddr_gib set the memory per rank, planner.settings.hbm_reserve_gib the dense model's reserve, "
            "--nproc / torchrun the number of ranks, planner.constraints.<table> the allowed options)",
            e.details,
        ) from None
    except ConfigError as e:
        raise ConfigError(f"planner: {e}") from None
    plan.check(tables)
    say(str(plan))
    say(report.format_ranks())
    say(report.summary())
    if on_report is not None:
        on_report(report)
    return plan


def topology_for(
    cfg: PlannerConfig, world_size: int, local_world_size: int | None = None, device_type: str | None = None
) -> Topology:
    """The topology to plan for: planner.topology_file, else this machine (Topology.detect), with the job's rank
    counts and planner.hbm_gib / planner.ddr_gib applied. With `device_type` ('cuda' or 'cpu': where training
    computes) a topology of the other kind is an error."""
    if cfg.topology_file:
        if not Path(cfg.topology_file).is_file():
            raise ConfigError(
                f"planner.topology_file={cfg.topology_file!r} does not exist: write one with `embshard calibrate "
                "--out FILE`, or leave topology_file unset to read this machine"
            )
        topo = Topology.load(cfg.topology_file).with_sizes(world_size, local_world_size)
    else:
        topo = Topology.detect(world_size, local_world_size, device_type)
    topo = topo.with_sizes(hbm_gib=cfg.hbm_gib, ddr_gib=cfg.ddr_gib)
    if device_type is not None and topo.compute_device != device_type:
        where = f"planner.topology_file={cfg.topology_file!r}" if cfg.topology_file else "this machine"
        raise ConfigError(
            f"{where} describes {topo.compute_device} ranks, but this job computes on {device_type}: use a "
            f"topology file measured on {device_type} ranks (`embshard calibrate`), or leave topology_file unset"
        )
    return topo
