"""The sharding group size of a training job with `sharding.group_size: auto` (2D sharding chosen by the planner):
the group-size search (planner/twod.py `plan_at_scale`) on the job's tables, batch, sparse optimizer, planner
section, dense model and replica sync, each candidate group planned by the job's search (`policy.search_plan`).
`embshard plan TRAINING_CONFIG` prices a training config with the same inputs (`job_settings`, `dense_spec`,
`group_search`), so both print the same choice for the same topology. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from embshard.planner.dense import DenseSpec, dlrm_dense
from embshard.planner.policy import (
    search_plan,
    settings_for_counts,
    settings_for_graph,
    settings_for_lookup,
    topology_for,
)
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.planner.twod import ScalePlan, plan_at_scale
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import ConfigError


def job_settings(cfg: Any) -> PlannerSettings:
    """The planner settings of a training config (a TrainConfig) as its job runs: planner.settings with
    pooled_bytes, batch_counts and whole_step_graph (`graph_request`) taken from the job where unset
    (`policy.settings_for_*`)."""
    lookup = cfg.lookup.resolved(bf16=cfg.training.precision == "bf16")  # output_dtype auto as on GPUs
    settings = settings_for_counts(settings_for_lookup(cfg.planner.settings, lookup), cfg.batch_counts)
    return settings_for_graph(settings, graph_request(cfg))


def graph_request(cfg: Any, asked: Any = None) -> bool | Literal["auto"]:
    """What a training job (a TrainConfig) asks the planner for about the whole-step CUDA graph: "auto" where
    training.cuda_graph is auto and the job would take the graph (the planner then plans both ways and keeps the
    faster: policy.search_plan), else whether it asks for the graph (`cfg.whole_step_graph`: true, or false).
    `asked`: the config with the step mode's auto settings applied (`StepMode.applied`), whose whole_step_graph
    then says whether the graph is wanted at all; default `cfg`."""
    wanted = (asked if asked is not None else cfg).whole_step_graph
    return "auto" if wanted and cfg.training.cuda_graph == "auto" else wanted


def dense_spec(cfg: Any) -> DenseSpec | None:
    """The dense part of a training config's (a TrainConfig's) DLRM or DLRM-DCNv2 model; None for planner inputs
    (cfg None) and other kinds: the prediction is then the embedding step alone."""
    if cfg is None:
        return None
    m = cfg.model
    if m.kind not in ("dlrm", "dlrm_dcnv2") or m.dlrm is None:
        return None
    syn = cfg.data.synthetic
    num_dense = syn.num_dense if syn is not None else 13
    dim = max(t.embedding_dim for t in m.tables)
    features = sum(len(t.feature_names) for t in m.tables)
    dcn = m.dcn if m.kind == "dlrm_dcnv2" else None
    layers, rank = (dcn.num_layers, dcn.low_rank) if dcn is not None else (0, 0)
    precision = "bf16" if cfg.training.precision == "bf16" else "fp32"
    return dlrm_dense(num_dense, dim, features, m.dlrm.bottom_mlp, m.dlrm.top_mlp, layers, rank, precision)


def group_search(say: Callable[[str], None] | None = None, dense: DenseSpec | None = None) -> Callable:
    """The search plan_at_scale runs per candidate group: the training job's (`policy.search_plan`, its graph
    choice priced with the dense model `dense`); `say` gets its notes (default: print)."""
    say = say or print

    def search(tables, topo, batch_size, optimizer, constraints, settings):
        return search_plan(tables, topo, batch_size, optimizer, constraints, settings, say, dense)

    return search


def auto_group_plan(
    cfg: Any, topology: Topology, log: Callable[[str], None] | None = None, search: Callable | None = None
) -> ScalePlan:
    """The group-size search of training config `cfg` (a TrainConfig, sharding.group_size auto) on `topology` (the
    job's ranks): every candidate group size planned and priced with the job's tables, schedule.batch_size, sparse
    optimizer, planner constraints and settings (`job_settings`), its dense model (`dense_spec`) and
    sharding.replica_sync / replica_sync_every. `log` gets the search's notes; `search` replaces the per-group search
    (default `group_search(log)`). The ScalePlan's `group_size` is the choice (None: no 2D), its `plan` the plan over
    every rank and its `summary()` the per-size table."""
    twod, dense = cfg.sharding, dense_spec(cfg)
    return plan_at_scale(
        cfg.model.tables, topology, cfg.schedule.batch_size, cfg.sparse_optimizer, cfg.planner.constraints,
        job_settings(cfg), dense, twod.replica_sync, twod.replica_sync_every, None,
        search or group_search(log, dense),
    )  # fmt: skip


def auto_group_plan_for_job(
    cfg: Any, world: int, local_world: int, device_type: str, log: Callable[[str], None]
) -> ShardingPlan:
    """The plan of a training job with sharding.group_size auto: `auto_group_plan` on the job's topology
    (`policy.topology_for`: planner.topology_file, else this machine, with `world` ranks, `local_world` per host),
    checked against the tables; `log` gets the per-size table, the choice and the plan. A ConfigError where the
    planner section leaves nothing to choose (planner.plan_file, planner.strategy simple)."""
    p = cfg.planner
    if p.plan_file:
        raise ConfigError(
            f"sharding.group_size=auto with planner.plan_file={p.plan_file!r}: a saved plan fixes the group size; set "
            "sharding.group_size to the plan's (or null), or leave planner.plan_file unset to plan here"
        )
    if p.strategy != "auto":
        raise ConfigError(
            f"sharding.group_size=auto with planner.strategy={p.strategy!r}: only the cost-model planner prices "
            "group sizes; set planner.strategy=auto, or give sharding.group_size a number of ranks (or null)"
        )
    topo = topology_for(p, world, local_world, device_type)
    scale = auto_group_plan(cfg, topo, log)
    scale.plan.check(list(cfg.model.tables))
    log(scale.summary())
    g = scale.group_size
    log(f"sharding.group_size auto: {g if g is not None else 'none (no 2D)'}, the fastest predicted step above")
    log(str(scale.plan))
    return scale.plan
