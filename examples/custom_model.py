"""Bring your own dense model: train it on embshard's sharded embeddings from your own code, no file of embshard edited.

    python examples/custom_model.py                      # 2 CPU processes, the Criteo sample, 10 steps
    python examples/custom_model.py --nproc 1 --steps 3
    torchrun --nproc-per-node 2 examples/custom_model.py  # one process per GPU (or CPU process) under torchrun

A model kind is three functions of yours (embshard.models.ModelKind): the feature groups the sharded embeddings
hand over, the dense part (any nn.Module; embshard wraps it in DistributedDataParallel) and the step that turns a
batch into a loss. Registered under a name, it is built by RecModel and trained by TrainPipeline like the built-in
kinds (DLRM, DLRM-DCNv2, two-tower): planner, fused sparse optimizer, pipelined exchanges, checkpoints.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
from torch import nn

from embshard.config import load_config
from embshard.config.model import ModelConfig
from embshard.data import build_source
from embshard.models import ModelKind, RecModel, StepOutput, bce_output, register_model
from embshard.planner.policy import plan_for_job
from embshard.runtime.distributed import init_distributed, spawn_local
from embshard.training.pipeline import TrainPipeline
from embshard.training.train import evaluate, format_eval


class WideMLP(nn.Module):
    """Dense features and every pooled embedding, concatenated, through an MLP to one logit per sample."""

    def __init__(self, num_dense: int, sparse_width: int, hidden: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(num_dense + sparse_width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([dense_BN, sparse_BS], dim=1)).squeeze(1)


def wide_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """One group of every feature: `model.ebc(kjt)["all"]` is `[B, sum of the tables' widths]`."""
    return {"all": cfg.features}


def wide_dense(cfg: ModelConfig, num_dense: int) -> nn.Module:
    widths = {f: t.embedding_dim for t in cfg.tables for f in t.feature_names}
    return WideMLP(num_dense, sum(widths[f] for f in cfg.features))


def wide_step(model: RecModel, batch) -> StepOutput:
    """The loss of one batch: the sharded lookup (its exchanges included), the dense part, binary cross-entropy."""
    pooled = model.ebc(batch.sparse)  # {"all": [B, 416]}: this rank's samples, every feature
    return bce_output(model.dense(batch.dense, pooled["all"]), batch.labels)


# At module level: processes started with `spawn` import this file again and register the kind there too.
register_model("wide_mlp", ModelKind(build_dense=wide_dense, step=wide_step, output_groups=wide_groups))


def train(config: str, steps: int, batch_size: int) -> None:
    """One rank: plan, build, train `steps` steps through the pipeline, evaluate on the held-out rows."""
    device = init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    say = print if rank == 0 else (lambda _text: None)
    cfg = load_config(config)  # its tables, data, sparse optimizer and planner settings; the model is ours
    model_cfg = ModelConfig(kind="wide_mlp", tables=cfg.model.tables)
    plan = plan_for_job(
        model_cfg.tables, cfg.planner, world, local_world, device.type, batch_size, cfg.sparse_optimizer, say
    )  # deterministic: every rank makes the same plan
    source = build_source(cfg.data, model_cfg.tables, batch_size, seed=0, rank=rank, world_size=world)
    model = RecModel(model_cfg, source.num_dense, plan, cfg.sparse_optimizer, device, world)
    dense_optimizer = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
    pipeline = TrainPipeline(model, dense_optimizer, mode="sparse_dist")
    batches = itertools.islice(source.train_batches(0), steps)  # the file source is endless: take `steps`
    while (done := pipeline.progress(batches)) is not None:
        say(f"train step {done.step:4d}  loss {float(done.output.loss.detach()):.4f}  (rank 0)")
    pipeline.close()
    say(format_eval(steps, evaluate(model, source, device, pipeline.host_group)))
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/dlrm_criteo.yaml", help="tables, data and optimizers from here")
    ap.add_argument("--nproc", type=int, default=2, help="local processes to start (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    args = ap.parse_args()
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        train(args.config, args.steps, args.batch_size)
    else:
        spawn_local(train, args.nproc, args.config, args.steps, args.batch_size)


if __name__ == "__main__":
    main()
