"""2D checkpoints: a world-4 run in sharding groups of 2 saves one replica (group 0's ranks write, group 1's write
nothing), and the checkpoint loads into other layouts: world 2 without 2D and world 8 in groups of 4, with the
same weights and optimizer state on every rank (gloo on CPU; NCCL with EMBSHARD_TEST_DEVICE=cuda)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import pytest
import torch
from dist_harness import run_distributed
from parity import random_batches, to_kjt
from twod_cases import MIXED, twod_plan

from embshard import FusedOptimizerConfig
from embshard.spec.plan import MemoryTier

OPT = FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6)
SEED = 5


def _state(ebc) -> tuple[dict, dict]:
    """Full weights, and each table's per-row optimizer state assembled from this rank's group (collective)."""
    rows = {t.name: torch.zeros(t.num_embeddings) for t in MIXED}
    mine = [(n, s, st["m"].detach().cpu()) for n, s, st in ebc.local_optimizer_states()]
    everyone: list = [None] * ebc.world_size
    torch.distributed.all_gather_object(everyone, mine, group=ebc.group)  # the rank's sharding group
    for name, s, st in (item for items in everyone for item in items):
        rows[name][s.row_offset : s.row_offset + s.num_rows] = st
    return ebc.full_weights(), rows


def _save(rank, world, device, folder):
    from embshard.checkpoint import Checkpointer, TrainState
    from embshard.checkpoint.layout import save_pieces
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    ebc = ShardedEmbeddingBagCollection(MIXED, twod_plan(MIXED, 2, tier, world=world), OPT, device=device, seed=SEED)
    features = [f for t in MIXED for f in t.feature_names]
    for per_rank, upstream in random_batches(MIXED, [2, 3, 1, 2], 2, SEED + 1):
        out = ebc(to_kjt(per_rank[rank], features, device)).to_dict()
        sum((out[f] * upstream[rank][f].to(device)).sum() for f in features).backward()
    writes = len(save_pieces(ebc, "ebc"))
    ckpt = Checkpointer(TrainState({"ebc": ebc}), folder, async_save=False)
    ckpt.save(2)
    ckpt.close()
    return {"writes": writes, "state": _state(ebc), "optimizer_step": ebc.optimizer_step}


def _load(rank, world, device, folder, group_size):
    from embshard.checkpoint import TrainState, latest, load_checkpoint
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    local = 2 if world > 2 else 1
    ebc = ShardedEmbeddingBagCollection(
        MIXED, twod_plan(MIXED, group_size, tier, world=world, local=local), OPT, device=device, seed=99
    )
    load_checkpoint(latest(folder), TrainState({"ebc": ebc}))
    return {"state": _state(ebc), "optimizer_step": ebc.optimizer_step}


@functools.cache
def _folder() -> str:
    folder = tempfile.mkdtemp(prefix="twod_ckpt_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def _saved() -> list:
    return run_distributed(_save, 4, _folder())


@functools.cache
def _loaded(world: int, group_size: int | None) -> list:
    _saved()
    return run_distributed(_load, world, _folder(), group_size)


def test_one_replica_is_saved():
    assert [r["writes"] > 0 for r in _saved()] == [True, True, False, False]


@pytest.mark.parametrize("world,group_size", [(2, None), (8, 4)], ids=["world2_no_2d", "world8_groups_of_4"])
def test_loads_into_other_layouts(world, group_size):
    saved = _saved()
    weights, rows = saved[0]["state"]
    for r in saved[1:]:  # the groups held the same replica when it was saved
        for t in MIXED:
            torch.testing.assert_close(r["state"][0][t.name], weights[t.name], rtol=0, atol=0)
    for rank, res in enumerate(_loaded(world, group_size)):
        got_w, got_rows = res["state"]
        assert res["optimizer_step"] == saved[0]["optimizer_step"]
        for t in MIXED:
            torch.testing.assert_close(got_w[t.name], weights[t.name], rtol=0, atol=0, msg=f"{t.name} rank {rank}")
            torch.testing.assert_close(got_rows[t.name], rows[t.name], rtol=0, atol=0, msg=f"{t.name} rank {rank}")
