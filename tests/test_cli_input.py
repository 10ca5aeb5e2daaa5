"""A newcomer's first commands: input is checked before any work, and nothing is overwritten silently.

- `embshard train` and `embshard plan` refuse every invalid count (--nproc, --world-size, --local-world-size,
  batch sizes, steps, epochs) with one line naming the flag or key, the value and the fix, before any process
  starts or any plan is made (checked in this process: nothing is spawned).
- A run never replaces an earlier run's checkpoints: it stops, offering resume_from=latest, overwrite=true or
  another dir; overwrite deletes them as the run starts; a torchrun restart is the same run.
- Data sources are opened and checked in the launching process (a missing file, a missing column).
- A config sized for GPUs prints a one-line notice on CPUs.
- A run resumed on another world size keeps its schedule in samples (the end-to-end run: tests/test_train.py).
- `embshard plan` writes its outputs into runs/plan/ by default.
- An error during training starts on its own line, not glued to the progress bar (one command-line run).
"""

from __future__ import annotations

import subprocess
import sys

import paths
import pytest
import torch

from embshard.config import load_config
from embshard.config.run import CheckpointConfig, ScheduleConfig
from embshard.data import check_source
from embshard.spec.tables import ConfigError
from embshard.training import launch_checks
from embshard.training.schedule import past_schedule, run_schedule

ROOT = paths.ROOT
CRITEO = str(ROOT / "configs" / "dlrm_criteo.yaml")
HETERO = str(ROOT / "configs" / "planner" / "hetero124.yaml")


