"""bench/: the driver's commands (no benchmark runs), the report's pairing, ratios, verdicts and floors, and
docs/benchmarks.md's generated region being current with the committed results."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import os
import statistics
import sys
import time
from pathlib import Path

import paths
import pytest

from bench import floors, report, run, suites
from bench.suites import checks, common, embedding, rawids, training

ROOT = paths.ROOT

H100 = suites.Machine(gpus=2, gpu="NVIDIA H100 80GB HBM3", gpu_mib=81559, cpus=32)


def args_for(*argv: str) -> argparse.Namespace:
    args = run.parse([*argv, "--out", "/tmp/bench-out"])
    args.out = "/tmp/bench-out"
    return args


def steps(*argv: str, machine: suites.Machine = H100) -> list[suites.Step]:
    args = args_for(*argv)
    return [s for name in args.suites for s in suites.SUITES[name].steps(args, machine)]


def test_docs_benchmarks_is_current():
    region = report.render(report.folders_in([]))
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report.replace_region(page, region) == page, (
        "docs/benchmarks.md is stale: run `python -m bench.report --update docs/benchmarks.md`"
    )


def test_every_suite_builds_commands_of_existing_scripts():
    for name in suites.SUITES:
        for cpu in ([], ["--cpu"]):
            for step in steps(name, *cpu):
                scripts = [a for a in step.argv if a.startswith(("bench/", "tests/", "examples/"))]
                assert all((ROOT / a).exists() for a in scripts), (name, step.argv)
                modules = [b for a, b in zip(step.argv, step.argv[1:]) if a == "-m" and b.startswith("bench.")]
                assert all(importlib.util.find_spec(m) is not None for m in modules), (name, step.argv)
                assert step.argv[0] == sys.executable and step.timeout > 0, step


def _installed(monkeypatch, module: str, installed: bool) -> None:
    """The suites see `module` installed or not (whatever this machine has), other modules as they are."""
    real = importlib.util.find_spec
    fake = lambda name: (object() if installed else None) if name == module else real(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)


def test_tests_suite_device_junit_and_timeout_only_when_installed(monkeypatch):
    for installed in (True, False):
        _installed(monkeypatch, "pytest_timeout", installed)
        (step,) = steps("tests", "--test-timeout", "120")
        assert step.env == {"EMBSHARD_TEST_DEVICE": "cuda", "EMBSHARD_TEST_TIMES": "/tmp/bench-out/test_times.txt"}
        assert "--junitxml=/tmp/bench-out/tests_junit.xml" in step.argv and step.argv[-1] == "tests"
        assert ("--timeout=120" in step.argv) == installed
    (cpu,) = steps("tests", "--cpu", "--pytest-args", "tests/sharding -x")
    assert cpu.env == {"EMBSHARD_TEST_TIMES": "/tmp/bench-out/test_times.txt"} and cpu.argv[-2:] == [
        "tests/sharding",
        "-x",
    ]


def test_fuzz_suite_world_sizes_cases_and_the_env_test_fuzz_reads():
    text = (ROOT / "tests" / "test_fuzz.py").read_text()
    got = steps("fuzz", "--fuzz", "2:300,1:100")
    assert [s.env.get("EMBSHARD_FUZZ_WORLDS") for s in got] == ["2", "1", None]
    assert [s.env.get("EMBSHARD_FUZZ_CASES") for s in got] == ["300", "100", None]
    assert all(k in text for s in got for k in s.env)  # the variables tests/test_fuzz.py reads
    assert [s.needs_gpus for s in got[:2]] == [2, 1] and got[2].argv[-1] == "tests/test_fuzz_regressions.py"
    with pytest.raises(SystemExit, match="WORLD:CASES"):
        steps("fuzz", "--fuzz", "2-300")


def test_e2e_suite_interleaves_pairs_of_both_precisions():
    got = steps("e2e", "--pairs", "3", "--nproc", "2", "--scale", "0.25")
    assert got[0].label.startswith("bandwidth")
    labels = [s.label for s in got[1:]]
    assert (
        labels == ["TorchRec fp32", "embshard fp32", "TorchRec bf16", "TorchRec bf16 at its best", "embshard bf16"] * 3
    )
    best = got[4].argv
    assert (
        best[best.index("--precision") + 1] == "bf16" and best[-len(training.TORCHREC_BEST) :] == training.TORCHREC_BEST
    )
    assert "TorchRec bf16 at its best" not in [s.label for s in steps("e2e", "--no-torchrec-best")]
    tr, es = got[1].argv, got[2].argv
    assert tr[: len(common.torchrun(2))] == common.torchrun(2) and "bench/baselines/torchrec_dlrm_train.py" in tr
    assert tr[tr.index("--scale") + 1] == "4" and es[es.index("--scale") + 1] == "0.25"  # the baseline divides
    assert es[es.index("--nproc") + 1] == "2" and es[es.index("--config") + 1] == common.E2E_CONFIG
    bf16 = got[5].argv
    assert bf16[bf16.index("--precision") + 1] == "bf16"  # embshard's fastest mode is its default with bf16 alone
    assert not [a for a in bf16 if a.startswith(("lookup.", "training.")) or a == "--compile"], bf16
    pooled_fp32 = steps("e2e", "--pairs", "1", "--bf16-pooled", "fp32", "--no-bandwidth")[-1].argv
    assert "lookup.output_dtype=fp32" in pooled_fp32
    also = steps("e2e", "--pairs", "1", "--precisions", "bf16", "--cuda-graph", "also", "--no-bandwidth")
    eager, graph = also[-2].argv, also[-1].argv  # beside the explicit flags' run, the plain run is the eager step
    assert "training.cuda_graph=false" in eager and "training.compile=none" in eager
    assert "training.cuda_graph=true" in graph and also[-1].label == "embshard bf16_graph"
    assert got[3].argv[got[3].argv.index("--precision") + 1] == "bf16"
    timeline = steps("e2e", "--pairs", "1", "--timeline", "--precisions", "fp32", "--no-bandwidth")
    assert "--trace" in timeline[1].argv and timeline[-1].argv[1:3] == ["-m", "bench.timeline"]
    assert timeline[-1].argv[-5] == "/tmp/bench-out/timeline_fp32.png" and timeline[-1].argv[-2:] == ["--gaps", "8"]


def test_emb_suite_workloads_card_memory_and_pair_order():
    got = steps("emb", "--pairs", "2")
    runs = [s for s in got if "bandwidth" not in s.label]
    assert [s.label.split(" (")[0] for s in runs[:6]] == [
        "TorchRec uniform26", "embshard uniform26", "TorchRec overflow", "embshard overflow",
        "TorchRec hetero124", "embshard hetero124",
    ]  # fmt: skip
    assert len(runs) == 12 and all("(pair 2)" in s.label for s in runs[6:])
    hetero = runs[4].argv
    assert hetero[hetero.index("--hbm-gib") + 1] == "79" and hetero[-4:-2] == ["--force", "small-dp"]
    assert "bench.torchrec_more" in runs[2].argv and runs[3].argv[runs[3].argv.index("--hbm-gib") + 1] == "16"
    assert all(a in runs[1].argv for a in ("--plan", "planner"))
    assert steps("emb", "--torchrec-hbm-gib", "74")[5].argv.count("74") == 1  # hetero124, pair 1
    cpu = steps("emb", "--cpu")
    assert [s.argv[s.argv.index("--workload") + 1] for s in cpu] == ["tiny", "tiny"]


def test_environment_turns_multicast_off_and_puts_the_repository_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site")
    env = run.environment()
    assert {k: env[k] for k in run.NO_MULTICAST} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"
    }  # fmt: skip
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/somewhere/site"]


def test_parse_errors_name_the_problem():
    with pytest.raises(SystemExit):
        run.parse(["nonsuite", "--out", "/tmp/x"])
    with pytest.raises(SystemExit):
        run.parse(["tests"])  # no --out


def test_a_step_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    step = suites.Step("sleeper", ["bash", "-c", f"sleep 30 & echo $! > {marker}; echo started; wait"], timeout=1.0)
    log = io.StringIO()
    t0 = time.monotonic()
    rc, seconds, _, why = run.run_step(step, log, time.monotonic() + 60)
    assert rc is None and time.monotonic() - t0 < 10 and "started" in log.getvalue() and why == "time limit 1 s"
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_a_step_that_hangs_after_its_result_is_stopped_and_keeps_the_result():
    """A benchmark whose RESULT line is out but whose process hangs at exit (a teardown that never returns) is
    stopped `exit_after_result_s` later, not at its time limit; its RESULT line stays in the log."""
    argv = ["bash", "-c", "echo 'RESULT framework=embshard ms_per_step=1.0'; sleep 30"]
    step = suites.Step("hangs at exit", argv, timeout=60.0, exit_after_result_s=0.5)
    log = io.StringIO()
    t0 = time.monotonic()
    rc, _, _, why = run.run_step(step, log, time.monotonic() + 120)
    assert rc is None and time.monotonic() - t0 < 10 and why == "not exited 0.5 s after its RESULT line"
    assert "RESULT framework=embshard" in log.getvalue() and "!! stopped after" in log.getvalue()
    quick = suites.Step("exits", ["bash", "-c", "echo 'RESULT x=1'; sleep 0.2"], timeout=60.0, exit_after_result_s=5)
    assert run.run_step(quick, io.StringIO(), time.monotonic() + 120)[::3] == (0, "")
    assert all(s.exit_after_result_s > 0 for s in steps("e2e", "--no-bandwidth") + steps("scaling"))


def test_log_filter_drops_repeated_warnings_keeps_results():
    f = run.LogFilter()
    lines = ["WARNING:root:Sharding spec not found for .t24", "WARNING:root:Sharding spec not found for .t25",
             "RESULT framework=embshard ms_per_step=1", "", "Traceback (most recent call last):"]  # fmt: skip
    assert [x for x in lines if f.keep(x)] == [lines[0], lines[2], lines[4]] and f.dropped == 2


LOG = """META date=2026-01-02 time='2026-01-02 10:00 UTC' gpu="NVIDIA H100 80GB HBM3" gpus=2
META command='python -m torch.distributed.run -m bench.embshard_dmp --workload uniform26'
GPU memory copy: 3000 GB/s (read + write)
all-to-all over 2 GPUs (NCCL): 200 GB/s bus bandwidth per rank
torchrec DMP uniform26 world=2 hbm_gib=default force=-: 5.00 ms/step, 3,276,800 samples/s; peak GPU memory 7.1 GB
RESULT framework=embshard bench=emb workload=uniform26 world=2 ms_per_step=4.000 predicted_ms=4.4 floor_hbm_gb=3,1.5 floor_link_gb=0.2,0.2 floor_host_gb=0,0
RESULT framework=torchrec bench=emb workload=uniform26 world=2 hbm_gib=default force=- ms_per_step=6.0
RESULT framework=embshard bench=emb workload=uniform26 world=2 ms_per_step=5.0 floor_hbm_gb=3,1.5 floor_link_gb=0.2,0.2
RESULT framework=torchrec pipeline=sparse_dist world=2 batch_per_rank=8192 dtype=fp32 ms_per_step=20.0
RESULT framework=embshard tag=fp32 pipeline=sparse_dist precision=fp32 pooled=fp32 world=2 ms_per_step=22.0
RESULT framework=embshard tag=bf16 pipeline=sparse_dist precision=bf16 pooled=bf16 world=2 ms_per_step=10.0
RESULT framework=embshard bench=loader layout=onehot workers=8 samples_per_s=5
"""


def test_report_pairs_each_run_with_the_baseline_before_it(tmp_path):
    (tmp_path / "emb.log").write_text(LOG)
    folder = report.load(tmp_path)
    assert folder.bandwidth == {"hbm": 3000e9, "link": 200e9} and folder.gpu == "NVIDIA H100 80GB HBM3"
    rows = {case: row for (case, *_), row in report.rows_of(folder).items()}
    u = rows["emb uniform26"]
    assert [round(x, 4) for x in u.ratios] == [1.25, 1.2] and report.verdict(u.ratios) == "leads"
    assert report.best_ratio(u) == f"{5.0 / 4.0:.3f}" and report.baseline_setting(u) == "its planner's default plan"
    floor, missing = report.floor_terms(u.emb[0], folder)  # the busier rank: 3 GB / 3000 GB/s + 0.2 GB / 200 GB/s
    assert floor == pytest.approx(2.0) and missing == []
    e2e = rows["e2e sparse_dist fp32 world 2"]
    assert e2e.ratios == [20.0 / 22.0] and report.verdict(e2e.ratios) == "trails"
    assert rows["e2e sparse_dist bf16 world 2"].ratios == [] and "emb onehot" not in rows
    region = report.render([folder])
    assert "embshard leads on uniform26 (1.20-1.25x)" in region and "it trails on end to end fp32" in region
    assert "-m bench.embshard_dmp --workload uniform26" in region  # recorded by path, shown as a module


def test_report_verdict_words_and_explicit_pairs(tmp_path):
    assert report.verdict([1.01, 0.99, 1.0]) == "parity" and report.verdict([0.9, 1.2]) == "mixed"
    assert report.verdict([0.8, 0.9, 0.95]) == "trails" and report.verdict([]) == "no baseline in this run"
    (tmp_path / "t.txt").write_text(
        "META date=2026-01-01 gpu=X source=summary\n"
        "RESULT framework=torchrec bench=emb workload=w ms_per_step=12 pair=a\n"
        "RESULT framework=torchrec bench=emb workload=w ms_per_step=10 pair=a\n"
        "RESULT framework=embshard bench=emb workload=w ms_per_step=8 pair=a\n"
    )
    (row,) = report.rows_of(report.load(tmp_path)).values()
    assert sorted(row.ratios) == [1.25, 1.5] and statistics.median(row.ratios) == 1.375


def test_floors_reproduce_the_uniform26_estimate():
    """26 x 1M x 128 table-wise on 2 ranks, batch 8192: 3.10 GB through GPU memory and 118 MB over the links per
    GPU; at 3,824 and 226 GB/s (2 x H200) that is the page's 1.33 ms."""
    from embshard import TableConfig, simple_plan

    tables = [TableConfig(f"t{i}", 1_000_000, 128, (f"f{i}",), ids_per_bag=10) for i in range(26)]
    parts = floors.embedding_bytes(tables, simple_plan(tables, 2), 8192)
    assert parts["hbm"] == [pytest.approx(3.1023e9, rel=1e-4)] * 2 and parts["host"] == [0.0, 0.0]
    assert parts["link"] == [pytest.approx(0.11757e9, rel=1e-4)] * 2
    assert parts["hbm"][0] / 3824e9 + parts["link"][0] / 226e9 == pytest.approx(1.331e-3, rel=1e-3)
    one_gpu = floors.single_gpu_e2e_fields(ROOT / "configs" / "dlrm_dcnv2_mlperf.yaml", 1.0, 8192, 4)
    assert "dense_gflop=787.9" in one_gpu and "floor_link_gb=0 " in one_gpu


