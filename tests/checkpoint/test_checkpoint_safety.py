"""A checkpoint from someone else cannot write, delete or read outside its folder, hang a reader, or load partly
(embshard/checkpoint/files.py, unpickle.py, reading.py; docs/checkpoints.md "Safety").

One small checkpoint (one process, steps 1 and 2) is saved once; each test crafts a copy of it in tmp_path, with
COMMIT's checksums rewritten to match where a forger would: names that would leave the folder (a table of the
manifest, a chunk file of DCP's index, a file of COMMIT) are refused and export writes nothing outside OUT nor
through a link already in OUT; a `.metadata` pickle that sets attributes of a class (PosixPath._str) or state
outside the allow-list is refused; links, FIFOs and devices are not read (a FIFO under a deadline); sizes and caps
are checked; a damaged "files" key does not switch the checksums off; chunks must cover what is read and be the
tensors the index declares; export refuses absurd declared sizes; a step_<N> link is never pruned through; names
printed are escaped. Also: the checkpoint package imports nothing back up, and TableConfig names are plain.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pickle
import re
import shutil
import signal
from pathlib import Path, PosixPath

import pytest
import torch
from ckpt_cases import build, plan_for
from paths import ROOT

from embshard.checkpoint import Checkpointer, TrainState, load_checkpoint, storage
from embshard.checkpoint.files import MAX_BYTES, CheckpointDamaged, UnsafeCheckpoint
from embshard.checkpoint.integrity import crc_file, entry
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError, TableConfig
from embshard.tools.checkpoint import main as checkpoint_cli


def _ebc(seed: int = 0):
    return build(torch.device("cpu"), "rowwise", plan_for(1, 0, tier=MemoryTier.HOST), seed=seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("safety") / "ck"
    ckpt = Checkpointer(TrainState({"ebc": _ebc()}), str(folder), async_save=False, chunk_bytes=1024)
    ckpt.save(1)
    ckpt.save(2)
    ckpt.close()
    return folder


@pytest.fixture
def ck(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def _rerecord(step: Path, name: str) -> None:
    """COMMIT's record of `name` made to match the file, as a forger would."""
    info = json.loads((step / "COMMIT").read_text())
    info["files"][name] = entry(*crc_file(step / name))
    (step / "COMMIT").write_text(json.dumps(info))


def _edit_manifest(step: Path, edit) -> None:
    man = json.loads((step / "manifest.json").read_text())
    edit(man)
    (step / "manifest.json").write_text(json.dumps(man))
    _rerecord(step, "manifest.json")


def _index(step: Path):
    """DCP's index of a checkpoint as crafted so far (a plain unpickler: the test's own files)."""
    return pickle.loads((step / ".metadata").read_bytes())


def _write_index(step: Path, md) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _rerecord(step, ".metadata")


def _chunk_file(step: Path, fqn: str = "ebc/b/weight") -> str:
    md = _index(step)
    return next(s.relative_path for i, s in md.storage_data.items() if i.fqn == fqn)


def _load(step: Path) -> None:
    load_checkpoint(step, TrainState({"ebc": _ebc(seed=3)}))


def _resume_latest(folder: Path) -> tuple[int, list[str]]:
    logs: list[str] = []
    start, _ = Checkpointer(TrainState({"ebc": _ebc(seed=3)}), str(folder), log=logs.append).resume("latest")
    return start, logs


class _Hung(BaseException):
    """Raised by `_deadline` (not an OSError, which the reader would report as damage)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fail instead of hanging: SIGALRM raises `_Hung` in the test after `seconds`."""

    def expired(*_):
        raise _Hung(f"still running after {seconds} s: a read blocked or did not end")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cli(args: list[str], capsys) -> tuple[int, str]:
    code = 0
    try:
        checkpoint_cli(args)
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    return code, got.out + got.err


# ---- the package ----------------------------------------------------------------------------------------------


