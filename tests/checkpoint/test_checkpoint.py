"""Sharded checkpoints (embshard/checkpoint, docs/checkpoints.md), on gloo processes.

Saved on 2 ranks (every sharding type, every optimizer, async and sync, tables cut into chunks) and loaded on
1, 3 and 4 ranks under other plans, every type into every other: weights and optimizer state bit-identical, Adam's
step count restored, row-wise Adagrad state mapped between per-row and per-column-block as documented; every rank
wrote only its own shards and reads only the saved chunks that overlap its shards. A model of two collections and
a DDP dense part (Adam, dropout) trained 20 steps straight equals 10 steps + resume + 10 bitwise (losses,
tables, optimizer state, dense weights, RNG, data position); resumed on 3 ranks with the same global batch it
matches within floating-point tolerance. `embshard checkpoint inspect / export`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_cases import (
    CHUNK_BYTES,
    OPTIMIZERS,
    TABLES,
    TYPES,
    build,
    catalog_load,
    catalog_save,
    full_state,
    plan_for,
    toy_run,
    train,
)
from dist_harness import device_kind, run_distributed

from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
from embshard.spec.plan import ShardingType
from embshard.tools.checkpoint import main as checkpoint_cli

SAVE_WORLD = 2
ALL_ROTATIONS = ("rowwise", "adam")  # the other optimizers' states follow the weights (or they have none)
LOADS = {  # world size -> [(rotation, column blocks, optimizers)]
    1: [(0, 2, tuple(OPTIMIZERS))],
    3: [(k, 2 + k % 2, tuple(OPTIMIZERS) if k < 2 else ALL_ROTATIONS) for k in range(5)],
    4: [(1, 2, tuple(OPTIMIZERS)), (3, 3, ALL_ROTATIONS + ("rowwise_blocks",))],
}


def _save_worker(rank, world, device, folder):
    out = {"tables": {}, "steps": {}, "writes": {}}
    plan = plan_for(world, 0)
    for i, name in enumerate(OPTIMIZERS):
        ebc = build(device, name, plan)
        train(ebc, rank, world, device, steps=2, seed=10 + i)
        ckpt = Checkpointer(
            TrainState({"ebc": ebc}), f"{folder}/{name}", async_save=i % 2 == 0, chunk_bytes=CHUNK_BYTES
        )
        stats = ckpt.save(3 + i)
        ckpt.close()
        assert stats.done and stats.bytes > 0
        out["tables"][name] = full_state(ebc)
        out["steps"][name] = ebc.optimizer_step
    out["plan"] = plan
    # the model of two collections: 20 steps straight; 10 steps saved at 5 and 10 (keeping one), resumed to 20
    out["straight"] = toy_run(rank, world, device, None, False, 0, 20)
    out["first"] = toy_run(rank, world, device, f"{folder}/toy", False, 0, 10, (5, 10), 1)
    out["resumed"] = toy_run(rank, world, device, f"{folder}/toy", True, 10, 20)
    out["catalog"] = catalog_save(rank, world, device, f"{folder}/catalog")
    return out


def _loads(world, rank, device, folder, group, reads):
    out = {}
    for rotation, blocks, names in LOADS[world]:
        plan = plan_for(world, rotation, blocks)
        for name in names:
            exact = (rotation % 2 == 0) if name.startswith("rowwise") else None  # both state layouts
            ebc = build(device, name, plan, exact=exact, seed=5, group=group)
            reads.clear()
            resumed = load_checkpoint(latest(f"{folder}/{name}"), TrainState({"ebc": ebc}), chunk_bytes=CHUNK_BYTES)
            out[(rotation, name)] = {
                "state": full_state(ebc),
                "step": ebc.optimizer_step,
                "resumed": resumed.step,
                "plan": plan,
                "reads": sorted(set(reads)),
                "shards": [(n, s) for n, s, _ in ebc.local_shards()],
            }
    return out


def _load_worker(rank, world, device, folder):
    """Loads on 1 rank (world 1: in the test process), on ranks 0-2 of 4 (a 3-rank group), on all 4 ranks; the
    model of two collections resumed on 4 ranks."""
    from embshard.checkpoint.reading import VerifyingReader

    reads: list = []
    original = VerifyingReader.read_data

    def spy(self, plan, planner):
        reads.extend((i.storage_index.fqn, tuple(i.storage_index.offset or ())) for i in plan.items)
        return original(self, plan, planner)

    VerifyingReader.read_data = spy
    try:
        if world == 1:
            return {1: _loads(1, 0, device, folder, None, reads)}
        three = torch.distributed.new_group([0, 1, 2])
        out = {3: _loads(3, rank, device, folder, three, reads) if rank < 3 else None}
        out[4] = _loads(4, rank, device, folder, None, reads)
        out["resumed_4"] = toy_run(rank, world, device, f"{folder}/toy", True, 10, 20)
        out["catalog"] = catalog_load(rank, world, device, f"{folder}/catalog")
        return out
    finally:
        VerifyingReader.read_data = original


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    return folder, run_distributed(_save_worker, SAVE_WORLD, str(folder))


@pytest.fixture(scope="module")
def spawned_loads(saved):
    folder, _ = saved
    return run_distributed(_load_worker, 4, str(folder))


@pytest.fixture(scope="module", params=sorted(LOADS), ids=lambda w: f"load_on_{w}")
def loaded(request, saved):
    folder, _ = saved
    world = request.param
    if world == 1:  # one rank: in this process, without torch.distributed
        return world, [_load_worker(0, 1, torch.device(device_kind()), str(folder))[1]]
    return world, [r[world] for r in request.getfixturevalue("spawned_loads")[:world]]


EXACT = device_kind() == "cpu"  # bitwise resume on the CPU; on GPUs the kernels may sum in another order


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{what}: not every element was loaded"
    assert torch.equal(got, want), f"{what}: differs (max {float((got.double() - want.double()).abs().max())})"


def _per_block_mean(blocks: dict, c0: int, width: int) -> torch.Tensor:
    """The documented mapping: the saved blocks' states weighted by their overlap with columns [c0, c0+width)."""
    total = 0
    for (b0, bw), m in blocks.items():
        overlap = max(0, min(c0 + width, b0 + bw) - max(c0, b0))
        total = total + m.double() * overlap
    return (total / width).float()