def test_summaries_read_the_result_lines():
    soak = "RESULT framework=embshard bench=soak workload=uniform26 ms_per_step=4.7 allocated_gib_step100=7.8544 allocated_gib_step5000=7.8547"
    ((_, text),) = embedding.soak_summary(soak, args_for("soak"))
    assert "no growth" in text and "step 5000" in text
    grown = soak.replace("7.8547", "7.9544")
    assert "GROWTH +102.4 MiB" in embedding.soak_summary(grown, args_for("soak"))[0][1]
    rows = training.compare_summary(LOG, args_for("emb"))
    assert any("ratio 1.225 (1.200-1.250; n=2): leads" in text for _, text in rows), rows
    tests_args = argparse.Namespace(out="/nonexistent")
    assert checks.tests_summary("===== 3 passed, 1 skipped in 2.0s =====\nFAILED tests/x.py::t - boom", tests_args) == [
        ("pytest", "3 passed, 1 skipped in 2.0s"), ("failed", "tests/x.py::t")
    ]  # fmt: skip


def test_tests_summary_names_the_slowest_files_of_a_run_stopped_at_its_limit(tmp_path):
    (tmp_path / "test_times.txt").write_text(
        "    3.00 setup    tests/a.py::t1 passed\n   40.50 call     tests/b.py::t[1] failed\n"
        "    2.00 call     tests/a.py::t2 passed\n"
    )
    rows = checks.tests_summary("....", argparse.Namespace(out=str(tmp_path)))
    assert rows == [
        ("pytest", "no pytest summary line"),
        ("slowest files", "tests/b.py 40 s, tests/a.py 5 s (test_times.txt)"),
    ]


