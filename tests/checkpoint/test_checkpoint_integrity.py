"""A damaged checkpoint never loads silently and a checkpoint never runs code (embshard/checkpoint/integrity.py,
unpickle.py; docs/checkpoints.md "Integrity" and "Safety").

One 2-rank run saves steps 1 (async) and 2 (sync) of a collection with a dense part (Adam); it also checks that
the ranks agree when only rank 1 reads the damaged file (`resume_from=latest` falls back to step 1 on both ranks
with the saved state, the named step_2 is refused on both). On copies of that checkpoint, in one process: COMMIT
records every file of every rank with its true size and CRC-32; 64 bytes of 0xff in the middle of a shard file,
or a shard file cut in half, are refused by load (naming the file, expected and found), skipped by
`resume_from=latest` (the previous checkpoint is loaded exactly), reported by `inspect --verify` (exit 1) and
refused by export (no file of the damaged table left); a `.metadata` or a non-tensor item whose pickle would
create a marker file runs nothing in inspect, export or resume, and the error names the file and the global; a
checkpoint saved without checksums loads with a notice; DCP's index of this torch holds only allowed globals.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_cases import CHUNK_BYTES, CUDA, build, full_state, plan_for, train
from torch import nn

from embshard.checkpoint import Checkpointer, TrainState, load_checkpoint, reading, storage
from embshard.checkpoint.integrity import CheckpointDamaged, crc_file, entry
from embshard.checkpoint.unpickle import ALLOWED_GLOBALS, UnsafeCheckpoint, _is_dtype, load_metadata
from embshard.spec.tables import AllRanksError, ConfigError
from embshard.tools.checkpoint import main as checkpoint_cli


def _model(device, world, seed):
    ebc = build(device, "adam", plan_for(world, 0), seed=seed)
    torch.manual_seed(seed)  # the dense part: the same replica on every rank
    dense = nn.Linear(4, 3)
    return TrainState({"ebc": ebc}, dense, torch.optim.Adam(dense.parameters(), lr=0.01))


def _snapshot(state: TrainState) -> dict:
    tables = full_state(state.collections["ebc"])
    dense = {k: v.detach().clone() for k, v in state.dense.state_dict().items()}
    return {"tables": tables, "dense": dense, "opt": copy.deepcopy(state.dense_optimizer.state_dict()["state"])}


def _step(state: TrainState, rank: int, world: int, device, seed: int) -> None:
    train(state.collections["ebc"], rank, world, device, steps=1, seed=seed)
    torch.manual_seed(seed)
    state.dense(torch.randn(5, 4)).square().sum().backward()
    state.dense_optimizer.step()


def _items(folder: Path) -> dict:
    """DCP's index: storage key -> (fqn, file)."""
    md = reading.reader(folder).read_metadata()
    return {idx: (idx.fqn, s.relative_path) for idx, s in md.storage_data.items()}


def _largest(folder: Path, prefix: str = "__", fqn_end: str = "/weight") -> Path:
    """The largest file holding a chunk of a table's weights (written by the ranks whose files start `prefix`)."""
    files = {f for fqn, f in _items(folder).values() if fqn.endswith(fqn_end) and f.startswith(prefix)}
    return max((folder / f for f in files), key=lambda p: p.stat().st_size)


def _damage(file: Path, how: str) -> None:
    data = bytearray(file.read_bytes())
    if how == "overwrite":
        mid = len(data) // 2
        data[mid : mid + 64] = b"\xff" * 64
    else:
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))


def _worker(rank, world, device, folder):
    state = _model(device, world, seed=0)
    _step(state, rank, world, device, seed=1)
    ckpt = Checkpointer(state, folder, async_save=True, chunk_bytes=CHUNK_BYTES)
    ckpt.save(1)
    ckpt.close()
    step1 = _snapshot(state)
    _step(state, rank, world, device, seed=2)
    ckpt = Checkpointer(state, folder, async_save=False, chunk_bytes=CHUNK_BYTES)
    ckpt.save(2)
    ckpt.close()
    step2 = _snapshot(state)
    damaged = f"{folder}_rank1"  # a file that only rank 1 reads back
    if rank == 0:
        shutil.copytree(folder, damaged)
        name = _largest(Path(damaged, "step_2"), prefix="__1_").name
        _damage(Path(damaged, "step_2", name), "overwrite")
    dist.barrier()
    fresh = _model(device, world, seed=7)
    logs: list[str] = []
    ckpt = Checkpointer(fresh, damaged, chunk_bytes=CHUNK_BYTES, log=logs.append)
    start, _ = ckpt.resume("latest")
    resumed = _snapshot(fresh)
    try:
        ckpt.resume(f"{damaged}/step_2")
        refused = None
    except AllRanksError as e:
        refused = str(e)
    name_box = [name if rank == 0 else None]
    dist.broadcast_object_list(name_box, src=0)
    return {"step1": step1, "step2": step2, "start": start, "resumed": resumed, "logs": logs, "refused": refused,
            "damaged_file": name_box[0]}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from dist_harness import run_distributed

    folder = tmp_path_factory.mktemp("integrity") / "ck"
    return folder, run_distributed(_worker, 2, str(folder))