def test_checkpoint_package_imports_nothing_back_up():
    """No function-level import of an embshard.checkpoint module inside the package (the layout -> raw_ids -> load
    circle is gone), and no private member of the collection is used."""
    for path in sorted((ROOT / "embshard" / "checkpoint").glob("*.py")):
        text = path.read_text()
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("embshard.checkpoint"):
                        raise AssertionError(f"{path.name}:{node.lineno}: lazy import of {node.module}")
        assert not re.search(r"\bebc\._\w", text), f"{path.name} uses a private member of the collection"


# ---- names that would leave the folder --------------------------------------------------------------------------


def _rename(man: dict, where: str, new: str) -> None:
    """Table 'a' (where='table') or collection 'ebc' (where='collection') of a manifest renamed `new`."""
    holder, old = (man["collections"]["ebc"]["tables"], "a") if where == "table" else (man["collections"], "ebc")
    holder[new] = holder.pop(old)


@pytest.mark.parametrize("where", ["table", "collection"])
def test_export_writes_nothing_outside_out(ck, tmp_path, where, capsys):
    step = ck / "step_2"
    escaped = tmp_path / "x" / "ESCAPED"
    _edit_manifest(step, lambda m: _rename(m, where, "/" + "../" * 30 + str(escaped).lstrip("/")))
    code, text = _cli(["export", str(step), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and f"a {where}" in text and "not a plain file name" in text, text
    with pytest.raises(UnsafeCheckpoint, match="manifest.json: refused to read it: .* not a plain file name"):
        _load(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # neither OUT nor anything at the escaped path


def test_export_follows_no_link_in_out_and_prints_real_paths(ck, tmp_path, capsys):
    real = tmp_path / "real_out"
    real.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (real / "a.safetensors").symlink_to(victim)  # a link already in OUT
    (real / "tables.json").symlink_to(victim)
    (tmp_path / "out_link").symlink_to(real)
    code, text = _cli(["export", str(ck / "step_2"), "--out", str(tmp_path / "out_link")], capsys)
    assert code == 0, text
    assert victim.read_text() == "keep"
    assert not (real / "a.safetensors").is_symlink() and (real / "a.safetensors").stat().st_size > 100
    assert f"-> {os.path.realpath(real)}/a.safetensors" in text, text
    assert not list(real.glob(".*partial"))


def test_chunk_and_commit_names_outside_the_folder_are_refused(ck, tmp_path, capsys):
    step = ck / "step_2"
    outside = tmp_path / "outside.distcp"
    name = _chunk_file(step)
    shutil.copy(step / name, outside)
    for evil in ("../../outside.distcp", str(outside)):
        md = _index(step)
        for sinfo in md.storage_data.values():
            if sinfo.relative_path == name:
                sinfo.relative_path = evil
        _write_index(step, md)
        with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: refused to read it: its chunk file .* not a plain"):
            _load(step)
        code, text = _cli(["inspect", str(step), "--verify"], capsys)
        assert code == 1 and "not a plain file name" in text, text
    info = json.loads((step / "COMMIT").read_text())
    info["files"]["../../outside.distcp"] = info["files"].pop(name)
    (step / "COMMIT").write_text(json.dumps(info))
    with pytest.raises(UnsafeCheckpoint, match="COMMIT: refused to read it: a file recorded in COMMIT named"):
        _load(step)
    with pytest.raises(ConfigError, match="not a plain file name"):  # unsafe, not damaged: the run stops
        _resume_latest(ck)


# ---- the index's pickle -----------------------------------------------------------------------------------------


def _op_str(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


@pytest.mark.parametrize("attack", ["class_attribute", "path_instance_state", "extra_field", "items_into_class"])
def test_index_pickle_sets_no_state_outside_the_allow_list(ck, tmp_path, attack):
    step = ck / "step_2"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    genuine = (step / ".metadata").read_bytes()
    prefix = {  # each leaves one object on the stack, popped ('0') before the genuine index
        "class_attribute": b"cpathlib\nPosixPath\nN}" + _op_str("_str") + _op_str(str(victim)) + b"s\x86b",
        "path_instance_state": b"cpathlib\nPosixPath\n" + _op_str("/a") + b"\x85RN}" + _op_str("_str")
        + _op_str(str(victim)) + b"s\x86b",
        "items_into_class": b"cpathlib\nPosixPath\n(" + _op_str("_str") + _op_str(str(victim)) + b"u",
        "extra_field": None,
    }[attack]  # fmt: skip
    if prefix is None:
        md = _index(step)
        md.storage_meta.evil = str(victim)  # an attribute that is not one of StorageMeta's fields
        data = pickle.dumps(md)
    else:
        data = b"\x80\x04" + prefix + b"0" + genuine
    if attack == "class_attribute":  # what a plain unpickler (DCP's, and the allow-list of globals alone) does
        try:
            pickle.loads(b"\x80\x04" + prefix + b".")
            assert str(PosixPath("/anything")) == str(victim)
        finally:
            if "_str" in vars(PosixPath):
                del PosixPath._str
    assert str(PosixPath("/anything")) == "/anything"
    (step / ".metadata").write_bytes(data)
    _rerecord(step, ".metadata")
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: refused to read it: its pickle (sets|adds)"):
        _load(step)
    with pytest.raises(SystemExit):
        checkpoint_cli(["export", str(step), "--out", str(tmp_path / "out")])
    assert str(PosixPath("/anything")) == "/anything" and victim.read_text() == "keep"


# ---- reads: only the folder's regular files, checked before they are read -------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "dev_zero", "fifo", "folder"])
def test_only_regular_files_are_read(ck, tmp_path, kind, capsys):
    step = ck / "step_2"
    name = _chunk_file(step)
    target = step / name
    if kind == "symlink":
        shutil.copy(target, tmp_path / "copy")  # the same bytes, outside the folder
        target.unlink()
        target.symlink_to(tmp_path / "copy")
    elif kind == "dev_zero":
        target.unlink()
        target.symlink_to("/dev/zero")
    elif kind == "fifo":
        target.unlink()
        os.mkfifo(target)
    else:
        target.unlink()
        target.mkdir()
    found = {"symlink": "a symbolic link", "dev_zero": "a symbolic link", "fifo": "a FIFO", "folder": "a folder"}[kind]
    with _deadline(10):  # a FIFO opened for reading without a writer would block; /dev/zero never ends
        with pytest.raises(CheckpointDamaged, match=rf"{name}: expected \d+ bytes with CRC-32 \w+, found {found}"):
            _load(step)
        start, logs = _resume_latest(ck)  # damage: resume_from=latest falls back to the previous checkpoint
        assert start == 1 and any(f"step_2 is damaged ({name}: expected" in line for line in logs), logs
        code, text = _cli(["inspect", str(step), "--verify"], capsys)
        assert code == 1 and f"{name}: expected" in text and found in text, text
        code, text = _cli(["export", str(step), "--out", str(tmp_path / "out")], capsys)
        assert code == 2 and found in text, text


def test_sizes_and_caps_are_checked_before_reading(ck, monkeypatch):
    step = ck / "step_2"
    name = _chunk_file(step)
    with open(step / name, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CheckpointDamaged, match=rf"{name}: expected \d+ bytes .* \(longer than recorded\)"):
        _load(step)
    size = (step / "COMMIT").stat().st_size
    monkeypatch.setitem(MAX_BYTES, "COMMIT", size - 1)
    with pytest.raises(
        CheckpointDamaged, match=rf"COMMIT: expected .*\(at most {size - 1} bytes\), found {size} bytes"
    ):
        _load(step)


def test_a_damaged_files_key_does_not_switch_checksums_off(ck):
    step = ck / "step_2"
    text = (step / "COMMIT").read_text()
    assert text.count('"files"') == 1
    (step / "COMMIT").write_text(text.replace('"files"', '"fhles"'))  # one bit: 'i' ^ 0x01 = 'h'
    with pytest.raises(CheckpointDamaged, match=r"COMMIT: expected the JSON record its save wrote, found no checksums"):
        _load(step)
    assert _resume_latest(ck)[0] == 1
    (step / "COMMIT").write_text(text.replace('"checksum"', '"chdcksum"'))  # the other key: still verified
    _load(step)


# ---- what is read must be what the index declares ---------------------------------------------------------------


def test_chunks_must_cover_every_piece(ck, capsys):
    step = ck / "step_2"
    md = _index(step)
    chunks = md.state_dict_metadata["ebc/b/weight"].chunks
    last = max(chunks, key=lambda c: c.offsets[0])
    last.sizes = torch.Size([last.sizes[0] - 1, last.sizes[1]])  # 129 of the table's 130 rows
    _write_index(step, md)
    with pytest.raises(ConfigError, match=r"chunks of 'ebc/b/weight' cover \d+ of the \d+ values"):
        _load(step)
    code, text = _cli(["export", str(step), "--out", str(ck / "out"), "--tables", "b"], capsys)
    assert code == 2 and "'ebc/b/weight' cover" in text and not (ck / "out" / "b.safetensors").exists()


def test_stored_tensors_must_be_what_the_index_declares(ck):
    step = ck / "step_2"
    md = _index(step)
    md.state_dict_metadata["ebc/b/weight"].properties.dtype = torch.float64
    _write_index(step, md)
    with pytest.raises(
        CheckpointDamaged, match=r"expected a torch.float64 tensor .* found Tensor \[\d+, 16\] torch.float32"
    ):
        _load(step)


@pytest.mark.parametrize("field", ["rows", "dim"])
def test_export_refuses_absurd_declared_sizes(ck, tmp_path, field, capsys):
    step = ck / "step_2"
    _edit_manifest(step, lambda m: m["collections"]["ebc"]["tables"]["a"].__setitem__(field, 10**12))
    with _deadline(10):
        code, text = _cli(["export", str(step), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "'ebc/a/weight' of shape" in text, text
    assert not (tmp_path / "out" / "a.safetensors").exists()


# ---- the folder -------------------------------------------------------------------------------------------------


def test_a_step_link_is_never_pruned_through(ck, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ck / "step_1", elsewhere)
    (ck / "step_9").symlink_to(elsewhere)
    assert storage.latest(ck) == ck / "step_2" and 9 not in [s for s, _, _ in storage.checkpoints(ck)]
    storage.prune(ck, keep=1, current=2)
    assert (elsewhere / "COMMIT").is_file() and (elsewhere / "manifest.json").is_file()
    storage.remove(ck / "step_9")  # a link is removed itself
    assert not (ck / "step_9").is_symlink() and (elsewhere / "COMMIT").is_file()


def test_names_printed_are_escaped(ck, tmp_path, capsys):
    step = ck / "step_2"
    evil = "a\x1b]0;owned\x07\x1b[2J"
    _edit_manifest(step, lambda m: _rename(m, "table", evil))
    for args in (["inspect", str(step)], ["export", str(step), "--out", str(tmp_path / "out")]):
        code, text = _cli(args, capsys)
        assert code == 2 and "\x1b" not in text and "\x07" not in text and "\\x1b" in text, text


# ---- table names ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "a\\b", ".", "..", "a b", "t\x1b[31m", "nul\0", ""])
def test_table_and_feature_names_are_plain(name):
    with pytest.raises(ConfigError, match="table"):
        TableConfig(name, 10, 4, ("f",))
    if name:
        with pytest.raises(ConfigError, match="feature_names"):
            TableConfig("t", 10, 4, (name,))
    TableConfig("t_1.v-2", 10, 4, ("f.1-a_b",))