def test_a_failure_reaches_the_log_of_a_run_stopped_at_its_limit(tmp_path, monkeypatch):
    """tests/conftest.py writes a failed phase's text to test_times.txt.failures as it happens; the tests suite
    prints that file into its log after pytest, also when the time limit stopped it, and its summary names it."""
    import conftest

    times = tmp_path / "test_times.txt"
    monkeypatch.setenv("EMBSHARD_TEST_TIMES", str(times))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    text = "x" * 5000 + "\nE   AssertionError: rank 0 raised at step 0"
    phase = dict(duration=37.6, when="call", nodeid="tests/a.py::t", longreprtext=text)
    conftest.pytest_runtest_logreport(argparse.Namespace(**phase, failed=True, outcome="failed"))
    conftest.pytest_runtest_logreport(argparse.Namespace(**phase, failed=False, outcome="passed"))
    written = (tmp_path / "test_times.txt.failures").read_text()
    assert written.startswith("FAILED tests/a.py::t (call, 37.6 s)\n[... its first") and written.count("FAILED") == 1
    assert written.rstrip().endswith("E   AssertionError: rank 0 raised at step 0") and len(written) < 3200
    assert times.read_text().splitlines()[0].split() == ["37.60", "call", "tests/a.py::t", "failed"]
    args = args_for("tests", "--suite-minutes", "1")
    args.out = str(tmp_path)
    (step,) = checks.tests_steps(args, H100)
    step.argv, step.timeout = ["bash", "-c", "echo ....; sleep 30"], 1.0  # stopped at its limit, no pytest summary
    monkeypatch.setitem(suites.SUITES, "tests", dataclasses.replace(suites.SUITES["tests"], steps=lambda a, m: [step]))
    rows = run.run_suite("tests", args, {}, H100)
    log = (tmp_path / "tests.log").read_text()
    assert "!! stopped after" in log and "--- failed tests as they ended (test_times.txt.failures) ---" in log
    assert log.index("!! stopped after") < log.index("E   AssertionError: rank 0 raised at step 0")
    assert ("tests", "failed", "tests/a.py::t") in rows
    assert any(w == "pytest" and r.startswith("stopped at the time limit") for _, w, r in rows), rows


