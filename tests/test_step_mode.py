"""The step mode of `embshard train` (embshard/training/mode.py): with training.precision bf16 on CUDA GPUs the auto
defaults resolve to the whole-step CUDA graph, bf16 pooled outputs and the compiled dense part wherever the plan,
the model and the pipeline allow them, else to the fastest mode that works, naming the reason and the setting that
would allow the faster one; on the CPU and with fp32 to the eager step as before; explicit values keep their
meaning. The resolution is computed for a device type given as a parameter (no GPU needed); one build on 1 CPU
process checks that a mode the built model cannot run falls back with its reason."""

from __future__ import annotations

import pytest
from dist_harness import device_kind, run_distributed

from embshard.config import load_config
from embshard.planner.simple import simple_plan
from embshard.planner.step_choice import GraphChoice
from embshard.spec.options import OutputDtype
from embshard.spec.plan import MemoryTier, ShardingType
from embshard.spec.tables import ConfigError
from embshard.training.group_plan import graph_request, job_settings
from embshard.training.mode import Fallback, resolve_step_mode

MLPERF = "configs/dlrm_dcnv2_mlperf.yaml"
FAST = "step: whole-step CUDA graph, bf16 pooled outputs, compiled dense (auto)"


def _cfg(*overrides: str, path: str = MLPERF):
    return load_config(path, list(overrides))


def _plan(cfg, world: int = 2, types: dict | None = None, tier: MemoryTier = MemoryTier.HBM):
    return simple_plan(list(cfg.model.tables), world, sharding_types=types or {}, tier=tier)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_auto_is_the_fast_step_with_bf16_on_gpus_and_todays_step_elsewhere(device, precision):
    cfg = _cfg(f"training.precision={precision}")
    assert cfg.training.cuda_graph == "auto" and cfg.training.compile == "auto"
    assert cfg.lookup.output_dtype is OutputDtype.AUTO
    mode = resolve_step_mode(cfg, device, _plan(cfg))
    ran = mode.applied(cfg)
    if device == "cuda" and precision == "bf16":
        assert mode.line() == FAST
        assert (ran.training.cuda_graph, ran.training.graph_scope, ran.training.compile) == (True, "step", "default")
        assert ran.lookup.output_dtype is OutputDtype.BF16
        assert cfg.whole_step_graph  # the planner is asked for a plan the graph holds
        return
    assert mode.scope == "eager" and mode.compile == "none" and mode.output_dtype is OutputDtype.FP32
    assert (ran.training.cuda_graph, ran.training.compile, ran.lookup.output_dtype) == (False, "none", OutputDtype.FP32)
    if device == "cpu":
        assert mode.line() == "step: eager, fp32 pooled outputs (auto)"
    else:  # a GPU with fp32/tf32: the line says what would make it fast
        assert mode.line().startswith("step: eager, fp32 pooled outputs (auto; CUDA graphs off: ")
        assert f"training.precision is {precision}" in mode.line() and "set training.precision=bf16" in mode.line()
    assert cfg.whole_step_graph is (precision == "bf16")


def test_plans_the_whole_step_graph_cannot_hold_keep_the_dense_graph_and_say_which_setting_allows_it():
    cfg = _cfg("training.precision=bf16")
    tables = [t.name for t in cfg.model.tables]
    dp = resolve_step_mode(cfg, "cuda", _plan(cfg, types={tables[3]: ShardingType.DATA_PARALLEL}))
    assert dp.line() == FAST  # table-wise and data-parallel: the graph holds them
    cw = resolve_step_mode(cfg, "cuda", _plan(cfg, types={tables[0]: ShardingType.COLUMN_WISE}))
    assert cw.line() == FAST  # column-wise: the graph holds it too
    for kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        mode = resolve_step_mode(cfg, "cuda", _plan(cfg, types={tables[0]: kind, tables[5]: kind}))
        line = mode.line()
        assert mode.scope == "dense" and line.startswith(
            "step: dense-step CUDA graph, bf16 pooled outputs, compiled dense"
        )
        assert f"whole-step graph off: the plan has ['{kind.value}'] tables" in line, line
        assert f"table '{tables[0]}' is {kind.value} (1 more)" in line, line
        assert f"set planner.constraints.{tables[0]}.sharding_types=[table_wise]" in line, line
        assert "training.graph_scope=dense to silence" in line, line
        assert mode.applied(cfg).training.graph_scope == "dense" and mode.applied(cfg).training.cuda_graph is True
    cached = resolve_step_mode(cfg, "cuda", _plan(cfg, tier=MemoryTier.UVM_CACHING))
    assert cached.scope == "dense" and "UVM-caching tables" in cached.line()
    assert f"set planner.constraints.{tables[0]}.tiers=[hbm]" in cached.line(), cached.line()
    assert resolve_step_mode(cfg, "cuda", _plan(cfg, tier=MemoryTier.UVM)).line() == FAST


