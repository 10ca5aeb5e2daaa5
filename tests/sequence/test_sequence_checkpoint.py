"""Sequence tables through a checkpoint: saved on 2 ranks (adam: weights, both moments and the step count; adagrad:
weights and sums, FBGEMM's TBE on the CPU), loaded on 1 and on 3 ranks under another plan (every table changes
sharding type), then one more step on the same global batch: the weights equal those of the run that went on
without the checkpoint."""

from __future__ import annotations

import os

import torch
from seq_cases import OPTIMIZERS, TABLES, plan_for, random_batches, to_kjt

from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
from embshard.collection.sequence import ShardedEmbeddingCollection

KEYS = ["h_a", "h_a2", "h_b", "h_c", "h_d"]
GLOBAL_B = 6


def _slice(batch, grads, start: int, stop: int):
    """Samples start..stop of a one-rank batch (and their ids' upstream gradients)."""
    out_b, out_g = {}, {}
    for f, (lengths, ids) in batch.items():
        t = next(t for t in TABLES if f in t.feature_names)
        kept = lengths.clamp(max=t.max_length) if t.max_length else lengths
        a, b = int(lengths[:start].sum()), int(lengths[:stop].sum())
        ka, kb = int(kept[:start].sum()), int(kept[:stop].sum())
        out_b[f] = (lengths[start:stop], ids[a:b])
        out_g[f] = grads[f][ka:kb]
    return out_b, out_g


def _step(ec, rank, world, device, seed):
    """One training step of the global batch drawn from `seed`, this rank's share of its samples."""
    (((batch, grads),),) = random_batches(TABLES, [GLOBAL_B], 1, seed)
    per = GLOBAL_B // world
    mine, up = _slice(batch, grads, rank * per, (rank + 1) * per)
    out = ec(to_kjt(mine, KEYS, device))
    sum((out[f].values() * up[f].to(device)).sum() for f in KEYS).backward()


NAMES = ["adam", "adagrad"]  # per-element state, which reshards exactly (CPU: the host lookup, FBGEMM's TBE)


def _save_worker(rank, world, device, folder, seed):
    out = {}
    for name in NAMES:
        ec = ShardedEmbeddingCollection(TABLES, plan_for(world, 0), OPTIMIZERS[name], device=device, dedup=True)
        for s in range(2):
            _step(ec, rank, world, device, seed + s)
        ckpt = Checkpointer(TrainState({"ec": ec}), f"{folder}/{name}", async_save=False)
        ckpt.save(2)
        ckpt.close()
        _step(ec, rank, world, device, seed + 2)
        out[name] = (ec.full_weights(), ec.optimizer_step)
    return out


def _load_worker(rank, world, device, folder, seed):
    out = {}
    solo = torch.distributed.new_group([0])  # every rank takes part in making a group
    for name in NAMES:
        for w in (1, 3):
            if rank >= w:
                continue
            group = solo if w == 1 else None
            ec = ShardedEmbeddingCollection(TABLES, plan_for(w, 2), OPTIMIZERS[name], device=device, group=group)
            load_checkpoint(latest(f"{folder}/{name}"), TrainState({"ec": ec}))
            steps = ec.optimizer_step
            _step(ec, rank, w, device, seed + 2)
            out[name, w] = (ec.full_weights(), steps)
    return out


def test_save_on_2_load_on_1_and_3(run, tmp_path):
    seed = int.from_bytes(os.urandom(3), "little")
    saved = run(_save_worker, 2, str(tmp_path), seed)[0]
    loaded = run(_load_worker, 3, str(tmp_path), seed)[0]
    for name, w in loaded:
        want, steps = saved[name]
        got, loaded_steps = loaded[name, w]
        if name == "adam":  # its bias correction counts steps
            assert loaded_steps == steps - 1 == 2, f"world {w}: optimizer step {loaded_steps} after the load, not 2"
        for t in TABLES:
            torch.testing.assert_close(
                got[t.name],
                want[t.name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, w=w, t=t, name=name: f"seed {seed}, {name}, world {w}, {t.name}: {m}",
            )