def test_rawids_summary_sets_torchrecs_managed_collisions_beside_raw_ids(tmp_path):
    mc = (
        "RESULT bench=torchrec_mc framework=torchrec workload=uniform26 world=2 ids=static id_space=10 ms_per_step=3.0\n"
        "RESULT bench=torchrec_mc framework=torchrec workload=uniform26 world=2 ids=mc id_space=10 ms_per_step=7.5\n"
    )
    raw = ("RESULT framework=embshard bench=rawids workload=uniform26 world=2 ids=static id_space=10 ms_per_step=2.0\n"
           "RESULT framework=embshard bench=rawids workload=uniform26 world=2 ids=raw id_space=10 ms_per_step=3.0 "
           "admitted=9 evicted=4\n")  # fmt: skip
    rows = dict(rawids.rawids_summary(raw + mc, args_for("rawids")))
    text = rows["uniform26 world 2, id space 10 x rows"]
    assert "raw 3.00 ms (1.50x; admitted 9, evicted 4)" in text and "managed collisions 7.50 ms (2.50x)" in text
    assert dict(rawids.rawids_summary(mc, args_for("rawids")))["uniform26 world 2, id space 10 x rows"].startswith(
        "TorchRec static 3.00 ms"
    )
    # In the results table they are neither a TorchRec baseline of the emb case nor a row of their own.
    (tmp_path / "emb.log").write_text(
        LOG.replace("RESULT framework=torchrec bench=emb", mc + "RESULT framework=torchrec bench=emb")
    )
    assert report.parse_line(mc.splitlines()[1])["ids"] == "mc"
    cases = {case: row for (case, *_), row in report.rows_of(report.load(tmp_path)).items()}
    assert [round(x, 4) for x in cases["emb uniform26"].ratios] == [1.25, 1.2]
    assert not any("torchrec_mc" in c for c in cases)
    only = tmp_path / "only_mc"
    only.mkdir()
    (only / "rawids.log").write_text(mc)
    assert report.folders_in([str(only)]) == [] and report.compared_commands(report.load(only)) == []


