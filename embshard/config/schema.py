"""Turn parsed YAML (plain dicts, lists and scalars) into frozen dataclasses, once, with exact error messages.

Every error names the file, the key path (`model.tables[2].embedding_dim`), the value and what is expected:
unknown keys (with a did-you-mean), wrong types, missing required fields and impossible values (the dataclass's
own `__post_init__` checks raise `ConfigError`; the parser adds file and key path).

Supported field types: int, float (ints and numeric strings such as "1e-3" accepted), bool, str, enums, Literal,
`X | None`, `tuple[X, ...]`, `dict[str, X]`, plain `dict`, and nested dataclasses.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from embshard.spec.tables import ConfigError, FieldError

T = TypeVar("T")
MISSING = dataclasses.MISSING


class Source:
    """Where values came from: a file, and which key paths were overridden on the command line."""

    def __init__(self, file: str, overridden: Mapping[str, str] | None = None) -> None:
        self.file = file
        self.overridden = dict(overridden or {})

    def where(self, path: str) -> str:
        for key, text in self.overridden.items():
            if _within(path, key) or _within(key, path):
                return f"{self.file} (with command-line override {text!r})"
        return self.file

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where(path)}: {message}")


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def type_name(tp: Any) -> str:
    """A short human description of what a field expects."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is dict or origin is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if origin is tuple or origin is list:
        return f"a list (each {type_name(args[0])})" if args else "a list"
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + (" (or null)" if len(inner) < len(args) else "")
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return str(tp)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def convert(tp: Any, value: Any, path: str, src: Source) -> Any:
    """Check and convert one value to type `tp`."""

    def wrong() -> ConfigError:
        return src.error(
            path, f"{path}={value!r} has the wrong type: expected {type_name(tp)}, got {type(value).__name__}"
        )

    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return convert(inner[0], value, path, src)
        for a in inner:
            try:
                return convert(a, value, path, src)
            except ConfigError:
                continue
        raise wrong()
    if value is None:
        raise src.error(path, f"{path} is null: expected {type_name(tp)}")
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise wrong() from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise wrong()
        return value
    if origin is Literal:
        if value not in args:
            raise src.error(path, f"{path}={value!r} is invalid: expected {type_name(tp)}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise src.error(path, f"{path}={value!r} is invalid: expected {type_name(tp)}") from None
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise wrong()
        item = args[0] if args else Any
        out = [convert(item, v, join(path, i), src) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise wrong()
        if not args:
            return dict(value)
        for k in value:
            if not isinstance(k, str):
                raise src.error(path, f"{path} has key {k!r}: keys must be strings")
        return {k: convert(args[1], v, join(path, k), src) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise wrong()
        return build(tp, value, path, src)
    raise TypeError(f"config schema: unsupported field type {tp!r} at {path}")


def build(cls: type[T], data: Mapping[str, Any], path: str, src: Source) -> T:
    """Construct dataclass `cls` from mapping `data` (at key path `path`)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise src.error(
                join(path, key),
                f"unknown key {join(path, key)!r} (value {data[key]!r}); "
                f"{cls.__name__} at {path or 'the top level'!r} has keys {sorted(fields)}.{hint}",
            )
    kwargs = {}
    for name, f in fields.items():
        sub = join(path, name)
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                doc = field_docs(cls).get(name, "")
                raise src.error(sub, f"{sub} is missing: it is required ({type_name(hints[name])}: {doc})")
            continue
        kwargs[name] = convert(hints[name], data[name], sub, src)
    try:
        return cls(**kwargs)
    except FieldError as e:
        key = join(path, e.key) if not e.key.startswith("[") else f"{path}{e.key}"
        raise src.error(key, f"{key}={e.value!r} is invalid: {e.rule}") from None
    except ConfigError as e:
        # A check in a reused dataclass (TableConfig, FusedOptimizerConfig): find the field it names.
        named = [m for m in re.findall(r"\b(\w+)=", str(e)) if m in fields]
        key = join(path, named[0]) if named else path
        value = kwargs.get(named[0]) if named else None
        shown = f"{key}={value!r}" if named else key
        raise src.error(key, f"{shown} is invalid: {e}") from None


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field of a dataclass (read from its source)."""
    cached = _DOCS.get(cls)
    if cached is not None:
        return cached
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    _DOCS[cls] = docs
    return docs


_DOCS: dict[type, dict[str, str]] = {}