@pytest.mark.parametrize(
    ("overrides", "scope", "reason", "fix"),
    [
        (
            ["training.pipeline=semi_sync"],
            "dense",
            "semi_sync looks up the next batch",
            "training.pipeline=sparse_dist",
        ),
        (
            ["training.pipeline=none"],
            "eager",
            "pipeline none gathers the batch counts on the device",
            "training.pipeline=sparse_dist",
        ),
        (["lookup.bounds_check=drop"], "eager", "lookup.bounds_check drop", "lookup.bounds_check=error"),
        (["runtime.nan_check=true"], "eager", "runtime.nan_check checks each step", "runtime.nan_check=false"),
        (
            ["training.compile=reduce-overhead"],
            "eager",
            "reduce-overhead makes CUDA graphs",
            "training.compile=default",
        ),
    ],
)
def test_pipeline_and_settings_that_rule_the_graphs_out_name_the_setting(overrides, scope, reason, fix):
    cfg = _cfg("training.precision=bf16", *overrides)
    mode = resolve_step_mode(cfg, "cuda", _plan(cfg))
    assert mode.scope == scope, mode.line()
    assert reason in mode.line() and f"set {fix}" in mode.line(), mode.line()
    assert mode.output_dtype is OutputDtype.BF16 and mode.compile != "none"  # the rest of the fast step stays


def test_one_rank_without_host_counts_keeps_the_dense_graph():
    cfg = _cfg("training.precision=bf16", "training.pipeline=none")
    mode = resolve_step_mode(cfg, "cuda", _plan(cfg, world=1))
    assert (
        mode.scope == "dense" and "whole-step graph off: training.pipeline none gathers the batch counts" in mode.line()
    )


def test_sparse_optimizers_that_move_zero_gradient_rows_replay_fixed_bags_only():
    cfg = _cfg("training.precision=bf16", "sparse_optimizer.kind=adam")
    mode = resolve_step_mode(cfg, "cuda", _plan(cfg))
    assert mode.scope == "step" and "ragged bags are not padded, fixed bags only" in mode.line()
    assert "the sparse optimizer (adam, weight decay 0) changes rows with a zero gradient" in mode.line()


def test_models_and_tables_the_graphs_cannot_hold():
    raw = _cfg("training.precision=bf16", path="configs/dlrm_criteo_raw.yaml")
    mode = resolve_step_mode(raw, "cuda", _plan(raw))
    assert mode.scope == "dense" and "raw-id tables" in mode.line(), mode.line()
    assert not raw.whole_step_graph  # nor is the planner asked for it
    for path, reason in [
        ("configs/two_tower_movielens_full_softmax.yaml", "a retrieval catalog"),
        ("configs/two_tower_movielens.yaml", "model kind 'two_tower' does not give its dense step's inputs"),
    ]:
        cfg = _cfg("training.precision=bf16", path=path)
        mode = resolve_step_mode(cfg, "cuda", _plan(cfg))
        assert mode.scope == "eager" and reason in mode.line(), mode.line()
        assert "training.cuda_graph=false to silence" in mode.line()