def test_tests_suite_spreads_tests_over_xdist_workers_only_when_installed(monkeypatch):
    for installed in (True, False):
        _installed(monkeypatch, "xdist", installed)
        (step,) = steps("tests", "--test-workers", "4")
        assert (" -n 4 --dist loadgroup " in f" {' '.join(step.argv)} ") == installed
        (step,) = steps("tests")  # the default on a GPU host of 32 CPUs: 8 workers
        assert (" -n 8 " in f" {' '.join(step.argv)} ") == installed
        for machine in (suites.Machine(gpus=2, cpus=8), suites.Machine(gpus=0, cpus=32)):
            (step,) = steps("tests", machine=machine)
            assert "-n" not in step.argv
        (step,) = steps("tests", "--test-workers", "0")
        assert "-n" not in step.argv


def test_mlperf_workload_is_the_mlperf_configs_tables():
    """bench/embshard_dmp.py's `mlperf` workload (the end-to-end model's embedding part, timed alone) has the tables
    of configs/dlrm_dcnv2_mlperf.yaml: rows, width and multi-hot size, in order; and its batch."""
    from bench import workloads
    from embshard.config import load_config

    cfg = load_config(str(ROOT / "configs" / "dlrm_dcnv2_mlperf.yaml"))
    spec, batch = workloads.WORKLOADS["mlperf"]
    want = [(t.num_embeddings, t.embedding_dim, t.ids_per_bag) for t in cfg.model.tables]
    assert spec == want and batch == cfg.schedule.batch_size


def test_e2e_data_law_reaches_both_frameworks_and_splits_the_cases():
    """--data-law zipf-poisson: TorchRec's baseline and embshard draw Zipf ids and Poisson bags; the report compares
    a run only with runs of its own law (older lines without the law count as the MLPerf law)."""
    tr, mine = steps(
        "e2e",
        "--data-law",
        "zipf-poisson",
        "--precisions",
        "bf16",
        "--pairs",
        "1",
        "--no-bandwidth",
        "--no-torchrec-best",
    )
    assert tr.argv[-5:] == ["--ids", "zipf", "--zipf-alpha", "1.05", "--bag-lengths", "poisson"][-5:]
    assert {"data.synthetic.zipf_exponent=1.05", "data.synthetic.bag_lengths=poisson"} <= set(mine.argv)
    plain = steps("e2e", "--precisions", "bf16", "--pairs", "1", "--no-bandwidth")
    assert not any("zipf" in a for s in plain for a in s.argv)
    base = {"framework": "torchrec", "pipeline": "sparse_dist", "precision": "bf16"}
    assert report.case_of(base) == report.case_of({**base, "ids": "uniform", "bags": "fixed"})
    assert report.case_of({**base, "ids": "zipf", "bags": "poisson"}) != report.case_of(base)


