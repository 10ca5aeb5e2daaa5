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
  What the pickle does with them is restricted too: state is set (BUILD) only on instances of DCP's metadata
  classes, and only their own fields; never on a class (`PosixPath._str` set process-wide would redirect every
  path) nor on other objects; items are added only to lists, dicts and sets. The unpickler is Python's own
  pure-Python one (`pickle._Unpickler`), whose opcodes can be overridden one by one. The index read is then
  checked (`check_index`): every chunk file a plain file name in the folder, offsets and lengths non-negative
  integers, every chunk inside its tensor.
- `load_item` reads a non-tensor item with `torch.load(weights_only=True)` (torch's own allow-list: containers,
  numbers, strings, tensors); anything else is refused the same way.
Tensor items are read with `torch.load(weights_only=True)` too (reading.py).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from embshard.checkpoint.files import UNSAFE_FIX, UnsafeCheckpoint, escape, plain_name
from embshard.spec.tables import ConfigError

__all__ = ["ALLOWED_GLOBALS", "UnsafeCheckpoint", "check_index", "load_item", "load_metadata"]

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

_STATE_CLASSES = (
    dcp_md.Metadata,
    dcp_md.MetadataIndex,
    dcp_md.StorageMeta,
    dcp_md.TensorStorageMetadata,
    dcp_md.BytesStorageMetadata,
    dcp_md.ChunkStorageMetadata,
    dcp_md.TensorProperties,
    _StorageInfo,
)
"""The classes whose instances a `.metadata` pickle may give state (BUILD): only their dataclass fields, or a
tuple for the class's own `__setstate__` (TensorProperties)."""
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _STATE_CLASSES}
_CONTAINERS = {"APPEND": list, "APPENDS": list, "SETITEM": dict, "SETITEMS": dict, "ADDITEMS": set}
"""Opcodes that add items, and the only type each may add them to (the pure-Python unpickler would call the
target's own `extend` / `append` / `__setitem__` / `add` otherwise)."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with an allow-list of globals, no persistent ids, state set only on instances of
    DCP's metadata classes (their fields), and items added only to lists, dicts and sets."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def _refuse(self, what: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"{self.where}: refused to read it: its pickle {what} (DCP's index never does; embshard reads checkpoints "
            f"with allow-lists and never runs code from them); {UNSAFE_FIX}"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise self._refuse(f"names the global {escape(module)}.{escape(name)}, not one of DCP's metadata types")

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"holds a persistent id {escape(repr(pid))[:100]}")

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if isinstance(inst, type) or cls not in _FIELDS:
            what = f"the class {inst.__qualname__}" if isinstance(inst, type) else f"a {cls.__qualname__} object"
            raise self._refuse(f"sets attributes of {what}")
        if "__setstate__" in vars(cls):  # TensorProperties: its own tuple form
            if type(state) is not tuple:
                raise self._refuse(f"gives a {cls.__name__} a {type(state).__name__} as its state")
            inst.__setstate__(state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if type(part) is not dict:
                raise self._refuse(f"gives a {cls.__name__} a {type(part).__name__} as its state")
            extra = [k for k in part if type(k) is not str or k not in _FIELDS[cls]]
            if extra:
                raise self._refuse(f"sets {escape(repr(extra[0]))[:100]} on a {cls.__name__}, not one of its fields")
        if state:
            vars(inst).update(state)
        for k, v in (slots or {}).items():
            object.__setattr__(inst, k, v)

    dispatch[pickle.BUILD[0]] = load_build


def _guarded(opcode: str) -> Any:
    """The unpickler's handler of `opcode` (an opcode that adds items), refusing any target but its container type."""
    kind, load = _CONTAINERS[opcode], pickle._Unpickler.dispatch[getattr(pickle, opcode)[0]]
    marked = opcode in ("APPENDS", "SETITEMS", "ADDITEMS")  # the target sits below the mark
    depth = {"APPEND": 2, "SETITEM": 3}.get(opcode, 1)

    def guarded(self: _MetadataUnpickler) -> None:
        stack = self.metastack[-1] if marked else self.stack
        if len(stack) < depth or type(stack[-depth]) is not kind:
            target = type(stack[-depth]).__name__ if len(stack) >= depth else "nothing"
            raise self._refuse(f"adds items to a {target} ({opcode})")
        load(self)

    return guarded