def test_load_under_other_world_sizes_and_plans(saved, loaded):
    """Every type into every other (world 3 rotates all five), on 1, 3 and 4 ranks: bit-identical weights and
    optimizer state; row-wise Adagrad state per block <-> per row as documented; Adam's step count."""
    _, saved_ranks = saved
    before = saved_ranks[0]
    world, ranks = loaded
    pairs = set()
    for key, res in ranks[0].items():
        if not isinstance(key, tuple):
            continue
        rotation, name = key
        assert res["resumed"] == 3 + list(OPTIMIZERS).index(name)
        assert all(r[(rotation, name)]["step"] == before["steps"][name] for r in ranks), "Adam's step count"
        saved_plan, plan = before["plan"], res["plan"]
        for t in TABLES:
            want, got = before["tables"][name][t.name], res["state"][t.name]
            where = f"{name}, {t.name}: {saved_plan[t.name].sharding_type.value} on 2 ranks -> "
            where += f"{plan[t.name].sharding_type.value} on {world}"
            pairs.add((saved_plan[t.name].sharding_type.value, plan[t.name].sharding_type.value))
            _equal(got["weight"], want["weight"], f"{where}: weights")
            for r in got["replicas"]:
                _equal(r, want["weight"], f"{where}: a data-parallel replica")
            for k in [k for k in want if k not in ("weight", "replicas") and not k.endswith("_copies")]:
                w, g = want[k], got[k]
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    _equal(g, w, f"{where}: state {k}")
                    continue
                # row-wise Adagrad: per row [R], or per column block {(c0, width): [R]}
                D = t.embedding_dim
                per_row = w if isinstance(w, torch.Tensor) else _per_block_mean(w, 0, D)
                for copy in got.get(f"{k}_copies", []):
                    _equal(copy, got[k], f"{where}: the blocks' copies of the per-row state")
                if isinstance(g, torch.Tensor):  # loaded per row
                    if isinstance(w, torch.Tensor):
                        _equal(g, w, f"{where}: per-row state {k}")
                    else:
                        torch.testing.assert_close(g, per_row, rtol=1e-6, atol=0, msg=f"{where}: per-row from blocks")
                else:  # loaded per block
                    for (c0, width), m in g.items():
                        if isinstance(w, torch.Tensor):
                            _equal(m, w, f"{where}: per-block state from the per-row state")
                        elif (c0, width) in w:
                            _equal(m, w[(c0, width)], f"{where}: the same block's state")
                        else:
                            mean = _per_block_mean(w, c0, width)
                            torch.testing.assert_close(m, mean, rtol=1e-6, atol=0, msg=f"{where}: block mean")
    if world == 3:
        assert pairs == {(a, b) for a in TYPES for b in TYPES}, sorted(pairs)