def _same(got: dict, want: dict, what: str) -> None:
    for table, st in want["tables"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not k.endswith("copies"):
                assert torch.equal(got["tables"][table][k].cpu(), v.cpu()), f"{what}: {table} {k}"
    for k, v in want["dense"].items():
        assert torch.equal(got["dense"][k], v), f"{what}: dense {k}"
    for p, st in want["opt"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["opt"][p][k]), torch.as_tensor(v)), f"{what}: dense Adam {p} {k}"


def test_ranks_agree_on_damage_only_one_rank_reads(saved):
    _, ranks = saved
    for rank, r in enumerate(ranks):
        assert r["start"] == 1, r["logs"]
        _same(r["resumed"], ranks[0]["step1"], f"rank {rank} after falling back to step 1")
        assert any("step_2 is damaged" in line and r["damaged_file"] in line for line in r["logs"]), r["logs"]
        assert r["refused"] is not None and r["damaged_file"] in r["refused"] and "rank 1:" in r["refused"]
        assert "expected" in r["refused"] and "found" in r["refused"] and "Fix:" in r["refused"]


def test_every_file_of_every_rank_is_recorded(saved, capsys):
    folder, _ = saved
    for step in (1, 2):  # async, sync
        path = folder / f"step_{step}"
        files = storage.read_commit(path)["files"]
        on_disk = {p.name for p in path.iterdir()} - {"COMMIT"}
        assert set(files) == on_disk and any(f.startswith("__1_") for f in files), sorted(files)
        for name, rec in files.items():
            assert rec == entry(*crc_file(path / name)), name
        checkpoint_cli(["inspect", str(path), "--verify"])
        out = capsys.readouterr().out
        assert f"verified: {len(files)} files" in out and "checksums: CRC-32 of" in out


@pytest.fixture
def ck(saved, tmp_path):
    """A ck of the saved checkpoints (steps 1 and 2) to damage."""
    folder, _ = saved
    shutil.copytree(folder, tmp_path / "ck")
    return tmp_path / "ck"


def _fresh(seed=5) -> TrainState:
    """A one-process model on the test device (its tables in the tier the checkpoint was saved from)."""
    return _model(torch.device("cuda", 0) if CUDA else torch.device("cpu"), 1, seed)


@pytest.mark.parametrize("how", ["overwrite", "truncate"])
def test_damage_is_caught(saved, ck, how, capsys):
    _, ranks = saved
    file = _largest(ck / "step_2")
    _damage(file, how)
    found = r"bytes \(truncated\)" if how == "truncate" else "bytes with CRC-32"
    with pytest.raises(CheckpointDamaged, match=rf"{file.name}: expected \d+ bytes with CRC-32 \w+, found \d+ {found}"):
        load_checkpoint(ck / "step_2", _fresh())
    logs: list[str] = []
    state = _fresh()
    ckpt = Checkpointer(state, str(ck), chunk_bytes=CHUNK_BYTES, log=logs.append)
    assert ckpt.resume("latest")[0] == 1
    assert any(f"step_2 is damaged ({file.name}: expected" in line for line in logs), logs
    _same(_snapshot(state), ranks[0]["step1"], "fallen back to step 1")
    with pytest.raises(ConfigError, match=rf"{file.name}: expected .* Fix: resume from an earlier checkpoint"):
        ckpt.resume(str(ck / "step_2"))
    with pytest.raises(SystemExit) as e:
        checkpoint_cli(["inspect", str(ck), "--verify"])
    assert e.value.code == 1 and f"damaged: {ck}/step_2/{file.name}: expected" in capsys.readouterr().out
    out = ck.parent / "export"
    with pytest.raises(SystemExit) as e:
        checkpoint_cli(["export", str(ck / "step_2"), "--out", str(out)])
    assert e.value.code == 2 and f"is damaged: {file.name}" in capsys.readouterr().err
    table = next(fqn for fqn, f in _items(ck / "step_2").values() if f == file.name).split("/")[1]
    assert not (out / f"{table}.safetensors").exists() and not list(out.glob(".*partial"))
    checkpoint_cli(["export", str(ck / "step_1"), "--out", str(out)])  # the intact one exports
    assert (out / f"{table}.safetensors").is_file()


