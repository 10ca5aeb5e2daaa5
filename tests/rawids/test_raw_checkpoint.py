"""Checkpoints of raw-id tables: saved on 2 ranks (a table-wise LRU table, row-wise LFU and LRU tables in one lookup group, a static table),
loaded on 3 ranks (the row-wise tables' rows move to the blocks that own their ids under 3 blocks): the same
held-out loss (unknown ids included), every id's row, optimizer state and use record carried, and one more training
step on resident ids gives the same held-out loss on 2 and on 3 ranks (a NEW id's first values are its row's
initial ones, and its row differs between the two). Loaded on 2 ranks (the same blocks) it is bit-identical.
`embshard checkpoint export` writes each raw-id table's id -> row map beside its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from parity import to_kjt
from raw_cases import gathered_vocab, id_pools, pool_batches

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
from embshard.spec.plan import MemoryTier
from embshard.tools.checkpoint import main as checkpoint_cli

TABLES = [
    TableConfig("tw", 60, 8, ("fa", "fb"), ids="raw", ids_per_bag=2),
    TableConfig("rw0", 40, 8, ("fe",), ids="raw", ids_per_bag=1),  # shares rw's lookup group, before it
    TableConfig("rw", 90, 8, ("fc",), ids="raw", eviction="lfu", ids_per_bag=2),
    TableConfig("s", 20, 8, ("fd",)),
]
FEATURES = ["fa", "fb", "fe", "fc", "fd"]
POOLS = {"tw": 30, "rw": 30, "rw0": 8}
GLOBAL = 12  # samples per step, split over the ranks
OPT = FusedOptimizerConfig("rowwise_adagrad", lr=0.2, eps=1e-6)


def _plan(world: int, device):
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    return simple_plan(TABLES, world, sharding_types={"rw": "row_wise", "rw0": "row_wise"}, tier=tier)


def _global_batches(steps: int, seed: int, unseen: bool = False):
    """Per step the global batch as GLOBAL one-sample batches (split over any world size the same way)."""
    pools = id_pools(TABLES, POOLS, 3)
    if unseen:  # held-out ids: half from the pools, half never seen
        pools = {k: torch.cat([v[:10], v[:10] + 2]) for k, v in pools.items()}
    return pool_batches(TABLES, pools, [1] * GLOBAL, steps, seed)


def _local(samples: list, rank: int, world: int) -> dict:
    """This rank's slice of a global batch of one-sample batches."""
    mine = samples[rank * GLOBAL // world : (rank + 1) * GLOBAL // world]
    out = {}
    for f in FEATURES:
        parts = [s[f] for s in mine]
        w = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
        out[f] = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), w)
    return out


def _loss(ebc, samples, rank, world, device, grad: bool) -> torch.Tensor:
    """Sum over this rank's samples of (sum_f <pooled_f, v_f> - y)^2 with fixed v_f and y."""
    gen = torch.Generator().manual_seed(77)
    v = {f: torch.randn(8, generator=gen).to(device) for f in FEATURES}
    y = torch.randn(GLOBAL, generator=gen)[rank * GLOBAL // world : (rank + 1) * GLOBAL // world].to(device)
    with torch.set_grad_enabled(grad):
        out = ebc(to_kjt(_local(samples, rank, world), FEATURES, device)).to_dict()
        score = sum(out[f] @ v[f] for f in FEATURES)
        return ((score - y) ** 2).sum()


def _held_out(ebc, rank, world, device) -> float:
    total = _loss(ebc, _global_batches(1, 500, unseen=True)[0], rank, world, device, grad=False).detach()
    dist.all_reduce(total)
    return float(total)


def _train(ebc, rank, world, device, batches) -> None:
    for samples in batches:
        _loss(ebc, samples, rank, world, device, grad=True).backward()


def _per_id(ebc) -> dict:
    """{table: {id: (weight row, state, last, count)}} over every rank."""
    vocab = gathered_vocab(ebc)
    w = ebc.full_weights()
    states = {}
    for name, s, st in ebc.local_optimizer_states():
        if "m" in st:
            states.setdefault(name, {}).update({s.row_offset + r: float(st["m"][r]) for r in range(s.num_rows)})
    maps = {}
    for name, s, views in ebc.local_id_maps():
        for r in range(s.num_rows):
            maps.setdefault(name, {})[s.row_offset + r] = (int(views["id_last"][r]), int(views["id_count"][r]))
    everyone = [(states, maps)]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (states, maps))
    states, maps = {}, {}
    for st, mp in everyone:
        for k, v in st.items():
            states.setdefault(k, {}).update(v)
        for k, v in mp.items():
            maps.setdefault(k, {}).update(v)
    return {t: {i: (w[t][r], states[t][r], *maps[t][r]) for i, r in rows.items()} for t, rows in vocab.items()}