def exits_with(main, argv: list[str], capsys) -> str:
    """`main(argv)` must exit with status 2 and print one error line; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


def test_train_refuses_bad_counts_before_any_process_starts(capsys, monkeypatch, tmp_path):
    from embshard.training.train import main

    monkeypatch.chdir(ROOT)
    quiet = ["logging.tensorboard_dir=null", f"checkpoint.dir={tmp_path}/ck"]
    for n in ("0", "-1"):
        line = exits_with(main, [CRITEO, "--nproc", n, *quiet], capsys)
        assert f"--nproc {n} is invalid" in line and ">= 1" in line and "e.g. --nproc 2" in line
    cases = {
        "schedule.batch_size=0": "schedule.batch_size=0 is invalid: it must be a positive number of samples",
        "schedule.epochs=0": "schedule.epochs=0 is invalid: it must be >= 1",
        "schedule.epochs=-2": "schedule.epochs=-2 is invalid: it must be >= 1",
    }
    for override, want in cases.items():
        assert want in exits_with(main, [CRITEO, "--nproc", "2", override, *quiet], capsys)
    line = exits_with(main, [CRITEO, "--nproc", "2", "schedule.epochs=null", "schedule.steps=0", *quiet], capsys)
    assert "schedule.steps=0 is invalid: it must be >= 1" in line
    # a data file that does not exist: refused here, before the 2 processes start
    line = exits_with(main, [CRITEO, "--nproc", "2", "data.criteo.path=no/such.txt", *quiet], capsys)
    assert line.startswith("error: data.criteo: file 'no/such.txt' does not exist")
    from embshard.runtime.distributed import spawn_local

    with pytest.raises(ConfigError, match=r"nproc=0 is invalid"):
        spawn_local(print, 0)
    # the ranks start as forks of a fork server on machines without CUDA; it imports the modules a rank imports
    # (an import that fails there is skipped: each must exist, found without importing it)
    from embshard.runtime.distributed import start_method
    from embshard.training.launch_checks import RANK_MODULES

    assert start_method() == ("spawn" if torch.cuda.is_available() else "forkserver")
    assert not [m for m in RANK_MODULES if not module_exists(m)], RANK_MODULES


def module_exists(name: str) -> bool:
    """Whether module `name` (dotted) is on the import path, without importing it or its packages."""
    import importlib.machinery

    path = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


def test_plan_refuses_bad_counts_and_writes_into_runs(capsys, monkeypatch, tmp_path):
    from embshard.tools.plan import main

    monkeypatch.chdir(tmp_path)
    base = [HETERO, "--device", "h100"]
    cases = {
        ("--world-size", "0"): "--world-size 0 is invalid: the number of ranks",
        ("--world-size", "-3"): "--world-size -3 is invalid",
        ("--world-size", "4", "--local-world-size", "0"): "--local-world-size 0 is invalid with --world-size 4",
        ("--world-size", "4", "--local-world-size", "3"): "e.g. --local-world-size 4",
        ("--world-size", "4", "--local-world-size", "8"): "--local-world-size 8 is invalid",
        ("--world-size", "2", "--batch-size", "0"): "--batch-size 0 is invalid: the samples per rank per step",
        ("--world-size", "2", "--hbm-gib", "0"): "--hbm-gib 0.0 is invalid",
        ("--world-size", "2", "--plot", "plan.jpg"): "--plot 'plan.jpg' is invalid: give a file ending in .png",
    }
    for flags, want in cases.items():
        line = exits_with(main, [*base, *flags], capsys)
        assert line.startswith("embshard plan: ") and want in line, line
    main([*base, "--world-size", "2", "--out", "--report"])
    err = capsys.readouterr().err
    assert "plan saved to runs/plan/plan.yaml" in err and "report saved to runs/plan/report.json" in err
    assert sorted(p.name for p in (tmp_path / "runs" / "plan").iterdir()) == ["plan.yaml", "report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else in the folder it ran from
    main([*base, "--world-size", "2", "--format", "torchrec", "--out", "mine/tr.json"])  # a named file: as named
    assert (tmp_path / "mine" / "tr.json").is_file()


def committed(folder, *steps: int, complete: bool = True) -> None:
    for s in steps:
        (folder / f"step_{s}").mkdir(parents=True)
        if complete:
            (folder / f"step_{s}" / "COMMIT").write_text("{}")


def test_a_run_never_replaces_an_earlier_runs_checkpoints(capsys, monkeypatch, tmp_path):
    from embshard.training.train import main

    ck = tmp_path / "ck"
    committed(ck, 10, 20)
    committed(ck, 30, complete=False)  # a save that was killed: not a checkpoint
    (tmp_path / "ck_2").mkdir()  # taken: the message offers the next free name
    monkeypatch.chdir(ROOT)
    line = exits_with(main, [CRITEO, "--nproc", "2", f"checkpoint.dir={ck}", "logging.tensorboard_dir=null"], capsys)
    assert f"checkpoint.dir '{ck}' already holds the checkpoints of an earlier run (steps 10, 20)" in line
    assert "checkpoint.resume_from=latest to go on from step 20" in line
    assert "checkpoint.overwrite=true to start again (deleting them)" in line and f"checkpoint.dir={ck}_3" in line
    assert sorted(p.name for p in ck.iterdir()) == ["step_10", "step_20", "step_30"]  # untouched
    assert launch_checks.checkpoint_conflict(CheckpointConfig(dir=str(ck), resume_from="latest")) is None
    assert launch_checks.checkpoint_conflict(CheckpointConfig(dir=str(tmp_path / "new"))) is None
    only_killed = tmp_path / "killed"
    committed(only_killed, 5, complete=False)
    assert launch_checks.checkpoint_conflict(CheckpointConfig(dir=str(only_killed))) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart: its first attempt's, the same run
    assert launch_checks.checkpoint_conflict(CheckpointConfig(dir=str(ck))) is None
    said: list[str] = []
    launch_checks.clear_checkpoints(CheckpointConfig(dir=str(ck), overwrite=True), said.append)
    assert len(list(ck.iterdir())) == 3 and not said  # a restart keeps them
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch_checks.clear_checkpoints(CheckpointConfig(dir=str(ck), overwrite=True), said.append)
    assert list(ck.iterdir()) == [] and said == [f"checkpoint.overwrite: deleted the 3 earlier checkpoint(s) in {ck}"]


def test_checkpoint_overwrite_is_checked():
    """checkpoint.overwrite starts afresh: it cannot go with resume_from (which goes on), and needs a dir."""
    with pytest.raises(ConfigError) as e:
        load_config(CRITEO, ["checkpoint.overwrite=true", "checkpoint.resume_from=latest"])
    msg = str(e.value)
    assert "checkpoint.overwrite=True is invalid" in msg and "resume_from='latest'" in msg and "one of them" in msg
    with pytest.raises(ConfigError, match="checkpoint.overwrite=True is invalid: it replaces the checkpoints in"):
        load_config(CRITEO, ["checkpoint.dir=null", "checkpoint.overwrite=true"])
    assert load_config(CRITEO, ["checkpoint.overwrite=true"]).checkpoint.overwrite
    assert not load_config(CRITEO).checkpoint.overwrite


def test_data_sources_are_opened_before_the_ranks_start(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # the config's relative data path
    cfg = load_config(CRITEO)
    tables = list(cfg.model.tables)
    sample = (paths.DATA / "criteo_sample.txt").read_text().splitlines()
    header = sample[0].split(",")
    keep = [i for i, c in enumerate(header) if c != "C7"]
    short = tmp_path / "short.csv"  # no column C7, which table t_C7 reads
    short.write_text("\n".join(",".join(r.split(",")[i] for i in keep) for r in sample[:5]) + "\n")
    bad = load_config(CRITEO, [f"data.criteo.path={short}"])
    with pytest.raises(ConfigError, match=rf"data.criteo: {short} has no column\(s\) \['C7'\]"):
        check_source(bad.data, tables, 16, 0)
    missing = load_config(CRITEO, ["data.criteo.eval_path=no/eval.csv"])
    with pytest.raises(ConfigError, match="data.criteo.eval_files: file 'no/eval.csv' does not exist"):
        check_source(missing.data, tables, 16, 0)
    check_source(load_config(CRITEO, [f"data.criteo.path={paths.DATA / 'criteo_sample.txt'}"]).data, tables, 16, 0)


def test_a_gpu_sized_config_says_so_on_cpus(capsys, monkeypatch, tmp_path):
    from embshard.training.train import preflight

    path = str(ROOT / "configs" / "two_tower_synthetic_1m.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight(path, [f"checkpoint.dir={tmp_path}/ck"], 2)  # the synthetic source checked too
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"note: {path} is sized for GPUs: 1,020,000 table rows (249 MiB;") and "8,192" in line
    assert "model.tables[1].num_embeddings=20000 schedule.batch_size=64" in line
    # the overrides it suggests make a config that loads and gets no notice
    small = load_config(path, ["model.tables[1].num_embeddings=20000", "schedule.batch_size=64"])
    assert (
        launch_checks.cpu_notice(small, path) is None and launch_checks.cpu_notice(load_config(CRITEO), CRITEO) is None
    )


def test_a_resumed_schedule_is_kept_in_samples():
    """README's `--nproc 3 checkpoint.resume_from=latest schedule.epochs=8` after the 2-rank demo (20 steps of 32
    samples; on 3 ranks an epoch is 3 steps of 48), then the same on 2 ranks again (5 steps of 32 an epoch)."""
    eight = ScheduleConfig(batch_size=16, epochs=8)
    s = run_schedule(eight, 3, 3, start=20, position=20, saved_samples_per_step=32)
    assert (s.start, s.total, s.samples_done, s.samples_per_step, s.position) == (13, 24, 640, 48, 13)
    assert s.samples_total == 640 + 11 * 48  # the progress bar: from the 640 samples trained
    assert "the checkpoint's 20 steps of 32 samples (640 samples) are step 13 of this run's steps of 48" in s.note
    assert "schedule.epochs=8 ends at step 24 (1,152 samples); the data go on after 624 samples" in s.note
    back = run_schedule(eight, 5, 2, start=24, position=24, saved_samples_per_step=48)
    assert (back.start, back.total, back.samples_done, back.position) == (36, 40, 1152, 36)
    same = run_schedule(eight, 5, 2, start=20, position={"v": 1}, saved_samples_per_step=32)  # unchanged
    assert (same.start, same.total, same.position, same.note, same.samples_total) == (20, 40, {"v": 1}, None, 1280)
    fresh = run_schedule(ScheduleConfig(batch_size=16, steps=7), None, 2)
    assert (fresh.start, fresh.total, fresh.position, fresh.samples_total) == (0, 7, 0, 224)
    short = ScheduleConfig(batch_size=16, steps=5)
    past = run_schedule(short, None, 1, start=10, position=10, saved_samples_per_step=32)
    assert (past.start, past.total) == (20, 5)

    class Resumed:
        path, step = "ck/step_10", 10

    msg = past_schedule(past, short, None, 1, Resumed())
    assert msg.startswith("checkpoint.resume_from: checkpoint 'ck/step_10' was saved after step 10 (step 20 of")
    assert "ends at step 5 (schedule.steps=5): it would train no step" in msg


def test_an_error_during_training_starts_on_its_own_line(tmp_path):
    """A bad row in rank 0's part of the data: the run stops with status 2 during its first steps, while the
    progress bar shows; the error line (stdout and stderr merged, as in a terminal) starts a line of its own."""
    rows = (paths.DATA / "criteo_sample.txt").read_text().splitlines()
    rows[71] = "x" + rows[71][1:]  # label 'x' (rank 0 trains rows 1..80)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(rows) + "\n")
    cmd = [sys.executable, "-m", "embshard.cli", "train", CRITEO, "--nproc", "2", f"data.criteo.path={bad}"]
    cmd += ["logging.tensorboard_dir=null", "checkpoint.dir=null", "schedule.eval_at_start=false"]
    res = subprocess.run(
        cmd, cwd=ROOT, env=paths.cpu_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = res.stdout
    assert res.returncode == 2, out[-3000:]
    assert "samples/s" in out  # the bar was shown
    errors = [x for x in out.splitlines() if "column 'label'='x'" in x]
    assert errors and all(x.startswith("error: ") for x in errors), out[-3000:]
