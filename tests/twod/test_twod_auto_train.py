"""`embshard train` with sharding.group_size auto at world 4 on CPU processes, 2 per "host" (LOCAL_WORLD_SIZE=2) and
the CPU preset's topology: the job prints the group-size table and its choice, plans with it and trains (on CUDA
runs, where `--nproc 4` puts the 4 ranks on one host, the choice is no 2D)."""

from __future__ import annotations

import re

from train_job import IN_TEST_RANKS, embshard_train

from embshard.planner.topology import Topology

ARGS = [
    "configs/dlrm_synthetic.yaml",
    "schedule.steps=4",
    "schedule.batch_size=16",
    "schedule.eval_every=0",
    "schedule.eval_at_start=false",
    "data.synthetic.eval_batches=1",
    "checkpoint.dir=null",
    "logging.tensorboard_dir=null",
    "logging.progress_bar=false",
    "sharding.group_size=auto",
    "sharding.replica_sync=exact",
]


def test_auto_group_size_trains_at_world_4(tmp_path, monkeypatch):
    topo = tmp_path / "cpu.yaml"
    Topology.preset("cpu", 4, 2).save(topo)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the processes forked for the run take this process's environment
    out = embshard_train([*ARGS, f"planner.topology_file={topo}"], 4).stdout
    assert "group sizes on 4 ranks" in out and "<- chosen" in out, out[-3000:]
    chosen = re.search(r"sharding\.group_size auto: ([^\s,]+)", out)  # "2," or "none (no 2D),"
    assert chosen, out[-3000:]
    name = chosen.group(1)
    assert f"chosen sharding_group_size: {name}" in out
    if IN_TEST_RANKS:  # 2 ranks per host: groups of 2, one per host, predicted faster than the flat plan
        assert name == "2", out[-3000:]
    if name == "2":
        assert "sharding_group_size=2 (2 replicas" in out, out[-3000:]
        assert "2D: 2 sharding groups of 2 ranks, replica_sync exact; replicas identical" in out, out[-3000:]
    assert "train step      4" in out, out[-3000:]
