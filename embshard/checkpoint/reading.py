"""Reading pieces of a checkpoint (or of any DCP checkpoint folder: a TorchRec one) in one process, checked.

`read_pieces(path, pieces, plain)` reads the pieces (layout.py: blocks of logical tensors, into their tensors) and
the plain state dict with DCP's resharding reads: `PieceLoadPlanner` plans, for each piece, the parts of every saved
chunk that overlap it; `VerifyingReader` reads them. What a checkpoint holds is not trusted (files.py,
unpickle.py, integrity.py):

- the index is read by `integrity.read_index` (bounded, checksummed, unpickled with allow-lists, checked);
- every chunk file is a regular file of the folder (a link, FIFO or device is refused before reading), of the size
  COMMIT recorded (checked before reading), every chunk inside it; each chunk's bytes are checked against the
  CRC-32 before `torch.load(weights_only=True)` reads them, and the tensor read must have the shape and type the
  index declares;
- the chunks must cover every piece (and every tensor of the plain state dict) whole, without overlaps: an index
  that covers 999 of 1000 rows is an error naming the tensor, never a piece left partly unread;
- any OSError while reading is `CheckpointDamaged` naming the file.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from embshard.checkpoint import integrity
from embshard.checkpoint.files import CheckpointDamaged, escape, open_regular, read_at
from embshard.checkpoint.integrity import METADATA, expect, mismatch
from embshard.checkpoint.pieces import Piece
from embshard.checkpoint.storage import checksums
from embshard.checkpoint.unpickle import load_item
from embshard.spec.tables import ConfigError


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every chunk it reads against the checksums of `record` (COMMIT's "files";
    None: a checkpoint saved without them, or TorchRec's, read unverified but for sizes, shapes and types), reads
    only regular files of the folder, and reads `.metadata` without running code. Reusable across `dcp.load` calls
    on the same checkpoint (the index is read once, each chunk checked once)."""

    def __init__(self, path: str | os.PathLike, record: dict | None) -> None:
        super().__init__(str(path))
        self.folder, self.record = str(path), record
        self._metadata: Any = None
        self._chunks: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        self._checked: set[tuple[str, int]] = set()

    def read_metadata(self) -> Any:
        """DCP's index, `.metadata` (no rank-local ones: a save here always writes the global index)."""
        if self._metadata is None:
            md = integrity.read_index(self.folder, self.record)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            for key, m in md.state_dict_metadata.items():
                for c in getattr(m, "chunks", ()):
                    self._chunks[(key, tuple(c.offsets))] = (tuple(c.sizes), m.properties.dtype)
            self._metadata = md
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        """Read the plan's items file by file (each file opened once, its chunks in order), checked."""
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for item in plan.items:
            sinfo = self.storage_data.get(item.storage_index)
            if sinfo is None:
                where = f"{item.storage_index.fqn!r} at {list(item.storage_index.offset or ())}"
                raise CheckpointDamaged(self.folder, METADATA, "a file for every chunk it lists", f"none for {where}")
            per_file.setdefault(sinfo.relative_path, []).append((item, sinfo))
        for name, reqs in per_file.items():
            rec = self._record(name)
            file, size = open_regular(self.folder, name, expect(rec) if rec else "a chunk file of DCP's index",
                                      rec["bytes"] if rec else None)  # fmt: skip
            with file:
                for item, sinfo in sorted(reqs, key=lambda r: r[1].offset):
                    try:
                        data = self._chunk(file, size, name, sinfo, rec)
                    except OSError as e:
                        raise CheckpointDamaged(self.folder, name, "a readable file", f"unreadable ({e})") from None
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(data))
                    else:
                        self._load_tensor(item, data, name, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _record(self, name: str) -> dict | None:
        if self.record is None:
            return None
        rec = self.record.get(name)
        if rec is None:
            raise CheckpointDamaged(self.folder, name, "an entry in COMMIT's checksums", "none")
        return rec

    def _chunk(self, file: Any, size: int, name: str, sinfo: Any, rec: dict | None) -> bytes:
        """The bytes of one chunk, checked against the file's record (once per file) before they are used."""
        offset, length = sinfo.offset, sinfo.length
        if offset + length > size:
            want = expect(rec) if rec else f"at least {offset + length} bytes (a chunk at {offset}, {length} bytes)"
            raise CheckpointDamaged(self.folder, name, want, f"{size} bytes (truncated)")
        data = read_at(file, offset, length)
        if len(data) != length:
            raise CheckpointDamaged(
                self.folder, name, f"{offset + length} bytes", f"{offset + len(data)} bytes (truncated)"
            )
        if rec is not None and (name, offset) not in self._checked:
            if offset == 0 and length == rec["bytes"]:  # the chunk is the whole file (embshard's writer)
                found = mismatch(rec, size, zlib.crc32(data))
            else:  # several chunks in one file: the whole file, once
                found = mismatch(rec, *integrity.crc_stream(file))
                self._checked.update((s.relative_path, s.offset) for s in self.storage_data.values()
                                     if s.relative_path == name)  # fmt: skip
            if found:
                raise CheckpointDamaged(self.folder, name, expect(rec), found)
            self._checked.add((name, offset))
        return data

    def _load_tensor(self, item: ReadItem, data: bytes, name: str, planner: Any) -> None:
        """torch.load the chunk (weights only), check it is the tensor the index declares, copy its overlap."""
        where = f"{name} (item {escape(repr(item.storage_index.fqn))})"
        try:
            tensor = load_item(io.BytesIO(data), where)
        except ConfigError:
            raise
        except Exception as e:
            raise CheckpointDamaged(self.folder, name, "a tensor saved by torch.save", f"unreadable ({e})") from None
        key = (item.storage_index.fqn, tuple(item.storage_index.offset or ()))
        sizes, dtype = self._chunks.get(key, (None, None))
        if type(tensor) is not torch.Tensor or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
            found = f"{type(tensor).__name__} {list(getattr(tensor, 'shape', []))} {getattr(tensor, 'dtype', '')}"
            want = f"a {dtype} tensor {list(sizes or [])} (DCP's index: {escape(repr(key[0]))} at {list(key[1])})"
            raise CheckpointDamaged(self.folder, name, want, found)
        for dim, (off, n) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, off, n)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointDamaged(self.folder, name, f"{list(target.size())} values", f"{list(tensor.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for the plain state dict, plus reads into pieces: for each piece, the parts of every
    saved chunk that overlap it (DCP's resharding), copied straight into the piece's tensor. Pieces of the same
    place (the column blocks of one rank all holding a table's per-row state) are read once and copied. Every
    tensor read must be covered whole by the saved chunks (`_check_covered`)."""

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
        plan = dataclasses.replace(plan, items=list(plan.items) + items)
        self._check_covered(plan.items)
        return plan

    def _check_covered(self, items: Sequence[ReadItem]) -> None:
        """Raise unless the reads of every tensor (piece or plain) cover it whole, each element once."""
        reads: dict[tuple, list[ReadItem]] = {}
        for item in items:
            if item.type == LoadItemType.TENSOR:
                reads.setdefault((item.dest_index.fqn, tuple(item.dest_index.offset or ())), []).append(item)
        targets = {k: same[0].tensor.shape for k, same in self._pieces.items()}
        for fqn, value in self.state_dict.items():
            if type(value) in (torch.Tensor, torch.nn.Parameter):  # a plain tensor: read at offsets 0
                targets.setdefault((fqn, (0,) * value.dim()), value.shape)
        for (fqn, offsets), shape in targets.items():
            mine = reads.get((fqn, offsets), [])
            covered = torch.zeros(shape, dtype=torch.bool)
            total = covered.numel()
            for item in mine:
                region = covered
                for dim, (off, n) in enumerate(zip(item.dest_offsets, item.lengths)):
                    region = region.narrow(dim, off, n)
                if region.any():
                    raise ConfigError(f"the checkpoint's index lists overlapping chunks of {fqn!r}: it is damaged")
                region.fill_(True)
            got = int(covered.sum())
            if got != total:
                raise ConfigError(
                    f"the checkpoint's chunks of {fqn!r} cover {got} of the {total} values read at {list(offsets)} "
                    f"(shape {list(shape)}): its index is damaged or it was saved from another model; load another "
                    "checkpoint"
                )

    def _find(self, read_item: ReadItem) -> list[Piece] | None:
        return self._pieces.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ())))

    @staticmethod
    def _region(t: torch.Tensor, read_item: ReadItem) -> torch.Tensor:
        for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, off, n)
        return t

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


def reader(path: str | os.PathLike, verify: bool = True) -> VerifyingReader:
    """DCP's file reader of a committed checkpoint folder, checking what it reads against COMMIT's checksums
    (`verify=False`: sizes only, for measuring what the checks cost) and reading the index without running code."""
    return VerifyingReader(path, checksums(path) if verify else None)


def read_pieces(
    path: str | os.PathLike, pieces: list[Piece], plain: dict | None = None, source: VerifyingReader | None = None
) -> dict:
    """Read `pieces` (into their tensors) and the plain state dict `plain` (returned, loaded) from a checkpoint,
    in this process alone, every chunk checked against the checksums the save recorded (CheckpointDamaged).
    `source`: a reader of `path` to reuse (its index is read, and each chunk checked, once)."""
    plain = {} if plain is None else plain
    source = source or reader(path)
    source.read_metadata()  # its errors as raised (DCP would wrap them, or try a rank-local index instead)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(plain, storage_reader=source, planner=PieceLoadPlanner(pieces), no_dist=True)
        except CheckpointException as e:  # DCP wraps what its steps raise: our errors are the message
            for error, _trace in e.failures.values():
                if isinstance(error, ConfigError):
                    raise error from None
            raise
    return plain
