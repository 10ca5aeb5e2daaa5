"""The torchx component (launch/components.py) under the Slurm and Kubernetes schedulers: `torchx run --dryrun`
prints the job each scheduler would get (no cluster needed); the job must start torchrun on every node with the
rendezvous, the ranks per node, the embshard command, its config and overrides, the resources and the env."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import paths
import yaml

TORCHX = Path(sys.executable).with_name("torchx")
# the torchx command beside this Python (a venv's), else its module (torchx installed without its scripts)
TORCHX_CMD = [str(TORCHX)] if TORCHX.exists() else [sys.executable, "-m", "torchx.cli.main"]
CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
REQUEST = "=== SCHEDULER REQUEST ==="


def dryruns(jobs: dict[str, list[str]]) -> dict[str, str]:
    """The scheduler requests `torchx run --dryrun` prints, one run per job (side by side: each is its own torchx
    process, whose command line may be parsed once)."""
    env = {**os.environ, "PATH": f"{TORCHX.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs = {
        k: subprocess.Popen(
            [*TORCHX_CMD, "run", "--dryrun", "--workspace", "", *argv],
            cwd=paths.ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, argv in jobs.items()
    }
    out = {}
    for k, p in procs.items():
        text, _ = p.communicate(timeout=120)
        assert p.returncode == 0, text
        assert REQUEST in text, text
        out[k] = text.split(REQUEST, 1)[1]
    return out


def check_torchrun(cmd: str, nnodes: int, nproc: int, overrides: list[str]) -> None:
    words = shlex.split(cmd)
    assert words[0] == "torchrun", cmd
    opt = {a: b for a, b in zip(words, words[1:]) if a.startswith("--")}
    assert opt["--nnodes"] == str(nnodes) and opt["--nproc_per_node"] == str(nproc), cmd
    assert opt["--rdzv_backend"] == "c10d" and opt["--rdzv_endpoint"].endswith(":29500"), cmd
    assert words[words.index("-m") :] == ["-m", "embshard.cli", "train", CONFIG, *overrides], cmd


def test_slurm_and_kubernetes_jobs_for_two_hosts() -> None:
    overrides = ["schedule.steps=100", "training.precision=bf16"]
    common = ["--nnodes", "2", "--nproc_per_node", "8", "--gpu", "8", "--cpu", "64", "--memMB", "480000"]
    comp = "launch/components.py:train"
    out = dryruns(
        {
            "slurm": ["-s", "slurm", "-cfg", "partition=gpu,time=2:00:00", comp, *common, "--env", "NCCL_DEBUG=INFO",
                      "--", CONFIG, *overrides],
            "kubernetes": ["-s", "kubernetes", "-cfg", "queue=default,namespace=ml", comp, "--image", "reg/embshard:1",
                           *common, "--", CONFIG],
        }
    )  # fmt: skip

    # Slurm: one heterogeneous job of 2 components (a node each), one task per node with 8 GPUs; srun starts torchrun
    # on both with the first component's node as the rendezvous host
    sbatch = [ln for ln in out["slurm"].splitlines() if ln.startswith("#SBATCH")]
    heads = [ln for ln in sbatch if "--job-name" in ln]
    assert len(heads) == 2 and sum("hetjob" in ln for ln in sbatch) == 1, sbatch
    for i, ln in enumerate(heads):
        opts = dict(o.split("=", 1) for o in ln.split()[1:] if "=" in o)
        assert opts["--job-name"] == f"train-{i}" and opts["--ntasks-per-node"] == "1", ln
        assert opts["--gpus-per-task"] == "8" and opts["--cpus-per-task"] == "64" and opts["--mem"] == "480000", ln
        assert opts["--partition"] == "gpu" and opts["--time"] == "2:00:00", ln
    srun = out["slurm"].split("srun ", 1)[1].split("\nexitcode", 1)[0]
    parts = srun.split(" :\\\n")
    assert len(parts) == 2, srun
    for part in parts:
        assert "--export=ALL,TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in part and "NCCL_DEBUG=INFO" in part, part
        cmd = shlex.split(part.split("bash -c ", 1)[1])[0]
        assert "SLURM_JOB_NODELIST_HET_GROUP_0" in cmd, cmd
        check_torchrun(cmd.replace("${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}", "host0"), 2, 8, overrides)

    # Kubernetes: a Volcano job of 2 tasks (a pod each) of the image, 8 GPUs each, the rendezvous on task 0's pod
    job = yaml.safe_load(_first_yaml(out["kubernetes"]))
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh/")
    assert job["spec"]["queue"] == "default" and job["spec"]["schedulerName"] == "volcano"
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["train-0", "train-1"] and all(t["replicas"] == 1 for t in tasks)
    for i, t in enumerate(tasks):
        (c,) = t["template"]["spec"]["containers"]
        assert c["image"] == "reg/embshard:1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" and c["resources"]["limits"]["cpu"] == "64000m"
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert c["command"][:2] == ["bash", "-c"], c["command"]
        host = "${TORCHX_RANK0_HOST:=localhost}" if i == 0 else "${VC_TRAIN_0_HOSTS:=localhost}"
        assert host in c["command"][2], c["command"]
        check_torchrun(c["command"][2].replace(host, "host0"), 2, 8, [])


def _first_yaml(text: str) -> str:
    """The Kubernetes request: the YAML document torchx prints after the request line (up to a blank line's end)."""
    lines = text.strip("\n").splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.startswith("torchx ") or ln.startswith("===")), len(lines))
    return "\n".join(lines[:end])
