"""The serving artifact's files: written whole or not at all, read back checked, never executed.

    DIR/
      manifest.json             format, version, and every other file's bytes and SHA-256
      model.json                model kind and config, dense width, feature order, tables (rows, dim, type,
                                pooling, file), the bounds policy, the training data config, where it came from
      dense.safetensors         the dense part's state dict (fp32)
      table.<name>.safetensors  one tensor 'rows': fp32 / fp16 `[R, D]`, or int8 / int4 `[R, row_bytes]` uint8 in
                                FBGEMM's fused row-wise layout (quantize.py)

Reading trusts nothing in the folder: manifest.json lists exactly the files above, each a plain file name (no
path can leave the folder); each is read as a regular file of the folder (no link followed, no FIFO waited on) of
the recorded size, its SHA-256 compared before it is parsed; JSON is parsed as JSON, tensors by safetensors (a
header and raw bytes: no code runs, unlike pickle). Any mismatch is `ArtifactDamaged` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from embshard.spec.names import escape, is_plain_name
from embshard.spec.tables import ConfigError

FORMAT = "embshard-serving"
VERSION = 1
MANIFEST = "manifest.json"
MODEL = "model.json"
DENSE = "dense.safetensors"
MAX_JSON_BYTES = 64 << 20
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8"}


def table_file(table: str) -> str:
    return f"table.{table}.safetensors"


class ArtifactDamaged(ConfigError):
    """A file of a serving artifact is missing, altered, or not what export writes."""

    def __init__(self, folder: str | os.PathLike, file: str, problem: str) -> None:
        self.folder, self.file = str(folder), file
        super().__init__(
            f"serving artifact {self.folder!r}: {escape(file)}: {escape(problem)}. Fix: export the artifact again "
            "from its checkpoint (embshard export serving CHECKPOINT --out DIR), or copy it again from its source"
        )


class HashingFile:
    """A binary file being written that keeps the SHA-256 and the count of the bytes written through it."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.sha, self.bytes = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha.update(data)
        self.bytes += len(data)

    def record(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha.hexdigest()}


def safetensors_header(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict[str, str]) -> bytes:
    """The header of a safetensors file holding `tensors` (name -> (dtype, shape)) in that order, data 8-byte
    aligned: the tensors' bytes follow it, written in pieces by the caller."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_tensors(out: Path, name: str, tensors: dict[str, torch.Tensor], what: str) -> dict:
    """Write `tensors` as the safetensors file `out/name` (whole or not at all); its manifest record."""
    from embshard.checkpoint.files import NewFile

    header = safetensors_header({k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, {"format": "pt"})
    with NewFile(out, name, what) as f:
        h = HashingFile(f)
        h.write(header)
        for t in tensors.values():
            h.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.record()


def write_json(out: Path, name: str, data: dict, what: str) -> dict:
    from embshard.checkpoint.files import NewFile

    text = json.dumps(data, indent=1, sort_keys=False).encode()
    with NewFile(out, name, what) as f:
        h = HashingFile(f)
        h.write(text)
    return h.record()


def write_manifest(out: Path, files: dict[str, dict], info: dict) -> None:
    """manifest.json, written last: the format and every other file's record."""
    write_json(out, MANIFEST, {"format": FORMAT, "version": VERSION, **info, "files": files}, "the manifest")


def read_manifest(folder: Path) -> dict:
    """The artifact's manifest: its format and version, and a record (bytes, sha256) for every file, each a plain
    file name; ArtifactDamaged otherwise."""
    if not folder.is_dir():
        raise ConfigError(f"serving artifact {str(folder)!r} is not a folder: give the --out folder of export serving")
    data = _read(folder, MANIFEST, None, MAX_JSON_BYTES)
    try:
        man = json.loads(data)
    except ValueError as e:
        raise ArtifactDamaged(folder, MANIFEST, f"not valid JSON ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        fmt = man.get("format") if isinstance(man, dict) else None
        raise ArtifactDamaged(folder, MANIFEST, f"format {fmt!r}, not {FORMAT!r} version {VERSION}")
    files = man.get("files")
    if not isinstance(files, dict):
        raise ArtifactDamaged(folder, MANIFEST, "no 'files' record")
    for name, rec in files.items():
        if not is_plain_name(name) or name == MANIFEST:
            raise ArtifactDamaged(
                folder, MANIFEST, f"it lists {name!r}, which is not a plain file name of the folder (a path that "
                "could reach outside it is refused)"
            )  # fmt: skip
        ok = isinstance(rec, dict) and type(rec.get("bytes")) is int and rec["bytes"] >= 0
        if not ok or not isinstance(rec.get("sha256"), str) or len(rec["sha256"]) != 64:
            raise ArtifactDamaged(folder, MANIFEST, f"the record of {name!r} lacks its bytes or SHA-256")
    return man


def _read(folder: Path, name: str, rec: dict | None, cap: int | None = None) -> bytes:
    """The regular file `name` of `folder` (no link followed, no FIFO waited on), of the recorded size (or at most
    `cap` bytes), its SHA-256 checked against `rec`."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(folder, name), flags)
    except FileNotFoundError:
        raise ArtifactDamaged(folder, name, "no such file") from None
    except OSError as e:
        raise ArtifactDamaged(folder, name, f"cannot be opened as a regular file of the folder ({e})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactDamaged(folder, name, "not a regular file")
        if rec is not None and st.st_size != rec["bytes"]:
            raise ArtifactDamaged(folder, name, f"{st.st_size} bytes, but the manifest records {rec['bytes']}")
        if cap is not None and st.st_size > cap:
            raise ArtifactDamaged(folder, name, f"{st.st_size} bytes, more than the {cap} such a file may have")
        try:
            data = f.read()
        except OSError as e:
            raise ArtifactDamaged(folder, name, f"unreadable ({e})") from None
    if len(data) != st.st_size:
        raise ArtifactDamaged(folder, name, f"{len(data)} of its {st.st_size} bytes read (it changed while read)")
    if rec is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != rec["sha256"]:
            raise ArtifactDamaged(folder, name, f"SHA-256 {digest}, but the manifest records {rec['sha256']}")
    return data


def read_file(folder: Path, man: dict, name: str) -> bytes:
    """The bytes of the artifact's file `name`, checked against the manifest's record."""
    rec = man["files"].get(name)
    if rec is None:
        raise ArtifactDamaged(folder, MANIFEST, f"it does not list {name!r}, which the artifact needs")
    return _read(folder, name, rec)


def read_json(folder: Path, man: dict, name: str) -> dict:
    try:
        data = json.loads(read_file(folder, man, name))
    except ValueError as e:
        raise ArtifactDamaged(folder, name, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactDamaged(folder, name, "not a JSON object")
    return data


def read_tensors(folder: Path, man: dict, name: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `name` (checked first; parsed by safetensors: no code runs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = read_file(folder, man, name)
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ArtifactDamaged(folder, name, f"not a readable safetensors file ({e})") from None
