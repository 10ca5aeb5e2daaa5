"""`make demo`: train a small DLRM (configs/demo.yaml) on synthetic click data on N local CPU processes.

Kept deliberately small and replaceable; the full YAML and training stack lives in `embshard train`.
The synthetic labels come from a hidden logistic model of the dense features and per-row scores of the ids,
so a model that learns shows a falling loss.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml

from embshard.distributed import init_distributed, spawn_local
from embshard.optim import FusedOptimizerConfig
from embshard.tables import ConfigError, TableConfig


@dataclass(frozen=True)
class DemoConfig:
    """configs/demo.yaml."""

    tables: dict
    """count, rows, dim, ids_per_bag of the embedding tables."""
    num_dense: int
    """Number of continuous features."""
    bottom_mlp: list
    """Hidden sizes of the bottom MLP."""
    top_mlp: list
    """Hidden sizes of the top MLP."""
    batch_size: int
    """Samples per rank per step."""
    steps: int
    """Training steps."""
    log_every: int
    """Steps between loss reports."""
    sparse_optimizer: dict
    """FusedOptimizerConfig fields."""
    dense_lr: float
    """Adam learning rate of the dense part."""
    seed: int = 0
    """Seed of data and weights."""

    @classmethod
    def load(cls, path: str) -> DemoConfig:
        data = yaml.safe_load(open(path))
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known keys are {sorted(known)}")
        return cls(**data)


def synthetic_batch(cfg: DemoConfig, tables: list[TableConfig], step: int, rank: int, device: torch.device):
    """(dense [B, N], KeyedJaggedTensor, labels [B]) drawn from a fixed hidden model."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    hidden = torch.Generator().manual_seed(cfg.seed + 999)
    w_dense = torch.randn(cfg.num_dense, generator=hidden)
    scores = [torch.randn(t.num_embeddings, generator=hidden) for t in tables]
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    B = cfg.batch_size
    dense = torch.randn(B, cfg.num_dense, generator=gen)
    logit = dense @ w_dense / math.sqrt(cfg.num_dense)
    lengths, values = [], []
    for t, s in zip(tables, scores):
        le = torch.randint(1, int(2 * t.ids_per_bag) + 1, (B,), generator=gen)
        ids = torch.randint(0, t.num_embeddings, (int(le.sum()),), generator=gen)
        bag_mean = torch.zeros(B).index_add_(0, torch.repeat_interleave(torch.arange(B), le), s[ids]) / le
        logit = logit + bag_mean
        lengths.append(le)
        values.append(ids)
    labels = torch.bernoulli(torch.sigmoid(2 * logit), generator=gen)
    kjt = KeyedJaggedTensor(
        keys=[f for t in tables for f in t.feature_names],
        values=torch.cat(values).to(device),
        lengths=torch.cat(lengths).to(torch.int32).to(device),
    )
    return dense.to(device), kjt, labels.to(device)


def train(config_path: str) -> None:
    """One rank's training loop."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from embshard.models.dlrm import DLRMDense
    from embshard.plan import MemoryTier, simple_plan
    from embshard.sharded import ShardedEmbeddingBagCollection

    cfg = DemoConfig.load(config_path)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tc = cfg.tables
    tables = [
        TableConfig(f"t{i}", tc["rows"], tc["dim"], (f"f{i}",), ids_per_bag=tc["ids_per_bag"]) for i in range(tc["count"])
    ]
    plan = simple_plan(tables, world, tier=MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM)
    if rank == 0:
        print(plan, flush=True)
    ebc = ShardedEmbeddingBagCollection(
        tables, plan, FusedOptimizerConfig(**cfg.sparse_optimizer), device=device, seed=cfg.seed
    )
    torch.manual_seed(cfg.seed)
    dense = DLRMDense(cfg.num_dense, len(tables), tc["dim"], cfg.bottom_mlp, cfg.top_mlp).to(device)
    dense = DDP(dense) if world > 1 else dense
    opt = torch.optim.Adam(dense.parameters(), lr=cfg.dense_lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    t0, window = time.time(), []
    for step in range(cfg.steps):
        x, kjt, y = synthetic_batch(cfg, tables, step, rank, device)
        sparse = ebc(kjt).values().view(cfg.batch_size, len(tables), tc["dim"])
        loss = loss_fn(dense(x, sparse), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        window.append(loss.detach())
        if (step + 1) % cfg.log_every == 0:
            avg = torch.stack(window).mean()
            dist.all_reduce(avg)
            window = []
            if rank == 0:
                rate = (step + 1) * cfg.batch_size * world / (time.time() - t0)
                print(f"step {step + 1:5d}  loss {avg.item() / world:.4f}  {rate:,.0f} samples/s", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/demo.yaml")
    ap.add_argument("--nproc", type=int, default=2, help="local processes to start (ignored under torchrun)")
    args = ap.parse_args(argv)
    import os

    if "RANK" in os.environ:
        train(args.config)
    else:
        spawn_local(train, args.nproc, args.config)


if __name__ == "__main__":
    main()