def test_explicit_values_keep_their_meaning():
    off = _cfg("training.precision=bf16", "training.cuda_graph=false")
    assert (
        resolve_step_mode(off, "cuda", _plan(off)).line() == "step: eager, bf16 pooled outputs, compiled dense (auto)"
    )
    debug = _cfg(
        "training.precision=bf16", "training.cuda_graph=false", "training.compile=none", "lookup.output_dtype=fp32"
    )
    assert resolve_step_mode(debug, "cuda", _plan(debug)).line() == "step: eager, fp32 pooled outputs (as set)"
    dense = _cfg("training.precision=bf16", "training.graph_scope=dense")
    assert resolve_step_mode(dense, "cuda", _plan(dense)).line().startswith("step: dense-step CUDA graph, bf16 pooled")
    fp32_graph = _cfg("training.cuda_graph=true", "training.compile=max-autotune-no-cudagraphs")
    line = resolve_step_mode(fp32_graph, "cuda", _plan(fp32_graph)).line()
    assert (
        line == "step: whole-step CUDA graph, fp32 pooled outputs, compiled dense (max-autotune-no-cudagraphs) (auto)"
    )
    on_cpu = _cfg("training.cuda_graph=true", "training.compile=default", "lookup.output_dtype=bf16")
    line = resolve_step_mode(on_cpu, "cpu", _plan(on_cpu)).line()
    assert line.startswith("step: eager, bf16 pooled outputs (as set; training.compile default off: torch.compile runs")
    assert "CUDA graphs off: CUDA graphs need a CUDA GPU — training.cuda_graph=false to silence" in line, line
    with pytest.raises(ConfigError, match="reduce-overhead"):  # an explicit graph it cannot hold stays an error
        _cfg("training.cuda_graph=true", "training.compile=reduce-overhead")


def test_before_the_plan_the_mode_is_what_the_planner_is_asked_for():
    cfg = _cfg("training.precision=bf16")
    assert resolve_step_mode(cfg, "cuda").line() == FAST  # the plan's rules are checked once it is made
    asked = resolve_step_mode(cfg, "cuda").applied(cfg)
    assert asked.whole_step_graph and asked.lookup.output_dtype is OutputDtype.BF16


def test_the_planners_choice_of_graph_or_eager_step_is_in_the_step_line():
    """training.cuda_graph auto on GPUs: the planner prices the whole-step graph's plan against the eager step's
    (tests/planner/test_planner_graph_choice.py); the step line says which it took, both predictions and the setting
    for the other. Explicit settings ask the planner for what they say."""
    cfg = _cfg("training.precision=bf16")
    tables = [t.name for t in cfg.model.tables]
    held, row = _plan(cfg), _plan(cfg, types={tables[20]: ShardingType.ROW_WISE})
    graph = resolve_step_mode(cfg, "cuda", held, GraphChoice(True, 3.07e-3, 4.6e-3))
    assert graph.scope == "step" and graph.line() == FAST[:-1] + (
        "; the planner's choice: predicted 3.07 ms a step with the whole-step CUDA graph's plan against 4.60 ms "
        "eager — set training.cuda_graph=false for the eager step)"
    ), graph.line()
    same = resolve_step_mode(cfg, "cuda", held, GraphChoice(True, 2.95e-3, 4.6e-3, same_plan=True)).line()
    assert "predicted 2.95 ms a step with the whole-step CUDA graph against 4.60 ms eager (the same plan)" in same
    eager = resolve_step_mode(cfg, "cuda", row, GraphChoice(False, 6.71e-3, 5.1e-3))
    assert eager.scope == "dense" and eager.line() == (
        "step: dense-step CUDA graph, bf16 pooled outputs, compiled dense (auto; whole-step graph off: the planner "
        "chose the eager step's plan, predicted 5.10 ms a step eager against 6.71 ms with the whole-step CUDA graph's "
        "plan — set training.cuda_graph=true, or training.graph_scope=dense to silence)"
    ), eager.line()
    forced = _cfg("training.precision=bf16", "training.cuda_graph=true", "planner.settings.whole_step_graph=auto")
    line = resolve_step_mode(forced, "cuda", row, GraphChoice(False, 6.71e-3, 5.1e-3)).line()
    assert "the planner chose the eager step's plan" in line and "set planner.settings.whole_step_graph=true" in line
    unfit = resolve_step_mode(cfg, "cuda", row, GraphChoice(False, None, 5.1e-3, why_no_graph="too big")).line()
    assert "whole-step graph off: the plan has ['row_wise'] tables" in unfit  # the plan's own reason and fix
    # what each setting asks the planner for: auto the choice, explicit values what they say
    assert graph_request(cfg) == "auto" and job_settings(cfg).whole_step_graph == "auto"
    for overrides, asked in [
        (["training.cuda_graph=true"], True),
        (["training.cuda_graph=false"], False),
        (["training.graph_scope=dense"], False),
        (["training.precision=fp32"], False),
        (["planner.settings.whole_step_graph=true"], True),
        (["planner.settings.whole_step_graph=false"], False),
    ]:
        job = _cfg("training.precision=bf16", *overrides)
        assert job_settings(job).whole_step_graph is asked, overrides
    nan = _cfg("training.precision=bf16", "runtime.nan_check=true")  # the step mode turns the graphs off first
    assert graph_request(nan, resolve_step_mode(nan, "cuda").applied(nan)) is False


