"""On-disk layout of a checkpoint and the torch.distributed.checkpoint (DCP) planners that write and read pieces.

A checkpoint is one folder `DIR/step_<N>/`:

    manifest.json   what it holds: step, world size, plans, tables, optimizers, config (rank 0, written first)
    __<r>_<i>.distcp  rank r's data, one file per chunk (DCP FileSystemWriter, one file per item)
    .metadata       DCP's index of every chunk of every logical tensor (rank 0, after all ranks wrote)
    COMMIT          written last, atomically (temporary file, fsync, rename): only then the checkpoint exists;
                    it records every other file's size and CRC-32 (integrity.py)

`latest(DIR)` is the committed checkpoint with the highest step; a folder without COMMIT (a save that was killed)
is never loaded, and is removed by the next save, as are checkpoints of later steps than the one just saved (left
by a run that went further: a run resumed from an earlier step replaces its future). The data are a standard DCP checkpoint: the tables' pieces
are chunks of logical tensors (as TorchRec's ShardedTensors save them), written and read by the planners here,
which take pieces (pieces.Piece) instead of a state dict's tensors, so any process can read any rows of any
logical tensor, with or without a process group (DCP's resharding: `create_read_items_for_chunk_list`; the
reading side is reading.py).

A checkpoint may come from someone else (files.py): COMMIT, the manifest and the index are read as regular files
of bounded size; every name in them that becomes a path is a plain file name; a `step_<N>` that is a symbolic link
is no checkpoint of the folder (never listed, loaded by `latest` or pruned through). Whether a checkpoint carries
checksums is protected too: a COMMIT that says "checksum" (or has a key no save writes, as a damaged "files" key
would be) but has no "files" is damaged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from embshard.checkpoint import integrity
from embshard.checkpoint.files import CheckpointDamaged, escape, plain_name, read_bytes
from embshard.checkpoint.pieces import Piece
from embshard.spec.tables import ConfigError

FORMAT = "embshard-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(folder: str | os.PathLike, step: int) -> Path:
    """The checkpoint folder of `step` in `folder`."""
    return Path(folder) / f"step_{step}"


def is_committed(path: str | os.PathLike) -> bool:
    """Whether the checkpoint folder is complete (its COMMIT marker exists)."""
    return (Path(path) / COMMIT).is_file()


def checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path, bool]]:
    """(step, path, committed) of every step_<N> folder in `folder`, by step (a symbolic link is none: it is
    neither loaded by `latest` nor pruned)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and not p.is_symlink() and p.is_dir()
    ]
    return [(s, p, is_committed(p)) for s, p in sorted(found)]


def latest(folder: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step in `folder`, or None."""
    done = [p for _, p, ok in checkpoints(folder) if ok]
    return done[-1] if done else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> dict:
    """Write `text` to `path` so that it appears whole or not at all (temporary file, fsync, rename); returns its
    record (bytes, CRC-32)."""
    data = text.encode()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return integrity.entry(len(data), zlib.crc32(data))


def remove(path: Path) -> None:
    """Delete a checkpoint folder: its COMMIT first, so a half-deleted folder is never taken for complete. A
    symbolic link is removed itself, never followed."""
    if path.is_symlink():
        path.unlink()
        return
    (path / COMMIT).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prepare(path: Path, manifest: dict) -> dict:
    """Rank 0, before a save: an empty folder holding only the manifest (a stale folder of the step is removed);
    returns the manifest's record (bytes, CRC-32)."""
    if path.exists():
        remove(path)
    path.mkdir(parents=True)
    return write_atomic(path / MANIFEST, json.dumps(manifest, indent=1, default=_json_default))


def commit(path: Path, info: dict, files: dict | None = None) -> None:
    """Rank 0, after every rank's data and DCP's index are written: the marker that makes the checkpoint exist,
    with `files`, the size and CRC-32 of every other file (integrity.files_record)."""
    text = json.dumps(info, indent=1)
    if files is not None:  # one line per file
        rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(rec)}" for name, rec in files.items())
        text = f'{text[:-2]},\n "checksum": "{integrity.ALGORITHM}",\n "files": {{\n{rows}\n }}\n}}'
    write_atomic(path / COMMIT, text)


