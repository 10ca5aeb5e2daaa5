"""Workers of tests/test_checkpoint.py: collections trained and saved on 2 ranks with every sharding type and
optimizer, loaded on other world sizes and plans; a small two-collection model with a DDP dense part trained
straight and resumed. Full tables and optimizer states are assembled here independently of embshard.checkpoint
(from the plan and `local_shards` / `local_optimizer_states`)."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from dist_harness import device_kind
from parity import random_batches, to_kjt
from paths import ROOT
from torch import nn

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.checkpoint import Checkpointer, TrainState
from embshard.collection.sharded import ShardedEmbeddingBagCollection
from embshard.spec.options import LookupOptions
from embshard.spec.plan import MemoryTier, ShardingType

CUDA = device_kind() == "cuda"
TIER = MemoryTier.HBM if CUDA else MemoryTier.HOST
TABLES = [
    TableConfig("a", 70, 8, ("fa",), ids_per_bag=2),
    TableConfig("b", 130, 16, ("fb1", "fb2"), ids_per_bag=2),
    TableConfig("c", 50, 12, ("fc",), pooling="mean", ids_per_bag=3),
    TableConfig("d", 40, 8, ("fd",), weighted=True, ids_per_bag=2),
    TableConfig("e", 90, 16, ("fe",), ids_per_bag=2),
    TableConfig("f", 33, 8, ("ff",), data_type="fp32" if CUDA else "fp16", ids_per_bag=2),  # GPU Adam: no fp16
]
TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]
OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "rowwise_blocks": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),  # per-block state
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
}
EXACT = {"rowwise_blocks": False}  # LookupOptions.column_wise_exact at save time (default True)
CHUNK_BYTES = 2048  # tables are cut into several chunks
LOCAL_WORLD = {1: 1, 2: 2, 3: 3, 4: 2}


def plan_for(world: int, rotation: int, column_shards: int = 2, tier: MemoryTier = TIER):
    """Table i gets sharding type TYPES[(i + rotation) % 5], every table in `tier` (default: the test device's)."""
    types = {t.name: TYPES[(i + rotation) % len(TYPES)] for i, t in enumerate(TABLES)}
    return simple_plan(TABLES, world, LOCAL_WORLD[world], types, tier=tier, column_shards=column_shards)


def gather(items: list, group=None) -> list:
    """Every rank's items (a plain list when torch.distributed is not initialised)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(items)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, items, group=group)
    return [x for part in out for x in part]


def full_state(ebc: ShardedEmbeddingBagCollection) -> dict[str, dict]:
    """Per table: 'weight' [R, D] fp32; per state name: [R, D], or for row-wise Adagrad [R] (one state per row),
    or {(first column, width): [R]} per column block when the blocks keep their own; 'replicas' of data-parallel
    tables (every rank's copy)."""
    local = [
        (name, sh, w.detach().float().cpu().clone(), {k: v.detach().cpu().clone() for k, v in st.items()})
        for (name, sh, w), (_, _, st) in zip(ebc.local_shards(), ebc.local_optimizer_states())
    ]
    per_block = not ebc.options.column_wise_exact and ebc.optimizer.kind.value == "rowwise_adagrad"
    out: dict[str, dict] = {}
    for t in ebc.tables:
        out[t.name] = {"weight": torch.full((t.num_embeddings, t.embedding_dim), float("nan")), "replicas": []}
    for name, sh, w, st in gather(local, ebc.group):
        tp, entry = ebc.plan[name], out[name]
        rows = slice(sh.row_offset, sh.row_offset + sh.num_rows)
        cols = slice(sh.col_offset, sh.col_offset + sh.num_cols)
        entry["weight"][rows, cols] = w
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            entry["replicas"].append(w)
        for k, v in st.items():
            R, D = entry["weight"].shape
            if v.dim() == 2:
                entry.setdefault(k, torch.full((R, D), float("nan")))[rows, cols] = v
            elif tp.sharding_type is ShardingType.COLUMN_WISE and per_block:
                entry.setdefault(k, {})[(sh.col_offset, sh.num_cols)] = v
            elif tp.sharding_type is ShardingType.COLUMN_WISE:
                entry.setdefault(f"{k}_copies", []).append(v)
                entry[k] = v
            else:
                entry.setdefault(k, torch.full((R,), float("nan")))[rows] = v
    return out


def build(device, opt_name, plan, exact=None, seed=0, group=None):
    options = LookupOptions(column_wise_exact=EXACT.get(opt_name, True) if exact is None else exact)
    opt = OPTIMIZERS[opt_name]
    return ShardedEmbeddingBagCollection(TABLES, plan, opt, device=device, seed=seed, options=options, group=group)


def train(ebc, rank, world, device, steps, seed):
    keys = [f for t in TABLES for f in t.feature_names]
    for per_rank, upstream in random_batches(TABLES, [3] * world, steps, seed):
        out = ebc(to_kjt(per_rank[rank], keys, device)).to_dict()
        sum((out[f] * upstream[rank][f].to(device)).sum() for f in keys).backward()


# ---- a small model of two collections and a DDP dense part, for resume ------------------------------------

TOY_A = [TableConfig("u", 60, 8, ("fu",), ids_per_bag=2), TableConfig("w", 45, 12, ("fw",), ids_per_bag=2)]
TOY_B = [TableConfig("x", 50, 8, ("fx",), ids_per_bag=2)]
GLOBAL_BATCH = 12
NUM_DENSE = 4


class _ScaleGrad(torch.autograd.Function):
    """Identity; the gradient times `scale` (1 / world size: the embeddings then get the gradient of the global
    mean loss, like the DDP dense part, so training does not depend on the world size)."""

    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.scale, None


def toy(world, device, seed):
    """(TrainState, step function) of the small model."""
    types_a = {"u": "column_wise", "w": "row_wise"}
    plan_a = simple_plan(TOY_A, world, world, types_a, tier=TIER)
    plan_b = simple_plan(TOY_B, world, world, {"x": "table_wise"}, tier=TIER)
    ebc_a = ShardedEmbeddingBagCollection(TOY_A, plan_a, OPTIMIZERS["rowwise"], device=device, seed=seed)
    ebc_b = ShardedEmbeddingBagCollection(TOY_B, plan_b, OPTIMIZERS["adam"], device=device, seed=seed)
    torch.manual_seed(seed)  # a training script seeds every stream at the start
    np.random.seed(seed)
    random.seed(seed)
    width = NUM_DENSE + 8 + 12 + 8
    dense: nn.Module = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    if world > 1:
        dense = nn.parallel.DistributedDataParallel(dense, device_ids=[device.index] if CUDA else None)
    opt = torch.optim.Adam(dense.parameters(), lr=0.01)
    state = TrainState({"ebc": ebc_a, "extra": ebc_b}, dense, opt)

    def step(step_index: int, rank: int) -> float:
        torch.rand(1), np.random.rand(), random.random()  # the streams advance every step (restored on resume)
        gen = torch.Generator().manual_seed(1000 + step_index)
        B = GLOBAL_BATCH // world
        x = torch.randn(GLOBAL_BATCH, NUM_DENSE, generator=gen)[rank * B : (rank + 1) * B]
        y = torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen).float()[rank * B : (rank + 1) * B]
        (batch_a,), _ = random_batches(TOY_A, [GLOBAL_BATCH], 1, 2000 + step_index)[0]
        (batch_b,), _ = random_batches(TOY_B, [GLOBAL_BATCH], 1, 3000 + step_index)[0]
        kjts = []
        for batch, keys in ((batch_a, ["fu", "fw"]), (batch_b, ["fx"])):
            mine = {}
            for f in keys:
                lengths, ids, _ = batch[f]
                ends = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                lo, hi = int(ends[rank * B]), int(ends[(rank + 1) * B])
                mine[f] = (lengths[rank * B : (rank + 1) * B], ids[lo:hi], None)
            kjts.append(to_kjt(mine, keys, device))
        pooled = torch.cat([ebc_a(kjts[0]).values(), ebc_b(kjts[1]).values()], dim=1)
        logits = dense(torch.cat([x.to(device), _ScaleGrad.apply(pooled, 1.0 / world)], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss)

    return state, step


def toy_result(state: TrainState, losses: list[float]) -> dict:
    dense = getattr(state.dense, "module", state.dense)
    return {
        "losses": losses,
        "draws": (torch.rand(2).tolist(), float(np.random.rand()), random.random()),
        "tables": {p: full_state(c) for p, c in state.collections.items()},
        "dense": {k: v.detach().cpu().clone() for k, v in dense.state_dict().items()},
        "steps": {p: c.optimizer_step for p, c in state.collections.items()},
    }


def toy_run(rank, world, device, folder, resume, start, end, save_at=(), keep_last=3):
    """Train the small model from step `start` (resumed from `folder` if `resume`) to `end`; save at `save_at`."""
    state, step = toy(world, device, seed=7 if resume else 0)
    ckpt = Checkpointer(state, folder, keep_last=keep_last, chunk_bytes=CHUNK_BYTES)
    position = None
    if resume:
        torch.manual_seed(999 + rank)  # a different stream: the checkpoint must restore the saved one
        random.seed(999)
        np.random.seed(999)
        got, position = ckpt.resume("latest")
        assert got == start, (got, start)
    losses = []
    for s in range(start + 1, end + 1):
        losses.append(step(s, rank))
        if s in save_at:
            ckpt.save(s, {"batches": s, "rank": rank})
    ckpt.close()
    return {**toy_result(state, losses), "position": position}


# ---- a two-tower model in catalog mode (sampled softmax), for the catalog's collection and sampler ----------


def catalog_model(world, device, seed, item_plan="row_wise", user_plan="table_wise"):
    """(RecModel, dense optimizer, data source) of configs/two_tower_synthetic_1m.yaml made small."""
    from embshard.config import load_config
    from embshard.data import build_source
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    overrides = ["model.tables[0].num_embeddings=300", "model.tables[1].num_embeddings=1000"]
    overrides += ["model.two_tower.loss=sampled_softmax", "model.two_tower.sampled_softmax.num_negatives=64"]
    overrides += ["data.synthetic.affinity.clusters=10", "schedule.batch_size=16", f"seed={seed}"]
    cfg = load_config(str(ROOT / "configs/two_tower_synthetic_1m.yaml"), overrides)
    tables = list(cfg.model.tables)
    plan = simple_plan(tables, world, world, {"t_user": user_plan, "t_item": item_plan}, tier=TIER)
    rank = dist.get_rank() if dist.is_initialized() else 0
    source = build_source(cfg.data, tables, cfg.schedule.batch_size, cfg.seed, rank, world)
    model = RecModel(cfg.model, source.num_dense, plan, cfg.sparse_optimizer, device, world, cfg.seed)
    return model, make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters()), source


def catalog_result(model) -> dict:
    sampler = model.catalog.sampler
    counts = gather([(sampler.row_offset, sampler.counts.cpu().clone())])
    full = torch.full((model.catalog.table.num_embeddings,), float("nan"), dtype=torch.float64)
    for r0, c in counts:
        full[r0 : r0 + c.numel()] = c
    return {
        "tables": {"ebc": full_state(model.ebc), "catalog": full_state(model.catalog.ebc)},
        "dense": {k: v.detach().cpu().clone() for k, v in model.dense_module().state_dict().items()},
        "counts": full,
        "sampler_step": model.catalog.sampler_step,
    }


def catalog_save(rank, world, device, folder):
    """Train the catalog model 3 steps and save it."""
    model, opt, source = catalog_model(world, device, seed=0)
    batches = source.train_batches(0)
    for _ in range(3):
        out = model.step(next(batches).to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
    ckpt = Checkpointer(TrainState.of_model(model, opt), folder, chunk_bytes=CHUNK_BYTES)
    ckpt.save(3)
    ckpt.close()
    return catalog_result(model)


def catalog_load(rank, world, device, folder):
    """A fresh catalog model (other seed, other plan) loaded from the checkpoint."""
    model, opt, _ = catalog_model(world, device, seed=5, user_plan="row_wise")
    ckpt = Checkpointer(TrainState.of_model(model, opt), folder)
    assert ckpt.resume("latest")[0] == 3
    return catalog_result(model)