def _same(a: dict, b: dict) -> bool:
    """Whether two `_per_id` results are equal (weights bit for bit)."""
    if a.keys() != b.keys() or any(a[t].keys() != b[t].keys() for t in a):
        return False
    return all(torch.equal(a[t][i][0], b[t][i][0]) and a[t][i][1:] == b[t][i][1:] for t in a for i in a[t])


def _clocks(ebc) -> list[tuple[int, int]]:
    """(host clock, device clock) of every id map of this rank (equal at every step boundary)."""
    return [(m.clock, int(m.clock_t)) for m, i in ebc._id_maps() if i == 0]


def _save_worker(rank, world, device, folder):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    ebc = ShardedEmbeddingBagCollection(TABLES, _plan(world, device), OPT, device=device, seed=1)
    _train(ebc, rank, world, device, _global_batches(4, 8))
    ckpt = Checkpointer(TrainState({"ebc": ebc}), folder, async_save=False, chunk_bytes=600)
    ckpt.save(4)
    ckpt.close()
    out = {"held_out": _held_out(ebc, rank, world, device), "per_id": _per_id(ebc)}
    # the same blocks: read back bit for bit
    again = ShardedEmbeddingBagCollection(TABLES, _plan(world, device), OPT, device=device, seed=2)
    load_checkpoint(latest(folder), TrainState({"ebc": again}), chunk_bytes=600)
    out["same_blocks"] = (
        _same(_per_id(again), out["per_id"]) and _held_out(again, rank, world, device) == out["held_out"]
    )
    out["clocks"] = _clocks(ebc) + _clocks(again)
    _train(ebc, rank, world, device, _global_batches(1, 8))  # ids all resident (a new id's first row differs)
    out["after_step"] = _held_out(ebc, rank, world, device)
    out["stats"] = ebc.raw_id_stats(gather=True)
    return out


def _load_worker(rank, world, device, folder):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    ebc = ShardedEmbeddingBagCollection(TABLES, _plan(world, device), OPT, device=device, seed=5)
    load_checkpoint(latest(folder), TrainState({"ebc": ebc}), chunk_bytes=600)
    out = {"held_out": _held_out(ebc, rank, world, device), "per_id": _per_id(ebc), "clocks": _clocks(ebc)}
    _train(ebc, rank, world, device, _global_batches(1, 8))
    out["after_step"] = _held_out(ebc, rank, world, device)
    out["clocks"] += _clocks(ebc)
    return out


def test_raw_id_checkpoint_reshards_from_2_to_3_ranks(run, tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run(_save_worker, 2, folder)[0]
    assert saved["same_blocks"]
    # the device clock follows the host clock through training and a load (the load's rebuild sets both)
    assert saved["clocks"] and all(h == d > 0 for h, d in saved["clocks"]), saved["clocks"]
    assert saved["stats"]["rw"]["evicted"] == 0 and saved["stats"]["rw"]["resident"] > 10
    loaded = run(_load_worker, 3, folder)[0]
    assert loaded["clocks"] and all(h == d > 0 for h, d in loaded["clocks"]), loaded["clocks"]
    assert abs(loaded["held_out"] - saved["held_out"]) <= 1e-5 * abs(saved["held_out"])
    assert _same(loaded["per_id"], saved["per_id"])
    assert abs(loaded["after_step"] - saved["after_step"]) <= 1e-5 * abs(saved["after_step"])
    assert loaded["after_step"] != loaded["held_out"]  # the extra step trained

    out = tmp_path / "export"
    checkpoint_cli(["export", folder, "--out", str(out)])
    listed = {t["table"]: t for t in json.loads((out / "tables.json").read_text())["tables"]}
    assert listed["tw"]["ids_file"] == "tw.ids.safetensors" and "ids_file" not in listed["s"]
    from safetensors.torch import load_file

    for table in ("tw", "rw0", "rw"):
        got = load_file(str(out / f"{table}.ids.safetensors"))
        weights = load_file(str(out / f"{table}.safetensors"))["weight"]
        resident = (got["id_last"] >= 0).nonzero().flatten().tolist()
        pairs = {int(got["ids"][r]): r for r in resident}
        assert pairs.keys() == saved["per_id"][table].keys()
        for i, r in pairs.items():
            assert torch.equal(weights[r], saved["per_id"][table][i][0])
    assert Path(out / "s.safetensors").is_file()
