"""The step mode of a training job: which of the step's fast paths `embshard train` takes, and why not the others.

    mode = resolve_step_mode(cfg, "cuda", plan)   # the parsed config, the device type, the job's plan
    print(mode.line())   # step: whole-step CUDA graph, bf16 pooled outputs, compiled dense (auto)
    cfg = mode.applied(cfg)   # the config with every auto setting made concrete, as the job runs

The fast step on GPUs is three settings: the whole step as one CUDA graph (training.cuda_graph, graph_scope step:
embshard/training/step_graph.py; or the dense step alone: dense_graph.py), the pooled embeddings in bf16
(lookup.output_dtype) and the dense part compiled (training.compile). Their defaults are `auto`: with
training.precision bf16 on CUDA GPUs they resolve to the fast settings wherever the job allows them, else (the CPU,
fp32 or tf32) to the eager step, fp32 pooled outputs and the eager dense part. Explicit values keep their meaning.

Where a faster mode is not taken the mode says why and which setting would allow it (`Fallback`). The rules are the
graphs' own: the plan's (embshard.spec.graph_rules: sharding types, tiers, raw ids, bounds check), the model's
(`dense_refusal`: a model kind without a dense step of its own, a retrieval catalog; sequence tables), the pipeline's (semi_sync,
batch counts gathered on the device, runtime.nan_check). What only the built model can tell (the dense optimizer's
capturable step, a capture that fails) is found by `build_model` (train.py), which then falls back
(`StepMode.fallen_back`). The device type is a parameter: the mode of a GPU job is computed (and tested) on any
machine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from embshard.config import TrainConfig
from embshard.planner.step_choice import GraphChoice
from embshard.spec.graph_rules import Refusal, padding_refusal, plan_refusal, tables_refusal
from embshard.spec.options import OutputDtype
from embshard.spec.plan import ShardingPlan

__all__ = ["Fallback", "StepMode", "dense_refusal", "resolve_step_mode"]

Scope = Literal["step", "dense", "eager"]
SCOPE_NAMES = {"step": "whole-step CUDA graph", "dense": "dense-step CUDA graph", "eager": "eager"}
"""How the step line names each scope."""


@dataclass(frozen=True)
class Fallback:
    """A faster mode not taken: `what` was turned off, `reason` why, `fix` the setting that would allow it and
    `silence` the one that asks for the mode taken (empty: none)."""

    what: str
    reason: str
    fix: str = ""
    silence: str = ""

    def __str__(self) -> str:
        settings = ([f"set {self.fix}"] if self.fix else []) + ([f"{self.silence} to silence"] if self.silence else [])
        return f"{self.what}: {self.reason}" + (f" — {', or '.join(settings)}" if settings else "")


@dataclass(frozen=True)
class StepMode:
    """The step a job runs: `scope` (step: the whole step as one CUDA graph; dense: the dense step's graph; eager),
    the pooled embeddings' dtype, the dense part's torch.compile mode ("none": eager), whether any of them came from
    an `auto` setting, the faster modes not taken (`fallbacks`) and notes on the mode taken."""

    scope: Scope
    output_dtype: OutputDtype
    compile: str
    auto: bool
    fallbacks: tuple[Fallback, ...] = ()
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        """The one line `embshard train` prints at its start."""
        parts = [SCOPE_NAMES[self.scope], f"{self.output_dtype.value} pooled outputs"]
        if self.compile != "none":
            parts.append("compiled dense" + ("" if self.compile == "default" else f" ({self.compile})"))
        why = ["auto" if self.auto else "as set", *map(str, self.fallbacks), *self.notes]
        return f"step: {', '.join(parts)} ({'; '.join(why)})"

    def fallen_back(self, scope: Scope, fallback: Fallback) -> StepMode:
        """This mode with `scope` instead (a slower one), and why."""
        return replace(
            self, scope=scope, fallbacks=(*self.fallbacks, fallback), notes=() if scope == "eager" else self.notes
        )

    def applied(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with its auto settings made concrete as this mode runs them: training.cuda_graph (and graph_scope),
        training.compile, lookup.output_dtype."""
        training = replace(
            cfg.training,
            cuda_graph=self.scope != "eager",
            graph_scope="step" if self.scope == "step" else "dense",
            compile=self.compile,
        )
        return replace(cfg, training=training, lookup=replace(cfg.lookup, output_dtype=self.output_dtype))


def dense_refusal(cfg: TrainConfig) -> Refusal | None:
    """Why the model of `cfg` has no dense step a CUDA graph can hold (training.cuda_graph), or None if it has
    (`dense_graph.model_refusal`, on the registered kind; the first call imports the model kinds and torch)."""
    from embshard.models.registry import model_kind
    from embshard.training.dense_graph import model_refusal

    tt = cfg.model.two_tower
    catalog = cfg.model.kind == "two_tower" and tt is not None and tt.catalog_mode
    why = model_refusal(cfg.model.kind, model_kind(cfg.model.kind).sparse_input, catalog)
    return None if why is None else Refusal(why)


def _sequence_refusal(cfg: TrainConfig) -> Refusal | None:
    """Why a model with sequence tables (pooling: none) runs its step eagerly: the sequence collection's exchanges,
    sized from each batch's counts on the host, run in the forward (None: no sequence tables)."""
    sequence = [t.name for t in cfg.model.tables if t.sequence]
    if not sequence:
        return None
    return Refusal(
        f"sequence tables {sequence} (pooling: none) are looked up in the forward, their exchanges sized on the host "
        "each step"
    )


def _whole_step_refusal(cfg: TrainConfig, plan: ShardingPlan | None) -> Refusal | None:
    """Why the whole step cannot be one graph under this pipeline and plan (None: it can)."""
    t = cfg.training
    if t.pipeline == "semi_sync":
        return Refusal(
            "training.pipeline semi_sync looks up the next batch before this one's backward",
            "training.pipeline=sparse_dist",
        )
    if cfg.batch_counts != "host":
        return _device_counts(cfg)
    tables = list(cfg.model.tables)
    if plan is None:
        return tables_refusal(tables, cfg.lookup.bounds_check)
    return plan_refusal(tables, plan, cfg.lookup.bounds_check)


def _device_counts(cfg: TrainConfig) -> Refusal:
    """Why the job's steps gather their batch counts on the device (TrainConfig.batch_counts 'device')."""
    if cfg.training.pipeline == "none":
        return Refusal("training.pipeline none gathers the batch counts on the device", "training.pipeline=sparse_dist")
    return Refusal(
        "lookup.bounds_check drop removes ids on the device, where the batch counts are then gathered",
        "lookup.bounds_check=error",
    )


def resolve_step_mode(
    cfg: TrainConfig, device_type: str, plan: ShardingPlan | None = None, choice: GraphChoice | None = None
) -> StepMode:
    """The step mode of the job `cfg` on `device_type` ("cuda" or "cpu") with the sharding `plan` (None: before the
    plan, as the planner is asked: the plan's own rules are then not checked). training.cuda_graph, training.compile
    and lookup.output_dtype auto resolve to the whole-step graph, bf16 pooled outputs and the compiled dense part
    where training.precision is bf16 on CUDA GPUs and the job allows them, else to the fastest mode that works.
    `choice`: the planner's choice between the whole-step graph's plan and the eager step's (training.cuda_graph
    auto: `plan` is the one it took), which the step line repeats with both predictions."""
    t = cfg.training
    cuda = device_type == "cuda"
    fast = cuda and t.precision == "bf16"  # what the auto settings resolve to the fast step for
    auto = "auto" in (t.cuda_graph, t.compile) or cfg.lookup.output_dtype is OutputDtype.AUTO
    output_dtype = cfg.lookup.resolved(fast).output_dtype
    compile = ("default" if fast else "none") if t.compile == "auto" else t.compile
    fallbacks: list[Fallback] = []
    if compile != "none" and not cuda:
        fallbacks.append(Fallback(f"training.compile {compile} off", "torch.compile runs on CUDA GPUs only"))
        compile = "none"
    silence = "training.cuda_graph=false"
    mode = StepMode("eager", output_dtype, compile, auto)
    if t.cuda_graph is False:
        return replace(mode, fallbacks=tuple(fallbacks))
    if t.cuda_graph == "auto":
        if not cuda:
            return replace(mode, fallbacks=tuple(fallbacks))  # the CPU's step: eager, as ever
        if t.precision != "bf16":
            off = Fallback(
                "CUDA graphs off",
                f"training.precision is {t.precision} (the fast step is the default with bf16)",
                "training.precision=bf16 (or training.cuda_graph=true)",
            )
            return replace(mode, fallbacks=(*fallbacks, off))
        if compile == "reduce-overhead":
            off = Fallback(
                "CUDA graphs off",
                "training.compile reduce-overhead makes CUDA graphs of its own",
                "training.compile=default",
                silence,
            )
            return replace(mode, fallbacks=(*fallbacks, off))
    elif not cuda:
        off = Fallback("CUDA graphs off", "CUDA graphs need a CUDA GPU", "", silence)
        return replace(mode, fallbacks=(*fallbacks, off))
    world = plan.world_size if plan is not None else 1
    if cfg.runtime.nan_check:
        why = Refusal(
            "runtime.nan_check checks each step's loss and pooled embeddings eagerly", "runtime.nan_check=false"
        )
    elif (plan.sharding_group_size if plan is not None else cfg.sharding.group_size) is not None:  # auto: 2D maybe
        why = Refusal(
            "sharding.group_size (2D sharding) gathers the replica sets' batches, sized on the host each step",
            "sharding.group_size=null",
        )
    else:
        why = dense_refusal(cfg) or _sequence_refusal(cfg)
    if why is None and world > 1 and cfg.batch_counts != "host":
        counts = _device_counts(cfg)
        why = Refusal(f"{counts.reason}, and {world} ranks replay only with counts agreed on the host", counts.fix)
    if why is not None:
        return replace(mode, fallbacks=(*fallbacks, Fallback("CUDA graphs off", why.reason, why.fix, silence)))
    mode = replace(mode, scope="dense", fallbacks=tuple(fallbacks))
    if t.graph_scope == "dense":
        return mode
    why = _whole_step_refusal(cfg, plan)
    if why is not None:
        if choice is not None and not choice.graph and choice.graph_step_s is not None:  # the planner's choice
            fix = choice.force() if t.cuda_graph == "auto" else "planner.settings.whole_step_graph=true"
            why = Refusal(f"the planner chose the eager step's plan, {choice.reason()}", fix)
        return mode.fallen_back(
            "dense", Fallback("whole-step graph off", why.reason, why.fix, "training.graph_scope=dense")
        )
    notes = []
    if choice is not None and choice.graph:
        force = choice.force()
        notes.append(
            f"the planner's choice: {choice.reason()}" + (f" — set {force} for the eager step" if force else "")
        )
    pad = padding_refusal(list(cfg.model.tables), cfg.sparse_optimizer)
    if pad is not None:
        notes.append(f"ragged bags are not padded, fixed bags only: {pad.reason}")
    return replace(mode, scope="step", notes=tuple(notes))
