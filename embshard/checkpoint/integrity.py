"""Checksums of a checkpoint's files: computed while they are written, recorded in COMMIT, checked when they are
read (docs/checkpoints.md "Integrity").

Save: DCP's file writer writes through `ChecksumFileSystem`, whose streams compute the CRC-32 (zlib.crc32) of the
bytes as they pass (no second read); every rank's sums are gathered to rank 0, which records them in COMMIT with
manifest.json's and .metadata's:

    "checksum": "crc32", "files": {"__0_0.distcp": {"bytes": 1577, "crc32": "9c81e2d4"}, ...}

Load: DCP reads every saved chunk it needs whole, at the offset and length its index gives (one chunk = one file
here). `VerifyingReader` reads those bytes once, checks their size and CRC-32 against the record and only then
hands them to DCP (torch.load): the bytes DCP reads anyway, no extra pass. A mismatch, a short file, a missing
file raise `CheckpointDamaged` naming the file, what was recorded and what was found. `.metadata` is checked before
it is unpickled (with the allow-list of unpickle.py). `verify_folder` (`embshard checkpoint inspect --verify`)
streams every recorded file instead, in parallel over files. Checkpoints saved before checksums were recorded have
no "files" in COMMIT: they load unverified (the loader says so once); only the structure (every indexed chunk lies
inside its file) is checked.
"""

from __future__ import annotations

import io
import os
import threading
import time
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

from embshard.checkpoint.unpickle import load_metadata
from embshard.spec.tables import ConfigError

ALGORITHM = "crc32"
METADATA = ".metadata"
BLOCK_BYTES = 8 << 20
FIX = (
    "resume from an earlier checkpoint (checkpoint.resume_from=latest skips damaged ones, or name an earlier step_<N> "
    "folder), or restore the file from a copy"
)


def crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


class CheckpointDamaged(ConfigError):
    """A checkpoint file is not what its save recorded: `file` (name in the folder), `expected` and `found`."""

    def __init__(self, folder: str | os.PathLike, file: str, expected: str, found: str) -> None:
        self.folder, self.file, self.expected, self.found = str(folder), file, expected, found
        super().__init__(
            f"checkpoint {self.folder!r} is damaged: {file}: expected {expected}, found {found}. Fix: {FIX}"
        )

    @property
    def brief(self) -> str:
        return f"{self.file}: expected {self.expected}, found {self.found}"


def _expect(rec: dict) -> str:
    return f"{rec['bytes']} bytes with CRC-32 {rec[ALGORITHM]}"


def crc_file(path: str | os.PathLike, block: int = BLOCK_BYTES) -> tuple[int, int]:
    """(bytes, CRC-32) of a file, streamed in blocks."""
    buf = bytearray(block)
    view = memoryview(buf)
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def entry(size: int, crc: int) -> dict:
    """A file's record in COMMIT."""
    return {"bytes": size, ALGORITHM: crc_hex(crc)}


def _found(rec: dict, size: int, crc: int) -> str | None:
    """None if (size, crc) match the file's COMMIT record, else what was found, for the error message."""
    if size == rec["bytes"] and crc_hex(crc) == rec[ALGORITHM]:
        return None
    return f"{size} bytes with CRC-32 {crc_hex(crc)}"


def check_bytes(folder: str | os.PathLike, name: str, data: bytes, record: dict | None) -> None:
    """Raise CheckpointDamaged if `data`, the whole file `name`, differs from its record (None: not checked)."""
    if record is None:
        return
    rec = record.get(name)
    if rec is None:
        raise CheckpointDamaged(folder, name, "an entry in COMMIT's checksums", "none (the file is not recorded)")
    found = _found(rec, len(data), zlib.crc32(data))
    if found:
        raise CheckpointDamaged(folder, name, _expect(rec), found)


# ---- save: sums of what is written ---------------------------------------------------------------------------


class _SummingStream:
    """A file opened for writing that keeps the CRC-32 and count of every byte written through it."""

    def __init__(self, raw: Any, path: str | os.PathLike) -> None:
        self._raw, self._path = raw, path
        self.crc = self.bytes = 0
        self.result: tuple[int, int] | None = None

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._raw.write(view)
        n = len(view) if n is None else n
        self.crc = zlib.crc32(view[:n], self.crc)
        self.bytes += n
        return n

    def finish(self) -> tuple[int, int]:
        """(bytes, CRC-32) of the file; read back if anything but sequential writes through here changed it."""
        if self.result is None:
            self._raw.flush()
            size = os.fstat(self._raw.fileno()).st_size
            self.result = (self.bytes, self.crc) if size == self.bytes else crc_file(self._path)
        return self.result

    def close(self) -> None:
        if not self._raw.closed:
            self.finish()
            self._raw.close()

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, closed, ...
        return getattr(self._raw, name)


