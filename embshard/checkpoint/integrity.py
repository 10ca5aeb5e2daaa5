"""Checksums of a checkpoint's files: computed while they are written, recorded in COMMIT, checked when they are
read (docs/checkpoints.md "Integrity").

Save: DCP's file writer writes through `ChecksumFileSystem`, whose streams compute the CRC-32 (zlib.crc32) of the
bytes as they pass (no second read); every rank's sums are gathered to rank 0, which records them in COMMIT with
manifest.json's and .metadata's:

    "checksum": "crc32", "files": {"__0_0.distcp": {"bytes": 1577, "crc32": "9c81e2d4"}, ...}

Load: DCP reads every saved chunk it needs whole, at the offset and length its index gives (one chunk = one file
here). `reading.VerifyingReader` reads those bytes once, checks their size and CRC-32 against the record and only then
hands them to DCP (torch.load): the bytes DCP reads anyway, no extra pass. A mismatch, a short file, a missing
file raise `CheckpointDamaged` naming the file, what was recorded and what was found. `.metadata` is checked before
it is unpickled (`read_index`, with the allow-lists of unpickle.py). Files are opened as files.py says (regular
files of the folder only, sizes checked before reading). `verify_folder` (`embshard checkpoint inspect --verify`)
streams every recorded file instead, in parallel over files. Checkpoints saved before checksums were recorded have
no "files" in COMMIT: they load unverified (the loader says so once); only the structure (every indexed chunk lies
inside its file) is checked.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystem

from embshard.checkpoint.files import FIX, CheckpointDamaged, escape, open_regular, read_at, read_bytes
from embshard.checkpoint.unpickle import load_metadata
from embshard.spec.tables import ConfigError

__all__ = [
    "FIX",
    "CheckpointDamaged",
    "check_bytes",
    "crc_file",
    "entry",
    "read_index",
    "regular_size",
    "verify_folder",
]

ALGORITHM = "crc32"
METADATA = ".metadata"
BLOCK_BYTES = 8 << 20


def crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def expect(rec: dict) -> str:
    return f"{rec['bytes']} bytes with CRC-32 {rec[ALGORITHM]}"


def crc_stream(file: BinaryIO, block: int = BLOCK_BYTES) -> tuple[int, int]:
    """(bytes, CRC-32) of an open file from its start, streamed in blocks."""
    crc = size = 0
    while part := read_at(file, size, block):
        crc = zlib.crc32(part, crc)
        size += len(part)
    return size, crc


def crc_file(path: str | os.PathLike, block: int = BLOCK_BYTES) -> tuple[int, int]:
    """(bytes, CRC-32) of a regular file (no link followed: files.open_regular), streamed in blocks."""
    folder, name = os.path.split(path)
    file, _ = open_regular(folder, name, "a regular file")
    with file:
        return crc_stream(file, block)


def entry(size: int, crc: int) -> dict:
    """A file's record in COMMIT."""
    return {"bytes": size, ALGORITHM: crc_hex(crc)}


def mismatch(rec: dict, size: int, crc: int) -> str | None:
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
    found = mismatch(rec, len(data), zlib.crc32(data))
    if found:
        raise CheckpointDamaged(folder, name, expect(rec), found)


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


# ---- load: the index -------------------------------------------------------------------------------------------


def read_index(folder: str | os.PathLike, record: dict | None) -> Any:
    """DCP's index `.metadata` of checkpoint `folder`: read as a regular file of at most files.MAX_BYTES, checked
    against its `record` (COMMIT's "files"; None: unchecked) before it is unpickled with the allow-lists and its
    structure checked (unpickle.py)."""
    rec = None if record is None else record.get(METADATA)
    if record is not None and rec is None:
        raise CheckpointDamaged(folder, METADATA, "an entry in COMMIT's checksums", "none (the file is not recorded)")
    data = read_bytes(folder, METADATA, expect(rec) if rec else "DCP's index file", rec["bytes"] if rec else None)
    check_bytes(folder, METADATA, data, record)
    return load_metadata(data, f"{folder}/{METADATA}")


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
            file, _ = open_regular(folder, name, expect(rec))
            with file:
                size, crc = crc_stream(file)
        except CheckpointDamaged as e:
            return name, 0, e.brief
        except OSError as e:
            return name, 0, escape(f"{name}: expected {expect(rec)}, found unreadable ({e})")
        found = mismatch(rec, size, crc)
        return name, size, f"{name}: expected {expect(rec)}, found {found}" if found else None

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
            md = read_index(folder, None)
        except ConfigError as e:
            out.problems.append(f"{METADATA}: {str(e).removeprefix(f'{folder}/{METADATA}: ')}")
        else:
            sizes: dict[str, int] = {}
            for sinfo in md.storage_data.values():
                name = sinfo.relative_path
                if name not in sizes:
                    sizes[name] = regular_size(folder / name)
                end = int(sinfo.offset) + int(sinfo.length)
                if sizes[name] < end and not any(p.startswith(f"{name}:") for p in out.problems):
                    found = _MISSING.get(sizes[name], f"{sizes[name]} bytes (truncated)")
                    out.problems.append(f"{name}: expected at least {end} bytes (DCP's index), found {found}")
    out.seconds = time.perf_counter() - t0
    return out


_MISSING = {-1: "no such file", -2: "a symbolic link or not a regular file"}


def regular_size(path: Path) -> int:
    """The size of a regular file (not following a link); -1: none there, -2: something else than a file."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -2
