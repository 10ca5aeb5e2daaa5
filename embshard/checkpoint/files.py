"""A checkpoint's files on disk, read and written without trusting them (docs/checkpoints.md "Safety").

A checkpoint may come from someone else: every name in it that becomes a path (a table or collection of the
manifest, a chunk file of DCP's index, a file of COMMIT, an exported file) must be a plain file name
(`plain_name`: no `/`, `\\`, NUL or control character, not `.` or `..`); refused otherwise (`UnsafeCheckpoint`).

Reads (`open_regular`, `read_bytes`) open the folder's own regular files only: no symbolic link is followed
(`O_NOFOLLOW`), a FIFO or device is refused before anything is read (`O_NONBLOCK`, then `fstat`), the size is
checked against COMMIT's record (or a cap) before reading, and any OSError is damage naming the file
(`CheckpointDamaged`: `resume_from=latest` then falls back to the previous checkpoint).

Writes (`NewFile`) create a temporary file beside the target (`O_CREAT | O_EXCL | O_NOFOLLOW`, relative to the
folder's descriptor) and rename it over the target when complete: no link already in the folder is followed, and
the path reported is the real one. `escape` makes a name safe to print (no raw terminal escapes).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from types import TracebackType
from typing import BinaryIO

from embshard.spec.names import NAME_BYTES, escape, is_plain_name
from embshard.spec.tables import ConfigError

FIX = (
    "resume from an earlier checkpoint (checkpoint.resume_from=latest skips damaged ones, or name an earlier step_<N> "
    "folder), or restore the file from a copy"
)
UNSAFE_FIX = (
    "this is not what torch.distributed.checkpoint or embshard writes: do not load it; take the checkpoint from a "
    "source you trust, or an earlier checkpoint"
)
MAX_BYTES = {"COMMIT": 256 << 20, "manifest.json": 256 << 20, ".metadata": 1 << 30}
"""Largest COMMIT, manifest and DCP index read (far above what any save writes; a larger one is damage)."""


class CheckpointDamaged(ConfigError):
    """A checkpoint file is not what its save recorded: `file` (name in the folder), `expected` and `found`."""

    def __init__(self, folder: str | os.PathLike, file: str, expected: str, found: str) -> None:
        self.folder, self.file, self.expected, self.found = str(folder), file, expected, found
        super().__init__(
            f"checkpoint {self.folder!r} is damaged: {escape(file)}: expected {escape(expected)}, found "
            f"{escape(found)}. Fix: {FIX}"
        )

    @property
    def brief(self) -> str:
        return escape(f"{self.file}: expected {self.expected}, found {self.found}")


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file asks to run code or to reach outside its folder (a pickle names a global outside the
    allow-list or sets state it may not; a name that is not a plain file name)."""


def plain_name(name: object, what: str, where: str) -> str:
    """`name` if it is a plain file name (`is_plain_name`); UnsafeCheckpoint naming `what` and `where` otherwise."""
    if is_plain_name(name):
        return name  # type: ignore[return-value]
    raise UnsafeCheckpoint(
        f"{where}: refused to read it: {what} {escape(repr(name))} is not a plain file name (no '/', '\\', NUL "
        f"or control characters, not '.' or '..', at most {NAME_BYTES} bytes): as a path it could reach outside "
        f"its folder; {UNSAFE_FIX}"
    )


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def open_regular(
    folder: str | os.PathLike, name: str, expected: str, size: int | None = None, cap: int | None = None
) -> tuple[BinaryIO, int]:
    """The regular file `name` of checkpoint `folder` opened for reading, and its size. CheckpointDamaged (with
    `expected`, what the save wrote) if it is missing, a symbolic link, not a regular file (a FIFO is refused
    without waiting), unreadable, not `size` bytes (when given, e.g. COMMIT's record) or over `cap` bytes."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(folder, name), flags)
    except FileNotFoundError:
        raise CheckpointDamaged(folder, name, expected, "no such file") from None
    except OSError as e:
        link = e.errno == errno.ELOOP
        found = "a symbolic link (only the folder's own regular files are read)" if link else f"unreadable ({e})"
        raise CheckpointDamaged(folder, name, expected, found) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointDamaged(folder, name, expected, f"{_kind(st.st_mode)}, not a regular file")
        if cap is not None and st.st_size > cap:
            raise CheckpointDamaged(folder, name, f"{expected} (at most {cap} bytes)", f"{st.st_size} bytes")
        if size is not None and st.st_size != size:
            how = "truncated" if st.st_size < size else "longer than recorded"
            raise CheckpointDamaged(folder, name, expected, f"{st.st_size} bytes ({how})")
        return os.fdopen(fd, "rb", buffering=0), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_at(file: BinaryIO, offset: int, length: int) -> bytes:
    """`length` bytes of an open file from `offset` (fewer only at its end)."""
    parts, fd = [], file.fileno()
    while length > 0:
        part = os.pread(fd, min(length, 1 << 30), offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return b"".join(parts)


def read_bytes(
    folder: str | os.PathLike, name: str, expected: str, size: int | None = None, cap: int | None = None
) -> bytes:
    """The whole regular file `name` of checkpoint `folder` (`open_regular`'s checks; `cap` defaults to
    MAX_BYTES[name] for COMMIT, the manifest and DCP's index). Any OSError is CheckpointDamaged."""
    cap = MAX_BYTES.get(name) if cap is None else cap
    file, n = open_regular(folder, name, expected, size, cap)
    try:
        with file:
            data = read_at(file, 0, n)
    except OSError as e:
        raise CheckpointDamaged(folder, name, expected, f"unreadable ({e})") from None
    if len(data) != n:
        raise CheckpointDamaged(folder, name, expected, f"{len(data)} of its {n} bytes (shrank while read)")
    return data


class NewFile:
    """A file written whole or not at all into `folder`, following no link there:

        new = NewFile(out, "t.safetensors", "table 't'")
        with new as f:
            f.write(...)
        new.path   # the real path written

    The data go to a new temporary file (`.<name>.<random>.partial`, O_CREAT | O_EXCL | O_NOFOLLOW, relative to
    the folder's descriptor), renamed to `name` when the block ends without error (a link or file already named
    so is replaced, never followed), removed otherwise. `name` must be a plain file name; OSError becomes a
    ConfigError naming the path."""

    def __init__(self, folder: str | os.PathLike, name: str, what: str) -> None:
        plain_name(name, what, f"writing into {str(folder)!r}")
        self.folder = os.path.realpath(folder)
        self.name = name
        self.path = os.path.join(self.folder, name)
        if os.path.dirname(self.path) != self.folder:  # a plain name cannot leave it; checked all the same
            raise ConfigError(f"{what}: {escape(repr(name))} does not resolve inside {self.folder!r}")
        self._dir: int | None = None
        self._tmp: str | None = None
        self._file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        try:
            self._dir = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            self._tmp = f".{self.name}.{secrets.token_hex(4)}.partial"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(self._tmp, flags, 0o644, dir_fd=self._dir)
        except OSError as e:
            self._close()
            raise ConfigError(f"cannot write {self.path!r}: {e}") from None
        self._file = os.fdopen(fd, "wb")
        return self._file

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        try:
            assert self._file is not None
            self._file.close()
            if kind is None:
                os.replace(self._tmp, self.name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                self._tmp = None
        except OSError as e:
            raise ConfigError(f"cannot write {self.path!r}: {e}") from None
        finally:
            self._close()

    def _close(self) -> None:
        if self._tmp is not None and self._dir is not None:
            try:
                os.unlink(self._tmp, dir_fd=self._dir)
            except FileNotFoundError:
                pass
            self._tmp = None
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None