class _Marker:
    """A pickle that creates a file when unpickled by a plain unpickler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _rerecord(folder: Path, name: str) -> None:
    """COMMIT's record of `name` made to match the file (as a deliberate forgery would)."""
    info = json.loads((folder / "COMMIT").read_text())
    info["files"][name] = entry(*crc_file(folder / name))
    (folder / "COMMIT").write_text(json.dumps(info))


def _refused_everywhere(ck: Path, marker: Path, match: str, capsys) -> None:
    step = ck / "step_2"
    with pytest.raises(UnsafeCheckpoint, match=match):
        load_checkpoint(step, _fresh())
    for where in ("latest", str(step)):  # an unsafe newest checkpoint is not skipped: the run stops
        with pytest.raises(ConfigError, match=match):
            Checkpointer(_fresh(), str(ck)).resume(where)
    for args in (["inspect", str(step)], ["export", str(step), "--out", str(ck.parent / "x")]):
        with pytest.raises(SystemExit) as e:
            checkpoint_cli(args)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        checkpoint_cli(["inspect", str(step), "--verify"])
    assert e.value.code == 1
    assert capsys.readouterr().err.count("refused to read it") >= 2
    assert not marker.exists()


def test_crafted_pickles_run_no_code(ck, capsys):
    step = ck / "step_2"
    marker = ck.parent / "code_ran"
    (step / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(CheckpointDamaged, match=r"\.metadata: expected"):  # as left: its checksum differs
        load_checkpoint(step, _fresh())
    _rerecord(step, ".metadata")
    _refused_everywhere(ck, marker, r"\.metadata: refused to read it: its pickle names the global \w+\.system", capsys)


def test_crafted_item_runs_no_code(ck, capsys):
    """A non-tensor item (the dense optimizer's learning rate) replaced by a pickle that would run code, with DCP's
    index and COMMIT rewritten to match: torch.load(weights_only=True) refuses it."""
    step = ck / "step_2"
    marker = ck.parent / "code_ran"
    md = load_metadata((step / ".metadata").read_bytes(), "test")
    idx = next(i for i in md.storage_data if i.fqn.startswith("dense.optimizer.param_groups") and "lr" in i.fqn)
    name = md.storage_data[idx].relative_path
    (step / name).unlink()
    torch.save({"lr": _Marker(marker)}, step / name)
    md.storage_data[idx].length = (step / name).stat().st_size
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _rerecord(step, name)
    _rerecord(step, ".metadata")
    with pytest.raises(UnsafeCheckpoint, match=rf"{name} \(item '{idx.fqn}'\): refused .* the global \w+\.system"):
        load_checkpoint(step, _fresh())
    with pytest.raises(ConfigError, match="refused to read it"):
        Checkpointer(_fresh(), str(ck)).resume("latest")
    assert not marker.exists()


def test_checkpoint_without_checksums_loads_with_a_notice(saved, ck, capsys):
    _, ranks = saved
    step = ck / "step_2"
    info = json.loads((step / "COMMIT").read_text())
    (step / "COMMIT").write_text(json.dumps({k: v for k, v in info.items() if k not in ("checksum", "files")}))
    logs: list[str] = []
    state = _fresh()
    assert Checkpointer(state, str(ck), log=logs.append).resume("latest")[0] == 2
    assert any("saved without checksums" in line for line in logs), logs
    _same(_snapshot(state), ranks[0]["step2"], "step 2 without checksums")
    checkpoint_cli(["inspect", str(step), "--verify"])
    out = capsys.readouterr().out
    assert "checksums: none" in out and "not verified:" in out
    file = _largest(step)
    _damage(file, "truncate")  # still caught: DCP's index gives every chunk's length
    with pytest.raises(CheckpointDamaged, match=rf"{file.name}: expected at least \d+ bytes .* \(truncated\)"):
        load_checkpoint(step, _fresh())


def test_dcp_index_holds_only_allowed_globals(saved):
    """Every global in the .metadata this torch writes is on the allow-list (torch 2.13 here, 2.11 on the GPU
    machine's tests): a new one would make every checkpoint unreadable, so it must fail here first."""
    folder, _ = saved
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(open(folder / "step_2" / ".metadata", "rb")).load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert not [g for g in seen if g not in ALLOWED_GLOBALS and not _is_dtype(*g)], sorted(seen)
