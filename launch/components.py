"""torchx component for `embshard train`: the same job as launch/torchrun.sh, on any torchx scheduler.

    torchx run -s local_cwd launch/components.py:train --nproc_per_node 2 -- configs/dlrm_criteo.yaml
    torchx run -s slurm launch/components.py:train --nnodes 4 --nproc_per_node 8 --gpu 8 -- configs/x.yaml
    torchx run -s kubernetes -cfg queue=default launch/components.py:train --image REGISTRY/embshard:TAG ...

Arguments after `--` are the config file and its `key.sub=value` overrides. The job runs
`torchrun ... -m embshard.cli train CONFIG [overrides]` on every node (torchx.components.dist.ddp), so the
`torchrun` found on the node's PATH must belong to the Python environment that has embshard installed.
See docs/launch.md.
"""

# torchx reads this file's annotations with its own linter: keep typing.Optional/Dict and no __future__ import.
from typing import Dict, Optional  # noqa: UP035

import torchx.specs as specs
from torchx.components.dist import ddp


def train(
    *args: str,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    gpu: int = 0,
    cpu: int = 2,
    memMB: int = 8192,
    image: str = "embshard:latest",
    name: str = "embshard-train",
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    rdzv_port: int = 29500,
    max_retries: int = 0,
) -> specs.AppDef:
    """Train a YAML-configured embshard model with torchrun on every node.

    Args:
        args: the config file, then key.sub=value overrides
        nnodes: number of hosts
        nproc_per_node: processes per host (one per GPU; 2 for a CPU test)
        gpu: GPUs per host
        cpu: CPU cores per host
        memMB: host memory per host, in MiB
        image: container image for container schedulers (local_cwd runs in the current directory instead)
        name: job name
        env: extra environment variables, e.g. NCCL_DEBUG=INFO
        rdzv_port: port of the c10d rendezvous store on the first host (multi-host jobs)
        max_retries: times the scheduler may restart the job after a failure (with checkpoint.resume_from=latest
            it goes on from its newest complete checkpoint)
    """
    if not args:
        raise ValueError("give the config file after `--`, e.g. -- configs/dlrm_criteo.yaml schedule.steps=100")
    app = ddp(
        "train",
        *args,
        m="embshard.cli",
        name=name,
        image=image,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc_per_node}",
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})},  # as launch/torchrun.sh (restarts)
        rdzv_port=rdzv_port,
        max_retries=max_retries,
    )
    app.roles[0].name = "train"  # not "cli" (the module): the Slurm job and Kubernetes task names, VC_TRAIN_0_HOSTS
    return app