def test_scaling_suite_pairs_torchrec_and_embshard_at_4_gpus_and_reads_the_per_gpu_rates():
    """Weak scaling: per round and precision TorchRec at 4, embshard at 4 and 2; embshard at 1 on half the rows.
    The report keeps the world sizes and row fractions apart, so a 4-GPU run is never paired with a 2-GPU one."""
    got = steps("scaling", "--pairs", "2", "--precisions", "fp32,bf16")
    labels = [s.label for s in got]
    round_ = [
        f"{w} {p}, {n} GPUs" for p in ("fp32", "bf16") for w, n in (("TorchRec", 4), ("embshard", 4), ("embshard", 2))
    ]
    assert labels == round_ * 2 + ["embshard fp32, 1 GPUs", "embshard bf16, 1 GPUs"]
    one = got[-1].argv
    assert one[one.index("--scale") + 1] == "0.5" and one[one.index("--nproc") + 1] == "1"
    assert [s.needs_gpus for s in got[:3]] == [4, 4, 2]
    log = "\n".join(
        f"RESULT framework={fw} pipeline=sparse_dist precision=bf16 world={w} scale={sc} ms_per_step={ms} samples_per_s={w * 8192 / ms * 1e3:.0f}"
        for fw, w, sc, ms in [("torchrec", 4, 1, 10.0), ("embshard", 4, 1, 8.0), ("embshard", 2, 1, 7.5),
                              ("torchrec", 4, 1, 12.0), ("embshard", 4, 1, 8.0), ("embshard", 2, 1, 7.5),
                              ("embshard", 1, 0.5, 6.0)]
    )  # fmt: skip
    ((label, text),) = training.scaling_summary(log, args_for("scaling", "--precisions", "bf16"))
    assert label == "weak scaling, bf16"
    assert "1 GPUs 1,365,333, 2 GPUs 1,092,266, 4 GPUs 1,024,000" in text and "keep 93.8%" in text
    assert "TorchRec at 4 GPUs 750,933 per GPU, embshard 1.375 (1.250-1.500; n=2)" in text
    runs = [report.parse_line(x) for x in log.splitlines()]
    assert len({report.case_of(r) for r in runs}) == 3  # world 4, world 2, world 1 at half the rows
    assert report.case_of(runs[0]) == report.case_of(runs[1])
    halved = {"framework": "torchrec", "pipeline": "sparse_dist", "precision": "bf16", "world": "1", "scale": "2"}
    assert report.case_of(halved) == report.case_of(runs[-1])  # TorchRec's --scale 2 is embshard's 0.5


def test_profile_shares_of_the_window():
    """bench/train_e2e.py's profile summary: the share of the window any kernel runs, without NCCL kernels, and
    the compute streams' share (every stream running a kernel other than NCCL's and the copies: a graph's replay
    spreads its chain over several; their kernels other than NCCL's), on hand-made kernel spans of five streams."""
    from types import SimpleNamespace

    from bench import train_e2e

    def kernel(start, end, stream, name="gemm"):
        return SimpleNamespace(
            name=name, stream=stream, start=start, end=end, time_range=SimpleNamespace(start=start, end=end)
        )

    nccl = "ncclDevKernel_SendRecv"
    kernels = [kernel(0, 10, 7), kernel(12, 20, 7), kernel(5, 8, 21), kernel(18, 30, 21, nccl)]
    kernels += [kernel(0, 26, 33, nccl)]  # the busiest stream, but NCCL's
    kernels += [kernel(20, 25, 29, "Memcpy HtoD (Pinned -> Device)")]  # the batch's copy stream: not computing
    kernels += [kernel(22, 24, 40), kernel(24, 25, 40, "Memset (Device)")]  # a graph's branch: its memset counts
    busy, busy_compute, _ = train_e2e.busy_share(kernels, 1)
    assert busy == pytest.approx(1.0) and busy_compute == pytest.approx(23 / 30)
    streams, share, shares = train_e2e.stream_shares(kernels)
    assert streams == [7, 21, 40] and share == pytest.approx(21 / 30)  # [0, 10] [12, 20] [22, 25]
    assert [k for k, _ in shares][:2] == [33, 7] and shares[0][1] == pytest.approx(26 / 30)
    assert train_e2e.stream_shares([])[0] == []