class ChecksumFileSystem(FileSystem):
    """DCP's local file system, with the CRC-32 of every file written (`sums`: name -> (bytes, CRC-32))."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _SummingStream(raw, path)
            yield stream
            result = stream.finish()
        with self._lock:
            self.sums[Path(path).name] = result

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as .metadata.tmp, then renames it
        with self._lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


def files_record(sums: list[dict[str, tuple[int, int]]]) -> dict[str, dict]:
    """COMMIT's "files" from every rank's sums."""
    out: dict[str, dict] = {}
    for part in sums:
        for name, (size, crc) in part.items():
            out[name] = entry(size, crc)
    return dict(sorted(out.items()))


# ---- load: checked as read -------------------------------------------------------------------------------------


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every chunk it reads against the checksums of `record` (COMMIT's "files";
    None: a checkpoint saved without them, read unverified but for sizes), and reads `.metadata` without running
    code. Reusable across `dcp.load` calls on the same checkpoint (the index is read once, each chunk checked once)."""

    def __init__(self, path: str | os.PathLike, record: dict | None) -> None:
        super().__init__(str(path))
        self.folder, self.record = str(path), record
        self._metadata: Any = None
        self._checked: set[tuple[str, int]] = set()

    def read_metadata(self) -> Any:
        """DCP's index, `.metadata` (no rank-local ones: a save here always writes the global index)."""
        if self._metadata is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            name = METADATA
            try:
                data = Path(self.folder, name).read_bytes()
            except FileNotFoundError:
                raise CheckpointDamaged(self.folder, name, "DCP's index file", "no such file") from None
            check_bytes(self.folder, name, data, self.record)
            md = load_metadata(data, f"{self.folder}/{name}")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            self._metadata = md
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except FileNotFoundError as e:
            name = Path(str(e.filename)).name if e.filename else str(e)
            rec = (self.record or {}).get(name)
            raise CheckpointDamaged(self.folder, name, _expect(rec) if rec else "the file", "no such file") from None

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        name, offset, length = sinfo.relative_path, int(sinfo.offset), int(sinfo.length)
        file.seek(offset)
        data = file.read(length)
        rec = None if self.record is None else self.record.get(name)
        if len(data) != length:
            size = os.fstat(file.fileno()).st_size
            want = _expect(rec) if rec else f"at least {offset + length} bytes (a chunk at {offset}, {length} bytes)"
            raise CheckpointDamaged(self.folder, name, want, f"{size} bytes (truncated)")
        if self.record is not None and (name, offset) not in self._checked:
            if rec is None:
                raise CheckpointDamaged(self.folder, name, "an entry in COMMIT's checksums", "none")
            if offset == 0 and length == rec["bytes"]:  # the chunk is the whole file (embshard's writer)
                found = _found(rec, os.fstat(file.fileno()).st_size, zlib.crc32(data))
                if found:
                    raise CheckpointDamaged(self.folder, name, _expect(rec), found)
            else:  # several chunks in one file: the whole file, once
                found = _found(rec, *crc_file(Path(self.folder, name)))
                if found:
                    raise CheckpointDamaged(self.folder, name, _expect(rec), found)
                self._checked.update((name, o) for o in self._offsets(name))
            self._checked.add((name, offset))
        return io.BytesIO(data)

    def _offsets(self, name: str) -> list[int]:
        return [int(s.offset) for s in self.storage_data.values() if s.relative_path == name]


# ---- a whole pass ----------------------------------------------------------------------------------------------


@dataclass
class Verified:
    """What `verify_folder` checked and found."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    """One line per damaged file: name, expected, found."""
    checksums: bool = True
    """Whether the checkpoint records checksums (saved by an embshard that writes them)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


def verify_folder(path: str | os.PathLike, record: dict | None, threads: int = 8) -> Verified:
    """Read every recorded file of a checkpoint folder (in parallel over files) and compare its size and CRC-32
    with `record`; then check that every chunk of DCP's index lies inside its file. Nothing is raised for damage:
    the problems are listed."""
    folder = Path(path)
    out = Verified(checksums=record is not None)
    t0 = time.perf_counter()

    def one(item: tuple[str, dict]) -> tuple[str, int, str | None]:
        name, rec = item
        try:
            size, crc = crc_file(folder / name)
        except FileNotFoundError:
            return name, 0, f"{name}: expected {_expect(rec)}, found no such file"
        found = _found(rec, size, crc)
        return name, size, f"{name}: expected {_expect(rec)}, found {found}" if found else None

    if record is not None:
        items = sorted(record.items(), key=lambda kv: -kv[1]["bytes"])  # the largest first: the pool ends together
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for _, size, problem in pool.map(one, items):
                out.files += 1
                out.bytes += size
                if problem:
                    out.problems.append(problem)
    if not any(p.startswith(f"{METADATA}:") for p in out.problems):
        try:
            md = VerifyingReader(folder, None).read_metadata()
        except ConfigError as e:
            out.problems.append(f"{METADATA}: {str(e).removeprefix(f'{folder}/{METADATA}: ')}")
        else:
            sizes: dict[str, int] = {}
            for sinfo in md.storage_data.values():
                name = sinfo.relative_path
                if name not in sizes:
                    sizes[name] = (folder / name).stat().st_size if (folder / name).is_file() else -1
                end = int(sinfo.offset) + int(sinfo.length)
                if sizes[name] < end and not any(p.startswith(f"{name}:") for p in out.problems):
                    found = "no such file" if sizes[name] < 0 else f"{sizes[name]} bytes (truncated)"
                    out.problems.append(f"{name}: expected at least {end} bytes (DCP's index), found {found}")
    out.seconds = time.perf_counter() - t0
    return out