def test_each_rank_reads_only_the_chunks_it_needs(saved, loaded):
    """Every read of a table's weights is a saved chunk (at most CHUNK_BYTES of data) that overlaps one of the
    rank's shards, and every such chunk is read."""
    from torch.distributed.checkpoint import FileSystemReader

    folder, _ = saved
    world, ranks = loaded
    for name in OPTIMIZERS:
        md = FileSystemReader(str(latest(f"{folder}/{name}"))).read_metadata()
        for rank, res in enumerate(ranks):
            for key, r in res.items():
                if not isinstance(key, tuple) or key[1] != name:
                    continue
                for t in TABLES:
                    key = f"ebc/{t.name}/weight"
                    chunks = md.state_dict_metadata[key].chunks
                    assert all(c.sizes.numel() * 4 <= CHUNK_BYTES for c in chunks), "chunks within the budget"
                    mine = [s for n, s in r["shards"] if n == t.name]
                    need = {
                        (key, tuple(c.offsets))
                        for c in chunks
                        for s in mine
                        if c.offsets[0] < s.row_offset + s.num_rows
                        and s.row_offset < c.offsets[0] + c.sizes[0]
                        and c.offsets[1] < s.col_offset + s.num_cols
                        and s.col_offset < c.offsets[1] + c.sizes[1]
                    }
                    got = {x for x in r["reads"] if x[0] == key}
                    assert got == need, f"rank {rank} of {world}, {name}, {t.name}: read {sorted(got)}, need {need}"


def test_every_rank_writes_only_its_own_shards(saved):
    """Each saved chunk of a table's weights is in a file of the rank that holds it under the saving plan
    (data-parallel: rank 0 only), and the chunks tile the table exactly once."""
    from torch.distributed.checkpoint import FileSystemReader

    folder, ranks = saved
    plan = ranks[0]["plan"]
    for name in OPTIMIZERS:
        md = FileSystemReader(str(latest(f"{folder}/{name}"))).read_metadata()
        for t in TABLES:
            key = f"ebc/{t.name}/weight"
            tp = plan[t.name]
            covered = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int32)
            for c in md.state_dict_metadata[key].chunks:
                (r0, c0), (n, w) = c.offsets, c.sizes
                covered[r0 : r0 + n, c0 : c0 + w] += 1
                path = next(
                    info.relative_path
                    for idx, info in md.storage_data.items()
                    if idx.fqn == key and tuple(idx.offset) == tuple(c.offsets)
                )
                writer = int(path.split("_")[2])
                holders = [
                    s.rank
                    for s in tp.shards
                    if s.row_offset <= r0 < s.row_offset + s.num_rows and s.col_offset <= c0 < s.col_offset + s.num_cols
                ]
                if tp.sharding_type is ShardingType.DATA_PARALLEL:
                    holders = [0]
                assert writer in holders, (
                    f"{name} {t.name}: chunk at {(r0, c0)} written by rank {writer}, held by {holders}"
                )
            assert bool((covered == 1).all()), f"{name} {t.name}: chunks do not tile the table once"


