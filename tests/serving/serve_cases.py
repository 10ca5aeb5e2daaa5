"""A small DLRM of configs/dlrm_synthetic.yaml (shared table, mean pooling, weighted table; synthetic data with a
planted signal) trained a few steps on 1 or more ranks and saved as a sharded checkpoint, with the trained model's
own eval-forward scores of batches to compare a served model with."""

from __future__ import annotations

import torch
import torch.distributed as dist
from paths import ROOT

SMALL = [
    "model.tables[0].num_embeddings=300",
    "model.tables[1].num_embeddings=200",
    "model.tables[2].num_embeddings=150",
    "model.tables[3].num_embeddings=40",
    "model.tables[4].num_embeddings=100",
    "model.tables[5].num_embeddings=16",
    "model.dlrm.bottom_mlp=[16]",
    "model.dlrm.top_mlp=[16]",
    "schedule.batch_size=32",
    "planner={}",
]
TYPES = {1: {}, 2: {"t_user": "row_wise", "t_item": "table_wise", "t_history": "column_wise",
                    "t_category": "data_parallel", "t_query": "table_wise", "t_device": "row_wise"}}  # fmt: skip


def config(overrides: list[str] = ()):
    from embshard.config import load_config

    return load_config(str(ROOT / "configs/dlrm_synthetic.yaml"), SMALL + list(overrides))


def build(cfg, world: int, device: torch.device):
    """(RecModel, dense optimizer, data source) on this rank."""
    from embshard import simple_plan
    from embshard.data import build_source
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    tables = list(cfg.model.tables)
    tier = "hbm" if device.type == "cuda" else "host"
    plan = simple_plan(tables, world, world, TYPES.get(world, {}), tier=tier)
    rank = dist.get_rank() if dist.is_initialized() else 0
    source = build_source(cfg.data, tables, cfg.schedule.batch_size, cfg.seed, rank, world, workers=0)
    model = RecModel(cfg.model, source.num_dense, plan, cfg.sparse_optimizer, device, world, cfg.seed)
    return model, make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters()), source


def eval_logits(model, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model.step(b).scores.detach().cpu().clone() for b in batches]


def train_save(rank: int, world: int, device, folder: str, steps: int = 3, overrides: list[str] = ()) -> dict:
    """Train `steps` steps, save the checkpoint (with its config) into `folder`, return this rank's eval batches
    and the trained model's logits of them."""
    from embshard.checkpoint import Checkpointer, TrainState

    cfg = config(overrides)
    model, opt, source = build(cfg, world, device)
    batches = source.train_batches(0)
    for _ in range(steps):
        out = model.step(next(batches).to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
    ckpt = Checkpointer(TrainState.of_model(model, opt), folder, async_save=False, chunk_bytes=4096, config=cfg)
    ckpt.save(steps)
    ckpt.close()
    held = [b for _, b in zip(range(2), source.eval_batches())]
    return {"batches": held, "logits": eval_logits(model, [b.to(device) for b in held])}


def resave(folder: str, out: str, step: int) -> None:
    """Load the checkpoint `folder` into a 1-rank model and save it again into `out` (the same model state)."""
    from embshard.checkpoint import Checkpointer, TrainState

    cfg = config()
    model, opt, _ = build(cfg, 1, torch.device("cpu"))
    ckpt = Checkpointer(TrainState.of_model(model, opt), folder, async_save=False, config=cfg)
    assert ckpt.resume("latest")[0] == step
    ckpt = Checkpointer(TrainState.of_model(model, opt), out, async_save=False, chunk_bytes=4096, config=cfg)
    ckpt.save(step)
    ckpt.close()
