"""The whole-step CUDA graph or the eager step (planner.settings.whole_step_graph auto, what training.cuda_graph auto
asks for on GPUs): the planner plans both ways, prices the graph's plan as one replay and the other as an eager step
(the host's floor included), each with the training job's dense part when given, and keeps the faster; the
report's graph_choice says which, with both predictions. Explicit settings plan as before; CPUs plan the eager
step."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from embshard.config import load_config
from embshard.planner import PlannerSettings, Topology
from embshard.planner.policy import search_plan
from embshard.planner.step_choice import GraphChoice
from embshard.spec.graph_rules import plan_refusal
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingType
from embshard.spec.tables import ConfigError, TableConfig

OPT = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
# one hot table (60 ids a sample: 4 ranks looking it up whole is more than a balanced rank's share) beside six small
TABLES = [TableConfig(name="hot", num_embeddings=4_000_000, embedding_dim=128, feature_names=["hot"], ids_per_bag=60)]
TABLES += [
    TableConfig(name=f"t{i}", num_embeddings=200_000, embedding_dim=64, feature_names=[f"f{i}"], ids_per_bag=2)
    for i in range(6)
]
H100 = Topology.preset("h100", world_size=4)
NO_HOST = replace(H100, host_step_s=0.0, host_group_s=0.0, host_dp_group_s=0.0)  # a host that never holds a step
MLPERF_BF16 = load_config("configs/dlrm_dcnv2_mlperf.yaml", ["training.precision=bf16"])


def _search(topo: Topology, graph, batch: int = 4096):
    said: list[str] = []
    plan, report = search_plan(TABLES, topo, batch, OPT, None, PlannerSettings(whole_step_graph=graph), said.append)
    return plan, report, said


@pytest.mark.parametrize("topo, graph_wins", [(H100, True), (NO_HOST, False)], ids=["host-floor", "no-host-floor"])
def test_auto_keeps_the_faster_of_the_graphs_plan_and_the_eager_plan(topo, graph_wins) -> None:
    plan, report, _ = _search(topo, "auto")
    graphed_plan, graphed, _ = _search(topo, True)
    eager_plan, eager, _ = _search(topo, False)
    choice = report.graph_choice
    assert isinstance(choice, GraphChoice) and not choice.same_plan
    # both predictions are those of the explicit searches, and the faster is taken
    assert choice.graph_step_s == pytest.approx(graphed.step_time_s, rel=1e-12)
    assert choice.eager_step_s == pytest.approx(eager.step_time_s, rel=1e-12)
    assert choice.graph is (graphed.step_time_s <= eager.step_time_s) is graph_wins
    assert report.step_time_s == pytest.approx(min(graphed.step_time_s, eager.step_time_s), rel=1e-12)
    assert plan == (graphed_plan if graph_wins else eager_plan)
    assert report.settings.whole_step_graph is graph_wins  # priced as it runs: one replay, or eager
    assert (plan_refusal(TABLES, plan) is None) is graph_wins
    hot = plan["hot"].sharding_type
    assert hot is (ShardingType.COLUMN_WISE if graph_wins else ShardingType.ROW_WISE), hot  # no row split in a graph
    line = report.summary().splitlines()
    [text] = [ln for ln in line if "step choice (training.cuda_graph auto)" in ln]
    ms = [float(x) for x in re.findall(r"([0-9.]+) ms", text)]
    if graph_wins:
        assert (
            "the whole-step CUDA graph, predicted" in text and "training.cuda_graph=false plans for the other" in text
        )
        assert ms == pytest.approx([graphed.step_time_s * 1e3, eager.step_time_s * 1e3], abs=0.006)
    else:
        assert "the eager step, predicted" in text and "training.cuda_graph=true plans for the other" in text
        assert ms == pytest.approx([eager.step_time_s * 1e3, graphed.step_time_s * 1e3], abs=0.006)
    assert report.to_dict()["graph_choice"]["graph"] is graph_wins


def test_explicit_settings_and_cpus_make_no_choice() -> None:
    for graph in (True, False, None):
        plan, report, _ = _search(H100, graph)
        assert report.graph_choice is None and "step choice" not in report.summary()
        assert report.to_dict()["graph_choice"] is None
    cpu = Topology.preset("cpu", world_size=2)
    plan, report, _ = _search(cpu, "auto", batch=256)
    eager_plan, eager, _ = _search(cpu, False, batch=256)
    assert report.graph_choice is None and plan == eager_plan and report.step_time_s == eager.step_time_s


def test_no_graph_plan_that_fits_is_the_eager_plan_and_says_why() -> None:
    settings = PlannerSettings(whole_step_graph="auto", sharding_types=(ShardingType.ROW_WISE,))
    plan, report = search_plan(TABLES, H100, 4096, OPT, None, settings)
    choice = report.graph_choice
    assert not choice.graph and choice.graph_step_s is None and "none of which the graph holds" in choice.why_no_graph
    assert {tp.sharding_type for tp in plan.tables} == {ShardingType.ROW_WISE} and choice.force() == ""
    assert "no plan the whole-step CUDA graph holds fits" in choice.line()
    # the graph's options allowed but none fits: the hot table (2 GiB) whole on no rank of 1.5 GiB, no column blocks
    small = H100.with_sizes(hbm_gib=1.5, ddr_gib=1.0)
    settings = replace(settings, sharding_types=(ShardingType.TABLE_WISE, ShardingType.ROW_WISE))
    plan, report = search_plan(TABLES, small, 4096, OPT, None, settings)
    choice = report.graph_choice
    assert not choice.graph and choice.graph_step_s is None and "table(s) ['hot']" in choice.why_no_graph
    assert plan["hot"].sharding_type is ShardingType.ROW_WISE and choice.eager_step_s == report.step_time_s


def test_the_setting_takes_auto_and_names_itself_when_wrong() -> None:
    assert PlannerSettings.from_dict({"whole_step_graph": "auto"}).whole_step_graph == "auto"
    with pytest.raises(ConfigError, match=r"whole_step_graph='always' is invalid: it must be true, false or auto"):
        PlannerSettings.from_dict({"whole_step_graph": "always"}, "planner.settings")


def test_embshard_plan_shows_the_choice_for_a_training_config(capsys) -> None:
    """The MLPerf-shaped bf16 job on 8 H100s: its graph's plan (hot tables in column blocks) is predicted slower
    than the eager plan (row-wise), which auto then takes, both with the dense model's part; the group sizes'
    table prices the chosen step as the choice does."""
    from embshard.tools.plan import main

    args = ["configs/dlrm_dcnv2_mlperf.yaml", "--device", "h100", "--world-size", "8", "training.precision=bf16"]
    main(args)
    out = capsys.readouterr().out
    [text] = [ln for ln in out.splitlines() if "step choice" in ln]
    eager_ms, graph_ms, dense_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", text))
    assert text.strip().startswith("step choice (training.cuda_graph auto): the eager step, predicted")
    assert eager_ms < graph_ms and "training.cuda_graph=true plans for the other" in text
    assert f"(with the dense part's {dense_ms:.2f} ms)" in text and dense_ms > 0.5
    [chosen] = re.findall(r"chosen sharding_group_size: none \(no 2D\); predicted step ([0-9.]+) ms", out)
    assert float(chosen) == pytest.approx(eager_ms, abs=0.006)


def _mlperf_search(topo: Topology, dense):
    """The MLPerf-shaped bf16 job's search on `topo` (the training job's settings: auto, bf16 pooled rows), priced
    with the dense part `dense` (None: the embedding step alone)."""
    from embshard.training.group_plan import job_settings

    cfg = MLPERF_BF16
    tables, batch = cfg.model.tables, cfg.schedule.batch_size
    return search_plan(
        tables, topo, batch, cfg.sparse_optimizer, cfg.planner.constraints, job_settings(cfg), None, dense
    )


def test_the_eager_steps_host_time_hides_the_dense_part() -> None:
    """On one H100 the MLPerf-shaped job's graph plan (2 tables in UVM) has the shorter embedding step (4.91 against
    the eager step's 5.10 ms, the host's time; its GPUs' 3.70), but the whole training step runs the dense part
    after it: inside the graph it adds to the GPUs' time, while the eager step's host time hides it (the dense-step
    graph's one replay). With it the eager step is predicted faster, as measured on three machines (docs/benchmarks.md:
    eager 5.93-7.33 ms against the graph's 6.74-8.87 in 3 of 4 rounds)."""
    from embshard.planner.dense import dense_allreduce_s, dense_compute_s
    from embshard.training.group_plan import dense_spec

    one, dense = Topology.preset("h100", world_size=1), dense_spec(MLPERF_BF16)
    _, alone = _mlperf_search(one, None)
    assert alone.graph_choice.graph and alone.graph_choice.dense_step_s == 0  # the embedding steps alone
    plan, report = _mlperf_search(one, dense)
    choice = report.graph_choice
    assert dense_allreduce_s(dense, one) == 0  # one rank: no all-reduce
    dense_s = dense_compute_s(dense, one, MLPERF_BF16.schedule.batch_size)
    assert choice.dense_step_s == pytest.approx(dense_s, rel=1e-12) and dense_s > 1e-3
    assert not choice.graph and report.settings.whole_step_graph is False
    assert plan_refusal(MLPERF_BF16.model.tables, plan)  # the graph cannot hold it (UVM caching)
    # the eager step: the longer of the host's time and the GPUs' embedding step and dense part
    assert report.host_step_time_s > report.gpu_step_time_s
    want_eager = max(report.host_step_time_s, report.gpu_step_time_s + dense_s)
    assert choice.eager_step_s == pytest.approx(want_eager, rel=1e-12)
    assert report.gpu_step_time_s + dense_s > report.host_step_time_s  # here the GPUs' time sets it
    # the graph: its embedding step (no host) and then the dense part
    assert choice.graph_step_s == pytest.approx(alone.graph_choice.graph_step_s + dense_s, rel=1e-12)
    assert choice.eager_step_s < choice.graph_step_s
    assert f"with the dense part's {dense_s * 1e3:.2f} ms" in choice.reason()


def test_step_with_dense_part() -> None:
    """PlanReport.step_with_dense_s: after the embedding step, the dense part adds to the GPUs' time; a graphed
    dense part hides under an eager step's longer host time, an eager one adds to the step."""
    _, graphed, _ = _search(H100, True)
    _, eager, _ = _search(H100, False)
    assert graphed.host_step_time_s == 0 and eager.host_step_time_s > eager.gpu_step_time_s > 0
    slack = eager.host_step_time_s - eager.gpu_step_time_s
    for r in (graphed, eager):
        assert r.step_with_dense_s(0.0, True) == r.step_with_dense_s(0.0, False) == r.step_time_s
    assert graphed.step_with_dense_s(1e-3, True) == graphed.step_with_dense_s(1e-3, False) == graphed.step_time_s + 1e-3
    assert eager.step_with_dense_s(slack / 2, True) == eager.host_step_time_s  # hidden
    assert eager.step_with_dense_s(slack * 2, True) == pytest.approx(eager.gpu_step_time_s + slack * 2, rel=1e-12)
    assert eager.step_with_dense_s(slack / 2, False) == eager.step_time_s + slack / 2