def test_timeline_gaps_name_the_idle_stretches_of_the_busiest_stream(capsys):
    from bench import timeline

    def k(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "args": {"stream": stream}}

    kernels = [k("gemm_a", 0, 100, 7), k("ncclDevKernel_SendRecv", 105, 60, 9), k("tbe_bwd", 180, 50, 7),
               k("add", 232, 3, 7)]  # fmt: skip
    lane_of = {(0, 7): 0, (0, 9): 1}
    timeline.print_gaps(kernels, lane_of, 0, 0.0, 8)
    out = capsys.readouterr().out
    assert "idle    80.0 us at    0.100 ms: after 'gemm_a', before 'tbe_bwd'" in out  # the 2 us gap is below 8
    assert "other stream 1:    0.105 +60.0 us ncclDevKernel_SendRecv" in out
    assert out.strip().endswith("idle stretches of >= 8 us: 0.080 ms in all")


def test_e2e_report_pairs_embshard_with_torchrec_plain_and_at_its_best():
    """Interleaved TorchRec bf16, TorchRec bf16 at its best, embshard bf16: each embshard run gets one ratio against
    each TorchRec setting, in two rows."""
    plain = "RESULT framework=torchrec pipeline=sparse_dist world=2 precision=bf16 qcomm=none emb_output=fp32 compile_dense=0"
    best = "RESULT framework=torchrec pipeline=sparse_dist world=2 precision=bf16 qcomm=bf16 emb_output=bf16 compile_dense=1"
    mine = "RESULT framework=embshard pipeline=sparse_dist world=2 precision=bf16 pooled=bf16"
    log = "\n".join(
        f"{a} ms_per_step={b}" for a, b in [(plain, 20), (best, 12), (mine, 10), (plain, 22), (best, 11), (mine, 11)]
    )
    folder = report.Folder(Path("x"), runs=[r | {"_file": "e2e.log"} for r in common.results(log)])
    rows = {row.theirs: row for row in report.rows_of(folder).values()}
    assert rows[""].ratios == [2.0, 2.0] and rows["qcomm bf16, emb output bf16, compiled dense"].ratios == [1.2, 1.0]
    assert report.baseline_setting(rows["qcomm bf16, emb output bf16, compiled dense"]).endswith("compiled dense")
    summary = dict(training.compare_summary(log, args_for("e2e")))
    assert len(summary) == 2 and any("against TorchRec with qcomm bf16" in k for k in summary)


def test_bench_readme_suites_table_is_generated_from_the_registry():
    readme = ROOT / "bench" / "README.md"
    text = readme.read_text()
    assert suites.replace_table(text) == text, (
        "bench/README.md is stale: run `python -m bench.suites --update bench/README.md`"
    )
    assert "| `scaling` |" in text and all(f"| `{name}` |" in text for name in suites.SUITES)
    stale = text.replace("| `scaling` |", "| `scaling-old` |")
    assert suites.replace_table(stale) == text  # a drifted row is put back


def test_bench_modules_import_no_sibling_by_path_and_form_no_circle():
    """bench's modules import each other as `bench.x` (no sys.path edits), and no import chain comes back to its
    start (lazy imports included)."""
    import ast

    graph: dict[str, set[str]] = {}
    siblings = {p.stem for p in (ROOT / "bench").glob("*.py")} | {"suites"}
    for path in (ROOT / "bench").rglob("*.py"):
        if "baselines" in path.parts or "results" in path.parts:
            continue
        text = path.read_text()
        assert "sys.path" not in text, path
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("bench"))
            tops = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            tops += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bare = [t for t in tops if t.split(".")[0] in siblings]
            assert not bare, f"{path.relative_to(ROOT)} imports {bare} by bare name: import it from bench"
    graph = {k: {d for d in v if d in graph and d != k} for k, v in graph.items()}
    package_of = {k: k.rpartition(".")[0] for k in graph}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            n = todo.pop()
            if n == start and package_of.get(start) != start:
                raise AssertionError(f"import circle through {start}")
            if n not in seen:
                seen.add(n)
                todo += graph.get(n, ())


def _shared_baselines() -> Path | None:
    for where in (ROOT / "shared" / "baselines", ROOT.parent / "shared" / "baselines"):
        if where.is_dir():
            return where
    return None


@pytest.mark.skipif(_shared_baselines() is None, reason="no shared/baselines folder beside the repository")
def test_baselines_are_byte_identical_copies_of_the_shared_ones():
    shared = _shared_baselines()
    ours = ROOT / "bench" / "baselines"
    theirs = sorted(p.name for p in shared.iterdir() if p.is_file())
    assert sorted(p.name for p in ours.iterdir() if p.is_file()) == theirs, f"refresh: cp {shared}/* bench/baselines/"
    stale = [n for n in theirs if (ours / n).read_bytes() != (shared / n).read_bytes()]
    assert not stale, f"bench/baselines/ differs from {shared} in {stale}: cp {shared}/* bench/baselines/"


