"""`embshard train` end to end on 2 CPU processes: every example config's held-out loss falls, the run prints the
plan, progress and AUC (and no library warning) and writes TensorBoard events and checkpoints; a run resumed from a
checkpoint ends exactly like the straight run, also after a rank is killed under torchrun with restarts, and
resumes on 3 processes; a schedule that ends before the checkpoint's step stops with a message; config, data and
planning errors exit with a message and status 2; a plan saved by `embshard plan` trains; `--nproc` ranks read
through data workers; the torchx component launches a CPU run of 2 nodes (2D sharding across its two launchers);
two torchrun launchers train as 2 hosts x 2 on one machine (docs/launch.md).

The runs that test training rather than the command line (the example configs but dlrm_criteo, the resumed runs,
the saved plan) run embshard.training.train's job in processes forked for them on machines without CUDA (tests/train_job.py:
`embshard train --nproc 2` starts two Python processes, its own and its ranks' fork server, most of a short
run's time); dlrm_criteo, the restart under torchrun, the errors, torchx, the two launchers and the benchmark go
through the command line."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import paths
import pytest
import torch
from train_job import Ran, embshard_train, embshard_train_exit, module_ranks

ROOT = paths.ROOT
BIN = Path(sys.executable).parent

# Keep every run short: the sample configs already are; the synthetic one is cut to 40 steps (its held-out loss
# falls by then).
SHORTEN = {
    "dlrm_criteo.yaml": ["checkpoint.every=10"],  # step_10 is resumed by checkpoint_checks
    "dlrm_criteo_raw.yaml": [],  # raw ids (docs/raw_ids.md)
    "dcn_criteo.yaml": ["training.compile=default"],  # compiled on GPUs; the CPU falls back to eager
    "two_tower_movielens.yaml": [],
    "dlrm_synthetic.yaml": ["schedule.steps=40", "schedule.eval_every=0", "checkpoint.every=0"],
    "two_tower_movielens_full_softmax.yaml": [],
    "two_tower_synthetic_1m.yaml": [
        "model.tables[0].num_embeddings=2000",
        "model.tables[1].num_embeddings=20000",
        "data.synthetic.affinity.clusters=100",
        "schedule.batch_size=64",
        "schedule.steps=40",
        "schedule.eval_every=0",
    ],
}
# A compiled run's ranks compile in their own process: the dense part is a few kernels, and inductor's default pool
# of compile workers (one process per CPU, up to 32, per rank) costs more than it saves beside the suite's other tests.
COMPILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
# The MovieLens sample's held-out movies are almost all unseen in training: with the catalog softmax only the
# training loss falls there (and recall@K is reported); every other config's held-out loss falls.
TRAIN_LOSS_ONLY = {"two_tower_movielens_full_softmax.yaml"}
# Where `embshard train` runs its 2 processes: the GPUs when asked for CUDA and 2 are there, else the CPU (gloo).
DEVICE = "cuda" if os.environ.get("EMBSHARD_TEST_DEVICE", "cpu") == "cuda" and torch.cuda.device_count() >= 2 else "cpu"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")  # the venv's torchrun / torchx first
    if DEVICE == "cpu":
        e["CUDA_VISIBLE_DEVICES"] = ""  # CPU runs (gloo) even on a GPU machine unless asked for CUDA on 2 GPUs
    return e


def train(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embshard.cli", "train", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_job(args: list[str], nproc: int, extra_env: dict[str, str] | None = None) -> Ran:
    """A successful `embshard train ARGS --nproc N`: in processes forked for it where train_job.IN_TEST_RANKS
    (tests/train_job.py), else by the command line (with `extra_env`)."""
    return embshard_train(args, nproc, env=env() | (extra_env or {}))


def outputs(tmp: Path) -> list[str]:
    return [
        f"logging.metrics_file={tmp}/metrics.jsonl",
        f"logging.tensorboard_dir={tmp}/tb",
        f"checkpoint.dir={tmp}/ck",
        "schedule.eval_at_start=true",
    ]


def library_noise(res: subprocess.CompletedProcess | Ran) -> list[str]:
    """Lines of a run's output that are library warnings or their echoed source lines, or an extension's report of
    objects alive at exit (none should be printed: embshard/runtime/heap.py unfreezes them for the last collection)."""
    lines = (res.stdout + res.stderr).splitlines()
    noise = ("Warning", "warn(", "nanobind: leaked")
    return [x for x in lines if any(n in x for n in noise) or x.strip().startswith("return func(")]


def metrics(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


# Trained by test_train_e2e_benchmark_trains_scaled_down_on_cpu (bench/train_e2e.py, the same pipeline).
E2E_TESTED = {"dlrm_dcnv2_mlperf.yaml"}
# tests/models/test_sequential.py: sequential_synthetic trained on 1 and 2 processes; sequential_movielens (it needs
# MovieLens-1M's ratings) loaded and read from a file of its layout; tests/models/test_sequence_tables.py:
# sequential_side trained on 1 and 2 processes.
SEQUENTIAL_TESTED = {"sequential_synthetic.yaml", "sequential_movielens.yaml", "sequential_side.yaml"}


def test_examples_are_all_tested():
    tested = [*SHORTEN, *E2E_TESTED, *SEQUENTIAL_TESTED]
    assert sorted(tested) == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.timeout(220)  # dlrm_criteo's train, plan and resume runs: ~100 s on a loaded 2-GPU machine
@pytest.mark.parametrize("name", sorted(SHORTEN))
def test_example_config_trains_on_two_processes(name, tmp_path):
    args = [f"configs/{name}", *outputs(tmp_path), *SHORTEN[name]]
    if name == "dlrm_criteo.yaml":  # the command line's own run (the others: train_job)
        res = train([*args, "--nproc", "2"])
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    else:
        res = train_job(args, 2, COMPILE_ENV if "training.compile=default" in args else None)
    assert not library_noise(res), library_noise(res)[:10]  # the ranks and data workers print no library warnings
    out = res.stdout
    assert "ShardingPlan: world_size=2" in out and f"2 ranks on {DEVICE}" in out
    assert "predicted step time" in out and "source: detected" in out  # strategy auto: the planner's report
    assert "samples/s" in out and ("auc" in out or "recall@10" in out)
    m = metrics(tmp_path)
    assert m[0]["step"] == 0 and m[-1]["step"] > 0
    assert m[0]["samples"] == m[-1]["samples"] > 0  # the same held-out data before and after
    if name in TRAIN_LOSS_ONLY:
        train_losses = [float(v) for v in re.findall(r"train step +\d+ +loss ([0-9.]+)", out)]
        assert len(train_losses) > 1 and train_losses[-1] < train_losses[0], train_losses
    else:
        assert m[-1]["loss"] < m[0]["loss"], m
    assert 0.0 <= m[-1].get("auc", 0.5) <= 1.0
    if "recall@10" in m[-1]:  # two-tower catalog mode: recall over the whole catalog
        assert all(0.0 <= e[k] <= 1.0 for e in m for k in e if k.startswith("recall@")), m
        assert name in TRAIN_LOSS_ONLY or m[-1]["recall@10"] > m[0]["recall@10"], m
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "ck" / f"step_{m[-1]['step']}" / "COMMIT").is_file()
    steps = [line for line in out.splitlines() if line.startswith("step: ")]  # the step mode, one line (rank 0)
    assert len(steps) == 1, steps
    assert DEVICE == "cuda" or steps[0].startswith("step: eager, fp32 pooled outputs (auto"), steps
    if "training.compile=default" in SHORTEN[name] and DEVICE == "cpu":
        assert "training.compile default off: torch.compile runs on CUDA GPUs only)" in steps[0], steps
    if name == "dlrm_criteo.yaml":
        checkpoint_checks(tmp_path, m)
    if name == "dlrm_criteo_raw.yaml":  # raw-id statistics in the log and in TensorBoard
        lines = re.findall(r"raw ids step +\d+ +26 tables: admitted ([\d,]+) +evicted ([\d,]+) +resident ([\d,]+)", out)
        assert lines and int(lines[0][0].replace(",", "")) > 0, out[-2000:]
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tags = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"]
        assert {"raw_ids/t_C1/admitted", "raw_ids/t_C26/resident", "raw_ids/all/evicted"} <= set(tags), tags


# dlrm_criteo.yaml's runs of a fixed number of steps (its schedule: 20 steps, evaluations at 0, 10 and 20)
CRITEO = [
    "configs/dlrm_criteo.yaml",
    "schedule.epochs=null",
    "logging.tensorboard_dir=null",
    "logging.progress_bar=false",
]


def checkpoint_checks(tmp: Path, straight: list[dict]) -> None:
    """The 20-step run saved step 10 on the way (`straight`: its evaluations at 0, 10, 20). A run of 20 steps
    resumed from it (`resume_from=latest`, 2 processes) ends with the same held-out loss and AUC, bitwise. (Other
    world sizes and a rank killed under torchrun: tests of their own below, so that each stays well within the
    suite's per-test limit on GPUs, where every run is three new processes.)"""
    assert [m["step"] for m in straight] == [0, 10, 20]
    resumed = tmp / "resumed"
    shutil.copytree(tmp / "ck" / "step_10", resumed / "ck" / "step_10")
    res = train_job(
        [*CRITEO, "schedule.steps=20", f"checkpoint.dir={resumed}/ck", "checkpoint.resume_from=latest"]
        + [f"logging.metrics_file={resumed}/metrics.jsonl"],
        2,
    )
    assert f"resumed from {resumed}/ck/step_10 at step 10" in res.stdout
    assert metrics(resumed) == [straight[-1]]  # step 20: the same loss, AUC and samples, bitwise


@pytest.mark.timeout(220)  # three `embshard train` runs, each starting its processes (seconds each on GPUs)
def test_resume_on_another_world_size_and_a_schedule_ending_before_the_checkpoint(tmp_path):
    """dlrm_criteo's checkpoint of step 10 (2 processes x 16: 320 samples) resumes on 3 processes (on 1 where 2 GPUs
    are all there are: one process per GPU) with the schedule kept in samples: it goes on at the step of 3 x 16 that
    holds 320 samples and ends where schedule.epochs=4 ends on 3 processes, one log line saying so; a schedule that
    ends before the newest checkpoint stops with the steps and the fix (1 process)."""
    ck = tmp_path / "ck"
    train_job([*CRITEO, "schedule.steps=10", "schedule.eval_every=0", "checkpoint.every=10", f"checkpoint.dir={ck}"], 2)
    assert (ck / "step_10" / "COMMIT").is_file()
    three = tmp_path / "three"
    other = 3 if DEVICE == "cpu" or torch.cuda.device_count() >= 3 else 1  # one process per GPU: 2 -> 1 on 2 GPUs
    res = train_job(
        [*CRITEO, "schedule.epochs=4", "schedule.eval_every=0", f"checkpoint.resume_from={ck}/step_10"]
        + [f"checkpoint.dir={three}/ck"]
        + [f"logging.metrics_file={three}/metrics.jsonl"],
        other,
    )
    assert f"resumed from {ck}/step_10 at step 10" in res.stdout
    assert f"ShardingPlan: world_size={other}" in res.stdout
    per_step, per_epoch = 16 * other, 160 // other // 16  # 160 training rows: each rank's whole batches
    here, end = 320 // per_step, 4 * per_epoch  # 3 processes: step 6 of 48 samples, to step 12
    if other != 2:
        assert (
            f"schedule: the checkpoint's 10 steps of 32 samples (320 samples) are step {here} of this run's steps of "
            f"{per_step} ({other} ranks x 16); schedule.epochs=4 ends at step {end} ({end * per_step:,} samples)"
        ) in res.stdout
    (m,) = metrics(three)
    assert m["step"] == end and 0 < m["loss"] < 1 and 0 <= m["auc"] <= 1
    code, res = embshard_train_exit(
        [*CRITEO, "schedule.steps=5", f"checkpoint.dir={ck}", "checkpoint.resume_from=latest"]
    )
    assert code == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert (
        f"checkpoint '{ck}/step_10' was saved after step 10 (step 20 of this run's steps), but this run's "
        in res.stderr
    )
    assert "schedule ends at step 5 " in res.stderr
    assert "(schedule.steps=5): it would train no step. Fix: a schedule past step 20" in res.stderr  # 320 samples
    assert "Traceback" not in res.stderr and "train step" not in res.stdout


def test_a_rank_killed_under_torchrun_restarts_from_the_latest_checkpoint(tmp_path):
    """Rank 1 killed with SIGKILL at step 7 under torchrun --max-restarts=1 (checkpoints every 5 steps): the job
    restarts from its latest complete checkpoint (step 5) and ends with the numbers of an uninterrupted run (trained
    beside it, at the same time), bitwise."""
    elastic, straight = tmp_path / "elastic", tmp_path / "straight"
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    torchrun += ["--monitor-interval=0.1", str(ROOT / "tests" / "ckpt_faults.py"), "train"]
    env_kill = dict(env(), KILL_STEP="7", KILL_RANK="1", KILL_AFTER=f"{elastic}/ck/step_5")
    env_kill["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as launch/torchrun.sh sets it (docs/launch.md)
    args = [*CRITEO, "schedule.steps=20", "schedule.eval_at_start=true", f"checkpoint.dir={elastic}/ck"]
    args += ["checkpoint.every=5", "checkpoint.resume_from=latest", f"logging.metrics_file={elastic}/metrics.jsonl"]
    elastic.mkdir()
    with open(elastic / "stdout", "w") as out, open(elastic / "stderr", "w") as err:
        job = subprocess.Popen(torchrun + args, cwd=ROOT, env=env_kill, stdout=out, stderr=err, text=True)
        try:
            train_job(
                [*CRITEO, "schedule.steps=20", "schedule.eval_at_start=true", f"checkpoint.dir={straight}/ck"]
                + [f"logging.metrics_file={straight}/metrics.jsonl"],
                2,
            )
            returncode = job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    stdout = (elastic / "stdout").read_text()
    log = stdout + (elastic / "stderr").read_text()
    assert returncode == 0, log[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in log, log[-4000:]  # rank 1 was killed, the job went on
    assert f"resumed from {elastic}/ck/step_5 at step 5" in stdout, log[-4000:]
    got, want = metrics(elastic), metrics(straight)  # step 0 (first attempt), then 10 and 20 after the restart
    assert [m["step"] for m in want] == [0, 10, 20]
    assert [m["step"] for m in got] == [0, 10, 20] and got[1:] == want[1:], (got, want)


def test_local_ranks_read_through_data_workers(tmp_path):
    """`embshard train --nproc 2` with a data worker per rank (data.synthetic.workers=1): the ranks (on machines
    without CUDA forks of a fork server) start their DataLoader workers as any process does, and train."""
    args = ["configs/dlrm_synthetic.yaml", "--nproc", "2", "schedule.steps=2", "schedule.eval_every=0"]
    args += ["data.synthetic.workers=1", "data.synthetic.eval_batches=1", "logging.tensorboard_dir=null"]
    res = train(
        [*args, "checkpoint.dir=null", "logging.progress_bar=false", f"logging.metrics_file={tmp_path}/metrics.jsonl"]
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not library_noise(res), library_noise(res)[:10]
    assert re.search(r"train step +2 +loss", res.stdout), res.stdout[-2000:]
    assert [m["step"] for m in metrics(tmp_path)] == [0, 2]


def test_train_e2e_benchmark_trains_scaled_down_on_cpu():
    """bench/train_e2e.py on the MLPerf config at 1e-5 of its rows (40M-row tables keep 400), 2 CPU processes: the
    plan summary, the build time, the held-out AUC rising, the RESULT line and the last line with the global
    samples/s."""
    argv = ["--config", "configs/dlrm_dcnv2_mlperf.yaml", "--scale", "1e-5", "--steps", "20", "--warmup", "5",
            "--batch-size", "32", "--eval", "model.dlrm.bottom_mlp=[32]", "model.dlrm.top_mlp=[64]",
            "model.dcn.low_rank=16", "sparse_optimizer.lr=0.05", "dense_optimizer.lr=0.01",
            "data.synthetic.eval_batches=4"]  # fmt: skip
    res = module_ranks("bench.train_e2e", argv, 2, env())  # its ranks forked for it on the CPU (train_job)
    out = res.stdout.strip().splitlines()
    assert out[0].startswith("plan: ") and "predicted step time" in out[0]
    assert any(line.startswith("plan+build ") for line in out)
    result = next(line for line in out if line.startswith("RESULT framework=embshard"))
    fields = dict(kv.split("=", 1) for kv in result.split()[1:])
    assert fields["world"] == "2" and fields["batch_per_rank"] == "32" and float(fields["ms_per_step"]) > 0
    assert float(fields["build_s"]) > 0 and fields["pipeline"] == "sparse_dist"
    assert float(fields["auc_before"]) + 0.05 < float(fields["auc"]) <= 1.0, result
    assert re.fullmatch(r"samples_per_s=\d+", out[-1]) and int(out[-1].split("=")[1]) > 0


@pytest.mark.timeout(420)  # the dense part's compile and the graphs' captures
def test_mlperf_config_in_bf16_takes_the_whole_step_graph_by_default():
    """On GPUs (EMBSHARD_TEST_DEVICE=cuda): `embshard train configs/dlrm_dcnv2_mlperf.yaml training.precision=bf16`,
    at 1/400 of its rows and 50 steps, and nothing else switched on, prints the fast step mode (the whole step as one
    CUDA graph, bf16 pooled outputs, the compiled dense part) and replays the whole step's graph."""
    if DEVICE != "cuda":
        pytest.skip("the fast step mode is the GPUs' (EMBSHARD_TEST_DEVICE=cuda, 2 GPUs)")
    from embshard.config import load_config

    config = "configs/dlrm_dcnv2_mlperf.yaml"
    rows = [f"model.tables[{i}].num_embeddings={max(1000, t.num_embeddings // 400)}"
            for i, t in enumerate(load_config(config).model.tables)]  # fmt: skip
    small = ["schedule.steps=50", "schedule.batch_size=2048", "logging.log_every=10", "logging.tensorboard_dir=null",
             "data.synthetic.eval_batches=1", "data.synthetic.workers=2"]  # fmt: skip
    res = train([config, "training.precision=bf16", *rows, *small, "--nproc", "2"], timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    # the planner priced the graph's plan against the eager step's and took the graph (2 GPUs: no hot table)
    fast = "step: whole-step CUDA graph, bf16 pooled outputs, compiled dense (auto; the planner's choice: predicted "
    assert fast in out and "set training.cuda_graph=false for the eager step" in out, out[-3000:]
    replays = re.search(r"CUDA graphs: (\d+) steps replayed the dense step's graph, (\d+) the whole step's", out)
    assert replays and int(replays.group(2)) >= 40, out[-3000:]  # the first steps warm up and capture
    assert "given up" not in out and "auc" in out


def refused(argv: list[str], capsys) -> str:
    """`embshard ARGV` in this process, for refusals before any work (no process starts): it must exit with status
    2; returns what it printed to stderr."""
    from embshard.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_errors_exit_with_one_line(capsys, monkeypatch):
    """Config and data errors are refused before any process starts (checked in this process); an error of the
    ranks (no plan fits, found by rank 0 after the processes started): every rank stops with status 2 and the
    message is printed once, on one line (in processes forked for it: the command line's own exit with its ranks'
    status is tests/test_cli_input.py's error during training)."""
    monkeypatch.chdir(ROOT)
    err = refused(["train", "configs/dlrm_criteo.yaml", "--nproc", "2", "model.tables[3].embedding_dim=0"], capsys)
    assert "error: configs/dlrm_criteo.yaml (with command-line override" in err
    assert "model.tables[3].embedding_dim=0 is invalid" in err and len(err.strip().splitlines()) == 1, err
    args = ["configs/dlrm_criteo.yaml", "data.criteo.path=no/such.txt", "logging.tensorboard_dir=null"]
    err = refused(["train", *args, "checkpoint.dir=null"], capsys)
    assert err.startswith("error: data.criteo: file 'no/such.txt' does not exist") and len(err.splitlines()) == 1
    # no plan fits: rank 0 plans, every rank stops with status 2, the message names the numbers once
    tiny = ["planner.ddr_gib=0.0005", "planner.hbm_gib=0.0005", "logging.tensorboard_dir=null", "checkpoint.dir=null"]
    code, res = embshard_train_exit(["configs/dlrm_criteo.yaml", *tiny], env(), nproc=2)
    assert code == 2, res.stderr[-3000:]
    assert res.stderr.count("error: planner: no sharding plan fits 2 x ") == 1 and "Traceback" not in res.stderr
    assert "needed at least" in res.stderr and "planner.ddr_gib" in res.stderr


def test_plan_cli_then_train_with_the_saved_plan(tmp_path):
    """`embshard plan TRAINING_CONFIG --out FILE` plans the config's tables (overrides too), and training loads the
    file with planner.plan_file: row-wise, column-wise and data-parallel tables train on 2 processes."""
    from embshard.spec.plan import ShardingPlan, ShardingType
    from embshard.tools.plan import main as plan_main

    plan_file = tmp_path / "plan.yaml"
    cons = {"t_C1": "[row_wise]", "t_C2": "[column_wise]", "t_C3": "[data_parallel]"}
    overrides = [f"planner.constraints.{t}.sharding_types={v}" for t, v in cons.items()]
    overrides.append("planner.constraints.t_C2.column_shards=[2]")  # 2 blocks of 8 columns
    args = ["configs/dlrm_criteo.yaml", "--world-size", "2", "--device", "cpu", "--out", str(plan_file)]
    plan_main([*args, "--format", "yaml", *overrides])  # for the CPU processes below (on GPU hosts too)
    plan = ShardingPlan.load(plan_file)
    assert (plan.world_size, plan.local_world_size) == (2, 2)
    assert plan["t_C1"].sharding_type is ShardingType.ROW_WISE and plan["t_C3"].ranks == [0, 1]
    assert plan["t_C2"].sharding_type is ShardingType.COLUMN_WISE
    res = train_job(
        [
            "configs/dlrm_criteo.yaml",
            f"planner.plan_file={plan_file}",
            "schedule.epochs=1",
            f"logging.metrics_file={tmp_path}/metrics.jsonl",
            "logging.tensorboard_dir=null",
            "checkpoint.dir=null",
            "logging.progress_bar=false",
        ],
        2,
    )
    assert f"plan loaded from {plan_file}" in res.stdout and "predicted step time" not in res.stdout
    assert "t_C1   row_wise" in res.stdout and "t_C3   data_parallel" in res.stdout
    start, end = metrics(tmp_path)
    assert (start["step"], end["step"]) == (0, 5) and end["samples"] == start["samples"] > 0


def test_torchx_component_runs_on_cpu(tmp_path):
    """The torchx component (launch/components.py) on 2 nodes of 1 process each (local_cwd: two torchrun launchers
    on this machine, a c10d rendezvous) trains a tiny DLRM in 2 sharding groups of 1 rank, exact mode: the job
    succeeds and the run's end reports the two groups' tables (weights and optimizer state) identical (2D across two
    launchers; tests/twod/test_twod_launch.py launches it by hand on 4 GPUs)."""
    pytest.importorskip("torchx", reason="torchx is not installed (make install pins torchx==0.7.0)")
    torchx = shutil.which("torchx", path=str(BIN)) or shutil.which("torchx")
    if torchx is None:
        pytest.skip("the torchx command is not on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [torchx, "run", "-s", "local_cwd", "launch/components.py:train", "--nnodes", "2", "--nproc_per_node", "1"]
    cmd += ["--rdzv_port", str(port), "--", "configs/dlrm_synthetic.yaml", "schedule.steps=4", "schedule.batch_size=16",
            "schedule.eval_every=0", "data.synthetic.eval_batches=1", f"logging.metrics_file={tmp_path}/metrics.jsonl",
            "logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress_bar=false", "planner.strategy=simple",
            "sharding.group_size=1", "sharding.replica_sync=exact"]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=dict(env(), CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0 and "SUCCEEDED" in log, log[-4000:]
    assert "2 ranks on cpu" in log and "sharding_group_size=1 (2 replicas" in log, log[-3000:]
    assert "2D: 2 sharding groups of 1 ranks, replica_sync exact; replicas identical" in log, log[-3000:]
    start, end = metrics(tmp_path)  # the config evaluates before and after training
    assert (start["step"], end["step"]) == (0, 4) and end["samples"] == start["samples"] > 0


def test_two_hosts_on_one_machine_with_two_torchrun_launchers(tmp_path):
    """docs/launch.md's recipe: launch/torchrun.sh started twice (node ranks 0 and 1, a c10d rendezvous on this
    machine), 2 processes each: 4 ranks as 2 hosts x 2. The planner's topology says 2 hosts x 2 and, with every table
    table-row-wise and the hierarchical exchange asked for, the plan and the report say so; DLRM trains on the Criteo
    sample and both launchers exit 0. On a machine with 4 GPUs (EMBSHARD_TEST_DEVICE=cuda) each launcher gets 2 of them."""
    gpus = DEVICE == "cuda" and torch.cuda.device_count() >= 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["configs/dlrm_criteo.yaml", "schedule.epochs=1", f"logging.metrics_file={tmp_path}/metrics.jsonl"]
    args += [
        "planner.settings.sharding_types=[table_row_wise]",
        "planner.settings.table_row_wise_exchange=hierarchical",
    ]
    args += ["logging.tensorboard_dir=null", f"checkpoint.dir={tmp_path}/ck", "logging.progress_bar=false"]
    launchers = []
    for node in (0, 1):
        e = dict(env(), NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{port}")
        e.update(RDZV_ID=f"two_hosts_{port}", PYTHON=sys.executable)
        e["CUDA_VISIBLE_DEVICES"] = ("0,1" if node == 0 else "2,3") if gpus else ""
        cmd = [str(ROOT / "launch" / "torchrun.sh"), *args]
        launchers.append(
            subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    logs = [a.communicate(timeout=240)[0] for a in launchers]
    for node, (a, log) in enumerate(zip(launchers, logs)):
        assert a.returncode == 0, f"launcher {node}:\n{log[-4000:]}"
    out = logs[0]  # rank 0 runs under the launcher of node rank 0
    assert (
        "4 ranks on" in out
        and "ShardingPlan: world_size=4 local_world_size=2 table_row_wise_exchange=hierarchical" in out
    )
    assert "(2 host(s) x 2)" in out and "table-row-wise exchange: hierarchical; predicted step: hierarchical" in out
    assert "output intra-host reduce" in out
    start, end = metrics(tmp_path)  # evaluated before and after the epoch (160 training rows, 4 x 16 a step)
    assert (start["step"], end["step"]) == (0, 2) and end["samples"] == start["samples"] > 0