def prune(folder: Path, keep: int, current: int) -> list[Path]:
    """After committing step `current`: delete checkpoints of later steps (another run's, which went further from
    an earlier point: not this run's future, and `latest` must not pick them), committed ones older than the
    `keep` newest (keep 0: none), and uncommitted folders (saves that were killed); returns what was deleted."""
    found = checkpoints(folder)
    gone = [p for s, p, _ in found if s > current]
    done = [p for s, p, ok in found if ok and s <= current]
    gone += done[:-keep] if keep > 0 else []
    gone += [p for s, p, ok in found if not ok and s < current]
    for p in gone:
        remove(p)
    return gone


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a committed checkpoint; a ConfigError naming the problem and the fix otherwise."""
    path = Path(path)
    if path.is_file():
        raise ConfigError(
            f"checkpoint {str(path)!r} is a file: checkpoints are folders (DIR/step_<N>) since the sharded format; "
            "this file is of the old single-file format, which is no longer read: train again to save one"
        )
    if not path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist: check checkpoint.resume_from")
    if not is_committed(path):
        raise ConfigError(
            f"checkpoint {str(path)!r} is incomplete (no {COMMIT} marker: its save was interrupted); resume from an "
            "earlier one, e.g. checkpoint.resume_from=latest"
        )
    record = checksums(path)
    rec = None if record is None else record.get(MANIFEST)
    expected = integrity.expect(rec) if rec else "the manifest its save wrote first"
    data = read_bytes(path, MANIFEST, expected, rec["bytes"] if rec else None)
    integrity.check_bytes(path, MANIFEST, data, record)
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise ConfigError(
            f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON ({e}): the file is damaged"
        ) from None
    fmt, version = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else (None, None)
    if fmt != FORMAT or version != VERSION:
        raise ConfigError(
            f"checkpoint {str(path)!r} has format {escape(repr(fmt))[:100]} version {escape(repr(version))[:40]}; "
            f"this embshard reads {FORMAT!r} version {VERSION}"
        )
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, manifest: dict) -> None:
    """Raise unless the manifest's collections and tables (names that become file names on export) are plain
    names with whole shapes."""
    where = f"checkpoint {str(path)!r}: {MANIFEST}"

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where} is damaged: {escape(what)}")

    collections = manifest.get("collections")
    if not isinstance(collections, dict):
        raise bad("it has no collections")
    for prefix, col in collections.items():
        plain_name(prefix, "a collection named", where)
        if not isinstance(col, dict) or not isinstance(col.get("tables"), dict):
            raise bad(f"collection {prefix!r} has no tables")
        for name, t in col["tables"].items():
            plain_name(name, f"a table of collection {escape(repr(prefix))} named", where)
            if not isinstance(t, dict) or not all(type(t.get(k)) is int and t[k] > 0 for k in ("rows", "dim")):
                raise bad(f"table {name!r} of collection {prefix!r} has no positive integer rows and dim")


_COMMIT_KEYS = frozenset({"step", "bytes", "write_s", "checksum", "files"})
"""The keys a save writes into COMMIT."""
_CRC = re.compile(r"^[0-9a-f]{8}$")


def read_commit(path: str | os.PathLike) -> dict:
    """The COMMIT marker's record (step, bytes written, seconds; since checksums: every other file's bytes and
    CRC-32 under "files"), read as a regular file of bounded size; CheckpointDamaged if it is not such a record,
    UnsafeCheckpoint if a file it names is not a plain file name."""
    data = read_bytes(path, COMMIT, "the JSON record its save wrote")
    try:
        info = json.loads(data)
        if not isinstance(info, dict):
            raise ValueError("not an object")
        files = info.get("files")
        if files is None and ("checksum" in info or not set(info) <= _COMMIT_KEYS):
            odd = sorted(set(info) - _COMMIT_KEYS)
            raise ValueError(f'no checksums record "files"{f" (but {odd})" if odd else ""}')
        if files is not None:
            if not isinstance(files, dict):
                raise ValueError('"files" is not an object')
            for rec in files.values():
                if not (isinstance(rec, dict) and type(rec.get("bytes")) is int and rec["bytes"] >= 0):
                    raise ValueError("a file's record lacks its bytes")
                if not (isinstance(rec.get(integrity.ALGORITHM), str) and _CRC.match(rec[integrity.ALGORITHM])):
                    raise ValueError(f"a file's record lacks its {integrity.ALGORITHM}")
    except ValueError as e:
        raise CheckpointDamaged(path, COMMIT, "the JSON record its save wrote", f"{e}") from None
    for name in files or ():
        plain_name(name, "a file recorded in COMMIT named", f"checkpoint {str(path)!r}: {COMMIT}")
    return info


def checksums(path: str | os.PathLike) -> dict | None:
    """Every file's record (bytes, CRC-32) from COMMIT, or None for a checkpoint saved before they were recorded."""
    return read_commit(path).get("files")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if hasattr(obj, "value"):  # enums
        return obj.value
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    return str(obj)


def to_json(obj: Any) -> str:
    """JSON text of plain data, numpy/torch scalars, enums and dataclasses."""
    return json.dumps(obj, default=_json_default)


# ---- DCP planners over pieces ------------------------------------------------------------------------------


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the plain state dict (dense model and optimizer, scalars, per-rank records),
    plus one write item per piece: a chunk of a logical tensor, as a ShardedTensor's local shard would be."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__()
        self._pieces = {(p.key, tuple(p.offsets)): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(p.key, p.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.size()),
                    properties=TensorProperties(dtype=p.tensor.dtype),
                    size=torch.Size(p.size),
                ),
            )
            for p in self._pieces.values()
        ]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        piece = self._pieces.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if piece is None:
            return super().resolve_data(write_item)
        return piece.tensor.detach()


def writer(path: Path, io_threads: int) -> FileSystemWriter:
    """DCP's file writer, one file per chunk (so the writer holds one chunk at a time), fsynced; the CRC-32 of every
    file it writes is in `writer.fs.sums` afterwards."""
    w = FileSystemWriter(str(path), single_file_per_rank=False, sync_files=True, thread_count=max(1, io_threads))
    w.fs = integrity.ChecksumFileSystem()
    return w