def test_resume_is_bitwise_the_straight_run(saved):
    """20 steps straight == 10 + resume (fresh model, other initial weights, other RNG streams) + 10, bitwise:
    losses, tables and optimizer states of both collections, Adam's step counts, dense weights and Adam state;
    the RNG streams (torch, numpy, random) and the data position restored; only the last checkpoint kept."""
    folder, ranks = saved
    assert [p.name for p in Path(folder, "toy").iterdir()] == ["step_10"], "keep_last=1 keeps step 10 only"
    assert max(r["straight"]["steps"]["extra"] for r in ranks) == 20  # Adam's step count (on its table's rank)
    for rank, r in enumerate(ranks):
        straight, first, resumed = r["straight"], r["first"], r["resumed"]
        assert resumed["position"] == {"batches": 10, "rank": rank}
        if EXACT:
            assert first["losses"] + resumed["losses"] == straight["losses"], f"rank {rank}: losses"
        else:
            assert first["losses"] + resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)
        assert resumed["steps"] == straight["steps"] and resumed["draws"] == straight["draws"]
        _same_model(resumed, straight, f"rank {rank}", exact=EXACT)


def _same_model(got: dict, want: dict, where: str, exact: bool) -> None:
    for prefix, tables in want["tables"].items():
        for table, st in tables.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    what = f"{where}: {prefix}/{table}/{k}"
                    if exact:
                        _equal(got["tables"][prefix][table][k], v, what)
                    else:
                        torch.testing.assert_close(got["tables"][prefix][table][k], v, rtol=1e-4, atol=1e-6, msg=what)
    for k, v in want["dense"].items():
        if exact:
            _equal(got["dense"][k], v, f"{where}: dense {k}")
        else:
            torch.testing.assert_close(got["dense"][k], v, rtol=1e-4, atol=1e-6)


def test_resume_under_another_world_size_same_global_batch(saved, spawned_loads):
    """10 steps on 2 ranks + resume on 4 ranks + 10 steps == 20 steps on 2 ranks, within tolerance (the same
    global batch; the data position falls back to the step count)."""
    _, saved_ranks = saved
    straight = saved_ranks[0]["straight"]
    for rank, r in enumerate(spawned_loads):
        res = r["resumed_4"]
        assert res["position"] == 10
        _same_model(res, straight, f"rank {rank} of 4", exact=False)
    global_losses = [sum(r["resumed_4"]["losses"][i] for r in spawned_loads) / 4 for i in range(10)]
    want = [sum(r["straight"]["losses"][10 + i] for r in saved_ranks) / 2 for i in range(10)]
    assert global_losses == pytest.approx(want, rel=1e-4)


def test_catalog_mode(saved, spawned_loads):
    """A two-tower model in catalog mode (sampled softmax) saved on 2 ranks and loaded on 4 under another plan:
    both collections (query tables 'ebc', item catalog 'catalog'), the dense part, the sampler's per-row target
    counts (resharded by rows) and its step (the seed of each step's negatives)."""
    _, saved_ranks = saved
    want = saved_ranks[0]["catalog"]
    assert want["sampler_step"] == 3 and float(want["counts"].sum()) > 0
    for rank, r in enumerate(spawned_loads):
        got = r["catalog"]
        assert got["sampler_step"] == 3
        _equal(got["counts"], want["counts"], f"rank {rank}: sampler counts")
        _same_model(got, want, f"rank {rank}: catalog model", exact=True)


