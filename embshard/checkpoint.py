"""Checkpoints of a training run: the dense model, the dense optimizer and the full embedding tables.

A checkpoint is one file, written by rank 0 (torch.save of a dict):
  {"step", "dense", "dense_optimizer", "embeddings": {table: [rows, dim] fp32}, "model_kind"}
The embedding tables are gathered from their shards (ShardedEmbeddingBagCollection.full_weights, a collective),
so a checkpoint loads under any world size or plan: every rank copies its shards' blocks out of the full tables.
The fused sparse optimizer's state (Adagrad/Adam moments) is not saved: it restarts from zero on resume.
Every rank reads the file, so on several hosts the folder must be on storage they share.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from embshard.models.build import RecModel
from embshard.tables import ConfigError

_NAME = re.compile(r"step_(\d+)\.pt$")


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step}.pt")


def latest_checkpoint(folder: str) -> str | None:
    """The step_<N>.pt with the largest N in `folder` (None if there is none)."""
    if not os.path.isdir(folder):
        return None
    found = [(int(m.group(1)), p) for p in os.listdir(folder) if (m := _NAME.search(p))]
    return os.path.join(folder, max(found)[1]) if found else None


def save_checkpoint(path: str, model: RecModel, dense_optimizer: torch.optim.Optimizer, step: int) -> None:
    """Collective: every rank calls it; rank 0 writes `path` (atomically, via a temporary file)."""
    embeddings = {name: w for c in model.collections() for name, w in c.full_weights().items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state = {
            "step": step,
            "model_kind": model.cfg.kind,
            "dense": model.dense_module().state_dict(),
            "dense_optimizer": dense_optimizer.state_dict(),
            "embeddings": embeddings,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path: str, model: RecModel, dense_optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint written by save_checkpoint into this rank's model; returns its step."""
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint {path!r} does not exist: check checkpoint.resume_from")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("model_kind") != model.cfg.kind:
        raise ConfigError(f"checkpoint {path!r} is of a {state.get('model_kind')!r} model, not {model.cfg.kind!r}")
    model.dense_module().load_state_dict(state["dense"])
    dense_optimizer.load_state_dict(state["dense_optimizer"])
    tables = {t.name: t for t in model.cfg.tables}
    saved = state["embeddings"]
    for name, t in tables.items():
        if name not in saved:
            raise ConfigError(f"checkpoint {path!r} has no table {name!r} (it has {sorted(saved)})")
        if tuple(saved[name].shape) != (t.num_embeddings, t.embedding_dim):
            raise ConfigError(
                f"checkpoint {path!r}: table {name!r} is {tuple(saved[name].shape)} there but "
                f"{(t.num_embeddings, t.embedding_dim)} in the config"
            )
    with torch.no_grad():
        for name, s, w in (item for c in model.collections() for item in c.local_shards()):
            block = saved[name][s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols]
            w.copy_(block.to(device=w.device, dtype=w.dtype))
    return int(state["step"])