for _op in _CONTAINERS:
    _MetadataUnpickler.dispatch[getattr(pickle, _op)[0]] = _guarded(_op)


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape or offsets (a tuple of non-negative ints), or None if it is not one."""
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        return None
    return tuple(value)


def check_index(md: Any, where: str) -> None:
    """Raise unless `md` is a well-formed DCP index: every tensor's chunks inside it, every storage entry a plain
    file name of the folder (UnsafeCheckpoint otherwise) with non-negative offset and length."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where} is not a readable DCP index ({escape(what)}): the file is damaged")

    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        raise bad("its tables of tensors and of chunk files are not dicts")
    for key, m in md.state_dict_metadata.items():
        if type(key) is not str:
            raise bad(f"an item named by a {type(key).__name__}")
        if isinstance(m, dcp_md.BytesStorageMetadata):
            continue
        if not isinstance(m, dcp_md.TensorStorageMetadata):
            raise bad(f"{key!r} is a {type(m).__name__}")
        size = _dims(m.size)
        props = m.properties
        if size is None or not isinstance(props, dcp_md.TensorProperties) or not isinstance(props.dtype, torch.dtype):
            raise bad(f"{key!r} has no valid shape and type")
        if type(m.chunks) is not list:
            raise bad(f"{key!r} has no list of chunks")
        for c in m.chunks:
            off = _dims(getattr(c, "offsets", None))
            sizes = _dims(getattr(c, "sizes", None))
            if not isinstance(c, dcp_md.ChunkStorageMetadata) or off is None or sizes is None:
                raise bad(f"{key!r} has a chunk without valid offsets and sizes")
            if len(off) != len(size) or len(sizes) != len(size) or any(o + n > d for o, n, d in zip(off, sizes, size)):
                raise bad(f"{key!r}: its chunk at {list(off)} of {list(sizes)} lies outside its shape {list(size)}")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_md.MetadataIndex) or type(index.fqn) is not str:
            raise bad("a chunk file listed under something else than a tensor's name")
        if index.offset is not None and _dims(index.offset) is None:
            raise bad(f"{index.fqn!r} lists a chunk at offsets {index.offset!r}")
        if not isinstance(info, _StorageInfo):
            raise bad(f"{index.fqn!r}: its chunk's storage is a {type(info).__name__}")
        plain_name(info.relative_path, f"its chunk file of {escape(repr(index.fqn))}", where)
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise bad(f"{index.fqn!r}: its chunk in {info.relative_path} at {info.offset!r}, {info.length!r} bytes")
        if info.transform_descriptors:
            raise ConfigError(
                f"{where}: {index.fqn!r} is stored transformed ({list(info.transform_descriptors)!r}, e.g. "
                "compressed), which embshard does not read: save the checkpoint without storage extensions"
            )


def load_metadata(data: bytes, where: str) -> Any:
    """The `Metadata` pickled in `data` (the bytes of a `.metadata` file), unpickled with the allow-lists and
    checked (`check_index`)."""
    try:
        md = _MetadataUnpickler(data, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a damaged file of a checkpoint saved without checksums
        raise ConfigError(
            f"{where} is not a readable DCP index ({type(e).__name__}: {escape(str(e))[:300]}): the file is damaged"
        ) from None
    if not isinstance(md, dcp_md.Metadata):
        raise UnsafeCheckpoint(f"{where} holds a {type(md).__name__}, not DCP's Metadata; {UNSAFE_FIX}")
    check_index(md, where)
    return md


def load_item(value: io.BytesIO, where: str) -> Any:
    """An item of a checkpoint (torch.save bytes), read with `torch.load(weights_only=True)` onto the CPU."""
    try:
        return torch.load(value, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        lines = [
            ln for ln in str(e).splitlines() if ln.strip() and "PyTorch 2.6" not in ln and "documentation" not in ln
        ]
        what = f"the global {found.group(1).rstrip('.')}" if found else " ".join(lines)[:300]
        raise UnsafeCheckpoint(
            f"{where}: refused to read it: it names {escape(what)}, which torch.load(weights_only=True) does not "
            f"admit (embshard never runs code from a checkpoint); {UNSAFE_FIX}"
        ) from None
