"""2D sharding across two launchers: two torchrun launchers on this machine (node ranks 0 and 1, a c10d rendezvous)
train a tiny DLRM for a few steps in 2 sharding groups, one per "host", exact mode; both exit 0, and the run's end
reports the two groups' tables (weights and optimizer state) identical. With EMBSHARD_TEST_DEVICE=cuda on 4 GPUs,
each launcher with 2 (sharding inside a group: tests/twod/test_twod_parity.py). On the CPU the torchx component's
test (tests/test_train.py) launches the same run on two nodes of one process each: the two launchers are torchx's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import paths
import pytest
import torch

ROOT = paths.ROOT
BIN = Path(sys.executable).parent
GPUS = os.environ.get("EMBSHARD_TEST_DEVICE", "cpu") == "cuda" and torch.cuda.device_count() >= 4
PER_NODE = 2 if GPUS else 1  # processes per launcher (= ranks per sharding group)
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
    "planner.strategy=simple",
    f"sharding.group_size={PER_NODE}",
    "sharding.replica_sync=exact",
]


@pytest.mark.skipif(not GPUS, reason="on the CPU: tests/test_train.py's torchx test (two launchers, 2D exact)")
def test_two_torchrun_launchers_train_2d_exact(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = []
    for node in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env["CUDA_VISIBLE_DEVICES"] = ("0,1" if node == 0 else "2,3") if GPUS else ""
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", str(PER_NODE)]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"twod_{port}"]
        cmd += ["-m", "embshard.cli", "train", *ARGS]
        launchers.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    logs = [a.communicate(timeout=300)[0] for a in launchers]
    for node, (a, log) in enumerate(zip(launchers, logs)):
        assert a.returncode == 0, f"launcher {node}:\n{log[-4000:]}"
    out = logs[0]  # rank 0 reports, under the launcher of node rank 0
    assert f"{2 * PER_NODE} ranks on" in out and f"sharding_group_size={PER_NODE} (2 replicas" in out, out[-3000:]
    assert f"2D: 2 sharding groups of {PER_NODE} ranks, replica_sync exact; replicas identical" in out, out[-3000:]
    assert "train step      4" in out