def test_inspect_and_export(saved, tmp_path, capsys):
    folder, ranks = saved
    checkpoint_cli(["inspect", f"{folder}/rowwise_blocks"])
    text = capsys.readouterr().out
    assert "step 6, saved by 2 ranks" in text and "rowwise_adagrad" in text and "column_wise_exact False" in text
    assert "m_blocks [50, 2]" in text  # column-wise table c: its row-wise Adagrad state, one column per block
    line = next(x for x in text.splitlines() if x.strip().startswith("b "))
    assert "130 x 16" in line and "float32" in line
    checkpoint_cli(["export", f"{folder}/adam", "--out", str(tmp_path / "out"), "--chunk-mib", "0.001"])
    from safetensors.torch import load_file

    listing = json.loads((tmp_path / "out" / "tables.json").read_text())
    assert [t["table"] for t in listing["tables"]] == [t.name for t in TABLES] and listing["step"] == 7
    for t in TABLES:
        got = load_file(str(tmp_path / "out" / f"{t.name}.safetensors"))["weight"]
        assert got.dtype == (torch.float16 if t.data_type.value == "fp16" else torch.float32)
        _equal(got.float(), ranks[0]["tables"]["adam"][t.name]["weight"], f"exported {t.name}")
    with pytest.raises(SystemExit):
        checkpoint_cli(["export", f"{folder}/adam", "--out", str(tmp_path / "x"), "--tables", "nope"])
    assert "'nope'" in capsys.readouterr().err


def _uvm_worker(rank, world, device, folder, opt):
    from ckpt_cases import TABLES, build, random_batches, to_kjt

    from embshard import simple_plan
    from embshard.spec.plan import MemoryTier

    types = {t.name: "table_wise" for t in TABLES}

    def plan(tier):
        return simple_plan(TABLES, 1, 1, types, tier=tier)

    keys = [f for t in TABLES for f in t.feature_names]
    (probe,), _ = random_batches(TABLES, [16], 1, 77)[0]
    uvm = build(device, opt, plan(MemoryTier.UVM_CACHING))
    train(uvm, 0, 1, device, 3, seed=1)  # rows updated in the cache
    ckpt = Checkpointer(TrainState({"ebc": uvm}), f"{folder}/uvm", chunk_bytes=CHUNK_BYTES)
    ckpt.save(3)  # must write the cached rows back first
    ckpt.close()
    want = full_state(uvm)
    hbm = build(device, opt, plan(MemoryTier.HBM), seed=5)
    load_checkpoint(latest(f"{folder}/uvm"), TrainState({"ebc": hbm}), chunk_bytes=CHUNK_BYTES)
    in_hbm = full_state(hbm)
    back = build(device, opt, plan(MemoryTier.UVM_CACHING), seed=9)
    with torch.no_grad():
        back(to_kjt(probe, keys, device))  # its cache now holds the probe's rows of the seed-9 weights
    ckpt = Checkpointer(TrainState({"ebc": hbm}), f"{folder}/hbm", async_save=False)
    ckpt.save(3)
    ckpt.close()
    load_checkpoint(latest(f"{folder}/hbm"), TrainState({"ebc": back}))
    with torch.no_grad():
        pooled_back = back(to_kjt(probe, keys, device)).values().cpu()  # before full_state (which flushes)
        pooled_hbm = hbm(to_kjt(probe, keys, device)).values().cpu()
    return want, in_hbm, full_state(back), pooled_back, pooled_hbm


@pytest.mark.skipif(device_kind() != "cuda", reason="UVM-caching needs a GPU")
@pytest.mark.parametrize("opt", ["rowwise", "adam"])
def test_uvm_caching_and_back(tmp_path, opt):
    """Trained in UVM-caching (updated rows in the cache), saved, loaded into HBM: the same weights and state;
    saved from HBM and loaded into a UVM-caching model whose cache held stale rows: the same again, and its lookups
    pool the loaded rows, not the stale cached ones."""
    want, in_hbm, back, pooled_back, pooled_hbm = run_distributed(_uvm_worker, 1, str(tmp_path), opt)[0]
    for table, st in want.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                _equal(in_hbm[table][k], v, f"uvm_caching -> hbm: {table} {k}")
                _equal(back[table][k], v, f"hbm -> uvm_caching: {table} {k}")
    torch.testing.assert_close(pooled_back, pooled_hbm, rtol=1e-5, atol=1e-6)
