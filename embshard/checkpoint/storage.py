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
which take pieces (layout.Piece) instead of a state dict's tensors, so any process can read any rows of any
logical tensor, with or without a process group (DCP's resharding: `create_read_items_for_chunk_list`).
"""

from __future__ import annotations

import dataclasses
import io
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
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from embshard.checkpoint import integrity
from embshard.checkpoint.layout import Piece
from embshard.checkpoint.unpickle import load_item
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
    """(step, path, committed) of every step_<N> folder in `folder`, by step."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
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
    """Delete a checkpoint folder: its COMMIT first, so a half-deleted folder is never taken for complete."""
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
    if not (path / MANIFEST).is_file():
        raise integrity.CheckpointDamaged(path, MANIFEST, "the manifest its save wrote first", "no such file")
    data = (path / MANIFEST).read_bytes()
    integrity.check_bytes(path, MANIFEST, data, record)
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise ConfigError(
            f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON ({e}): the file is damaged"
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ConfigError(
            f"checkpoint {str(path)!r} has format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this embshard reads {FORMAT!r} version {VERSION}"
        )
    return manifest


def read_commit(path: str | os.PathLike) -> dict:
    """The COMMIT marker's record (step, bytes written, seconds; since checksums: every other file's bytes and
    CRC-32 under "files")."""
    try:
        info = json.loads((Path(path) / COMMIT).read_bytes())
        if not isinstance(info, dict):
            raise ValueError("not an object")
        files = info.get("files")
        fields = {"bytes", integrity.ALGORITHM}
        if files is not None and not (
            isinstance(files, dict) and all(isinstance(r, dict) and fields <= set(r) for r in files.values())
        ):
            raise ValueError("a file's record lacks bytes or crc32")
        return info
    except ValueError as e:
        raise integrity.CheckpointDamaged(
            path, COMMIT, "the JSON record its save wrote", f"unreadable JSON ({e})"
        ) from None


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


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for the plain state dict, plus reads into pieces: for each piece, the parts of every
    saved chunk that overlap it (DCP's resharding), copied straight into the piece's tensor. Pieces of the same
    place (the column blocks of one rank all holding a table's per-row state) are read once and copied."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        super().__init__()
        self._pieces: dict[tuple, list[Piece]] = {}
        for p in pieces:
            same = self._pieces.setdefault((p.key, tuple(p.offsets)), [])
            if same and same[0].tensor.shape != p.tensor.shape:
                raise ValueError(f"two pieces of {p.key!r} at {p.offsets} differ in shape")
            same.append(p)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for (key, offsets), (p, *_) in self._pieces.items():
            md = self.metadata.state_dict_metadata.get(key)
            if md is None or not hasattr(md, "chunks"):
                raise ConfigError(f"the checkpoint has no tensor {key!r}: it was saved from another model")
            if tuple(md.size) != tuple(p.size):
                raise ConfigError(
                    f"the checkpoint's {key!r} is {tuple(md.size)} but this model's is {tuple(p.size)}: tables "
                    "keep their shape across a resume"
                )
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=p.tensor.size())
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return dataclasses.replace(plan, items=list(plan.items) + items)

    @staticmethod
    def _region(t: torch.Tensor, read_item: ReadItem) -> torch.Tensor:
        for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, off, n)
        return t

    def _find(self, read_item: ReadItem) -> list[Piece] | None:
        return self._pieces.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ())))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        same = self._find(read_item)
        if same is None:
            return super().resolve_tensor(read_item)
        return self._region(same[0].tensor, read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """As DCP's, but read with torch.load(weights_only=True) (DCP's uses weights_only=False: code could run)."""
        sinfo = self.metadata.storage_data.get(read_item.storage_index)
        where = f"{getattr(sinfo, 'relative_path', '?')} (item {read_item.dest_index.fqn!r})"
        obj = load_item(value, where)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        same = self._find(read_item)
        if same is None:
            super().commit_tensor(read_item, tensor)
            return
        for other in same[1:]:
            self._region(other.tensor, read_item).copy_(tensor)


def writer(path: Path, io_threads: int) -> FileSystemWriter:
    """DCP's file writer, one file per chunk (so the writer holds one chunk at a time), fsynced; the CRC-32 of every
    file it writes is in `writer.fs.sums` afterwards."""
    w = FileSystemWriter(str(path), single_file_per_rank=False, sync_files=True, thread_count=max(1, io_threads))
    w.fs = integrity.ChecksumFileSystem()
    return w


def reader(path: str | os.PathLike, verify: bool = True) -> integrity.VerifyingReader:
    """DCP's file reader of a committed checkpoint folder, checking what it reads against COMMIT's checksums
    (`verify=False`: sizes only, for measuring what the checks cost) and reading the index without running code
    (integrity.py, unpickle.py)."""
    return integrity.VerifyingReader(path, checksums(path) if verify else None)