def test_summarize_keeps_the_key_lines_and_the_report_reads_the_same_runs(tmp_path):
    """A run's folder summarized: RESULT, META and bandwidth lines kept in `log` blocks, noise dropped, raw files
    moved to the raw folder, README.md kept; the report reads the same runs from the summary as from the logs."""
    from bench import summarize

    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (run_dir / "emb.log").write_text(
        'META date=2026-01-02 gpu="X" gpus=2\nMETA command="python bench/embshard_dmp.py --workload w"\n'
        + "noise\n" * 500
        + "GPU memory copy: 3000.0 GB/s\n"
        "RESULT framework=torchrec bench=emb workload=w ms_per_step=12\n"
        "RESULT framework=embshard bench=emb workload=w ms_per_step=10\n"
    )
    (run_dir / "explore.out").write_text("RESULT framework=embshard bench=emb workload=w ms_per_step=1\n")
    (run_dir / "README.md").write_text("# notes, code abc1234\n")
    before = report.rows_of(report.load(run_dir))
    dest, raw = tmp_path / "results" / "2026-01-02-x", tmp_path / "raw" / "2026-01-02-x"
    text = summarize.summarize(run_dir, dest, raw).read_text()
    assert "noise" not in text and "code commit: abc1234" in text and "```text" in text
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "summary.md"]
    assert (raw / "emb.log").exists() and (raw / "explore.out").exists()
    after = report.load(dest)
    assert [r["ms_per_step"] for r in after.runs] == ["12", "10"] and after.bandwidth == {"hbm": 3000.0e9}
    assert [row.ratios for row in report.rows_of(after).values()] == [row.ratios for row in before.values()] == [[1.2]]
    assert report.module_form(after.commands[0][1]) == "python -m bench.embshard_dmp --workload w"


def test_results_in_git_are_summaries_under_650_kb():
    kept = [p for p in (ROOT / "bench" / "results").rglob("*") if p.is_file() and "raw" not in p.parts]
    assert {p.suffix for p in kept} <= {".md"}, sorted({p.suffix for p in kept})
    assert all(
        (d / "summary.md").exists() for d in (ROOT / "bench" / "results").iterdir() if d.is_dir() and d.name != "raw"
    )
    assert sum(p.stat().st_size for p in kept) < 650_000


def test_serve_suite_device_and_summary():
    on_gpu = steps("serve")
    assert [s.argv[2] for s in on_gpu] == ["bench.serve_latency", "bench.serve_quality"]
    assert all("--device" in s.argv and s.argv[s.argv.index("--device") + 1] == "cuda" for s in on_gpu)
    assert all(s.needs_gpus == 1 for s in on_gpu)
    cpu = steps("serve", "--device", "cpu") + steps("serve", machine=suites.Machine(cpus=4))
    assert all(s.argv[s.argv.index("--device") + 1] == "cpu" and s.needs_gpus == 0 for s in cpu)
    log = "\n".join([
        "PASS serve_latency same scores: max |embshard - torchrec| = 1.2e-05 (tolerance 0.002), int8, cuda",
        "FAIL serve_latency cuda vs cpu scores: max difference 3.0e-03",
        "RESULT serve_latency side=embshard batch=64 p50_ms=0.200 p99_ms=0.300 dtype=int8 device=cuda",
        "RESULT serve_latency side=torchrec batch=64 p50_ms=0.500 p99_ms=0.700 dtype=int8 device=cuda",
        "RESULT serve_latency side=embshard batch=8192 throughput=4000000/s p99_ms=3.000 dtype=int8 device=cuda",
        "RESULT serve_latency side=torchrec batch=8192 throughput=1000000/s p99_ms=9.000 dtype=int8 device=cuda",
        "RESULT serve_quality dtype=int4 auc=0.70100 delta_auc=-0.00200 table_bytes=10 size_ratio=6.40 score_s=0.10 "
        "PASS",
    ])  # fmt: skip
    rows = dict(suites.SUITES["serve"].summary(log, args_for("serve")))
    assert rows["checks"] == "1 PASS, 1 FAIL: serve_latency cuda vs cpu scores: max difference 3.0e-03"
    assert "TorchRec/embshard p50 2.50x (embshard faster)" in rows["batch 64, int8 on cuda"]
    assert "embshard/TorchRec 4.00x" in rows["batch 8192, int8 on cuda"]
    assert rows["quality int4"] == "AUC 0.70100 (-0.00200 from fp32), tables 6.40x smaller: PASS"
    assert suites.SUITES["serve"].summary("", args_for("serve")) == [("serve", "no RESULT lines (see serve.log)")]
