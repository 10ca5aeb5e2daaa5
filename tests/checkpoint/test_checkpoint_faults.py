"""A save killed with SIGKILL never leaves a checkpoint that loads: killed while writing its data (async, in the
writer thread) or after all data and DCP's index but before its COMMIT, `latest` still finds the previous one,
loading the killed one fails with a clear error, the previous one loads exactly, and the next save of that step
replaces the debris. (A rank killed during training under torchrun: tests/test_train.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from ckpt_cases import build, full_state, plan_for
from dist_harness import start_script
from paths import TESTS, cpu_subprocess_env

from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint, read_manifest
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError


def _start(folder: Path, where: str):
    """`python tests/ckpt_faults.py save FOLDER WHERE` (dist_harness.start_script: a fork of the test harness's
    server on machines without CUDA)."""
    args = ["save", str(folder), where]
    return start_script(
        str(TESTS / "ckpt_faults.py"), args, cpu_subprocess_env(), str(TESTS.parent), str(folder.parent)
    )


def test_a_save_killed_midway_never_loads(tmp_path):
    folders = {w: tmp_path / w for w in ("data", "commit")}
    procs = {w: _start(f, w) for w, f in folders.items()}  # both at once
    deadline = time.time() + 180
    for where, proc in procs.items():
        while not (folders[where] / "paused").exists():
            if proc.poll() is not None:
                proc.wait()
                raise AssertionError(
                    f"{where}: the process ended before it stopped: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
                )
            assert time.time() < deadline, f"{where}: the save did not reach its stopping point"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL, where
    for where, folder in folders.items():
        killed = folder / "step_2"
        assert killed.is_dir() and any(killed.iterdir()), f"{where}: the killed save wrote nothing"
        if where == "commit":
            assert (killed / ".metadata").is_file()  # every byte written: only the marker is missing
        assert latest(folder) == folder / "step_1", where
        with pytest.raises(ConfigError, match="incomplete"):
            read_manifest(killed)
        ebc = build(torch.device("cpu"), "rowwise", plan_for(1, 1, tier=MemoryTier.HOST), seed=3)
        ckpt = Checkpointer(TrainState({"ebc": ebc}), str(folder), async_save=False, keep_last=1)
        assert ckpt.resume("latest")[0] == 1
        want, got = torch.load(folder / "step1.pt"), full_state(ebc)
        for table, st in want.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got[table][k], v), f"{where}: {table} {k}"
        with pytest.raises(ConfigError, match="incomplete"):
            load_checkpoint(killed, TrainState({"ebc": ebc}))
        ckpt.save(2)  # replaces the debris; keep_last=1 removes step 1
        ckpt.close()
        assert latest(folder) == killed and not (folder / "step_1").exists()
        assert read_manifest(killed)["step"] == 2


def test_folder_protocol(tmp_path):
    """`latest` takes the highest committed step; after committing step N, `prune` keeps the K newest committed
    checkpoints up to N and removes uncommitted folders below N and every folder above N (another run's)."""
    from embshard.checkpoint import storage

    for step, committed in ((1, True), (2, False), (3, True), (4, True), (6, True), (7, False), (9, True)):
        path = storage.step_dir(tmp_path, step)
        path.mkdir()
        if committed:
            storage.commit(path, {"step": step})
    assert storage.latest(tmp_path) == tmp_path / "step_9"
    gone = storage.prune(tmp_path, keep=2, current=4)
    assert sorted(p.name for p in gone) == ["step_1", "step_2", "step_6", "step_7", "step_9"]
    assert [(s, ok) for s, _, ok in storage.checkpoints(tmp_path)] == [(3, True), (4, True)]
    assert storage.latest(tmp_path) == tmp_path / "step_4"
    (tmp_path / "old.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="old single-file format"):
        read_manifest(tmp_path / "old.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        read_manifest(tmp_path / "step_5")
