"""Reading a checkpoint never runs code from it.

Two parts of a DCP checkpoint are pickles: the index `.metadata` (FileSystemWriter.finish: `pickle.dump` of a
`Metadata`), which DCP's own FileSystemReader reads with `pickle.load`, and the non-tensor items (`rank/<r>`
records, the dense optimizer's hyper-parameters), written with `torch.save` and read by DCP's DefaultLoadPlanner with
`torch.load(weights_only=False)`. A pickle can name any importable callable (`os.system`) and unpickling calls it.
Here:

- `load_metadata` unpickles `.metadata` with an allow-list: DCP's metadata classes, the torch types they hold
  (torch.Size, dtypes, layouts), and the path classes of `StorageMeta.checkpoint_id`; any other global (or a
  persistent id) is refused with `UnsafeCheckpoint` naming the file and the global, before anything is called.
  Those are all the globals DCP writes into `.metadata` (torch 2.11 and 2.13, checked by tests/checkpoint).
- `load_item` reads a non-tensor item with `torch.load(weights_only=True)` (torch's own allow-list: containers,
  numbers, strings, tensors); anything else is refused the same way.
Tensor items are read by DCP itself with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from embshard.spec.tables import ConfigError

_METADATA = "torch.distributed.checkpoint.metadata"
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout (copyreg)
        *(("pathlib", name) for name in _PATHS),  # StorageMeta.checkpoint_id: the folder a save was given
        *(("pathlib._local", name) for name in _PATHS),  # the same classes under Python 3.13+
    }
)
"""(module, name) of every global a `.metadata` pickle may name, besides torch's dtypes (`torch.float32`, ...)."""

_FIX = (
    "this is not what torch.distributed.checkpoint writes: do not load it; take the checkpoint from a source you "
    "trust, or an earlier checkpoint"
)


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file asks to run code (a pickle names a global outside the allow-list)."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.where}: refused to read it: its pickle names the global {module}.{name}, which is not one of "
            "DCP's metadata types (embshard reads checkpoints with an allow-list and never runs code from them); "
            + _FIX
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.where}: refused to read it: its pickle holds a persistent id {pid!r}; {_FIX}")


def load_metadata(data: bytes, where: str) -> Any:
    """The `Metadata` pickled in `data` (the bytes of a `.metadata` file), unpickled with the allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(data, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a damaged file of a checkpoint saved without checksums
        raise ConfigError(
            f"{where} is not a readable DCP index ({type(e).__name__}: {e}): the file is damaged"
        ) from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpoint(f"{where} holds a {type(md).__name__}, not DCP's Metadata; {_FIX}")
    return md


def load_item(value: io.BytesIO, where: str) -> Any:
    """A non-tensor item of a checkpoint (torch.save bytes), read with `torch.load(weights_only=True)`."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        lines = [
            ln for ln in str(e).splitlines() if ln.strip() and "PyTorch 2.6" not in ln and "documentation" not in ln
        ]
        what = f"the global {found.group(1).rstrip('.')}" if found else " ".join(lines)[:300]
        raise UnsafeCheckpoint(
            f"{where}: refused to read it: it names {what}, which torch.load(weights_only=True) does not admit "
            f"(embshard never runs code from a checkpoint); {_FIX}"
        ) from None