def _plan_job_worker(rank, world, device, topology_file):
    from types import SimpleNamespace

    from embshard.training.train import plan_job_and_choice

    gpu = SimpleNamespace(type="cuda")  # a GPU job's planning (the planner itself needs no GPU)
    cfg = _cfg("training.precision=bf16", f"planner.topology_file={topology_file}")
    plan, choice = plan_job_and_choice(cfg, gpu, 8, 8, lambda _line: None)
    return choice, resolve_step_mode(cfg, "cuda", plan, choice).line(), plan.world_size


def test_a_gpu_jobs_plan_comes_with_the_planners_choice_for_its_step_line(tmp_path):
    """`plan_job_and_choice` (what `embshard train` runs) on rank 0 of a group, broadcast: the MLPerf-shaped bf16 job
    on 8 H100s (the preset as its topology file) gets the eager step's plan under training.cuda_graph auto, and the
    step line says so with both predictions."""
    from embshard.planner import Topology

    topology = tmp_path / "h100.yaml"
    Topology.preset("h100", world_size=8).save(topology)
    [(choice, line, world)] = run_distributed(_plan_job_worker, 1, str(topology))
    assert world == 8 and not choice.graph and choice.eager_step_s < choice.graph_step_s
    assert line.startswith(
        "step: dense-step CUDA graph, bf16 pooled outputs, compiled dense (auto; whole-step graph off: "
    )
    assert f"the planner chose the eager step's plan, {choice.reason()} — set training.cuda_graph=true" in line, line


def _build_worker(rank, world, device):
    from embshard.training.mode import StepMode
    from embshard.training.train import build_model

    cfg = load_config("configs/dlrm_synthetic.yaml", ["training.precision=bf16", "model.tables[0].num_embeddings=100"])
    plan = simple_plan(list(cfg.model.tables), world)
    forced = StepMode("step", OutputDtype.BF16, "none", auto=True)  # as if on a GPU: the built model refuses it
    model, _opt, graphs, mode = build_model(cfg, plan, 13, device, world, print, forced)
    return mode.scope, mode.line(), graphs.dense is None and graphs.whole is None, graphs.summary()


@pytest.mark.skipif(device_kind() == "cuda", reason="on a GPU the built model runs the graphs (bench/step_mode.py)")
def test_a_mode_the_built_model_cannot_run_falls_back_with_its_reason():
    (scope, line, no_graphs, summary), *_ = run_distributed(_build_worker, 1)
    assert scope == "eager" and no_graphs and summary is None
    assert line == (
        "step: eager, bf16 pooled outputs (auto; CUDA graphs off: CUDA graphs need a CUDA GPU — "
        "training.cuda_graph=false to silence)"
    ), line
    assert str(Fallback("x off", "why", "a=1", "b=2")) == "x off: why — set a=1, or b=2 to silence"
