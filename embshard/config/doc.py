"""Generate docs/config.md from the config dataclasses' field docstrings: `python -m embshard.config.doc [OUT]`
(standard output without OUT; `--check OUT`: exit 1 if OUT is out of date; `--help`: usage).

tests/config/test_config.py checks that docs/config.md equals this output, so the reference cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from embshard.config.schema import field_docs, type_name

INTRO = """\
# Configuration reference

`embshard train CONFIG [key.sub=value ...] [--nproc N]` reads one YAML file (examples in `configs/`), applies
the command-line overrides, and builds frozen dataclasses (`embshard.config.TrainConfig`) once, before any
process starts. Each component gets only its own section: the model builder `model`, the loader `data`, the
planner `planner`, and so on.

- **Overrides**: `key.sub=value`, with list items by index (`model.tables[2].embedding_dim=32`); the value is
  read as a YAML scalar or flow list (`8`, `0.5`, `true`, `null`, `[64, 32]`, `hbm`). A missing mapping on the
  way is created, so `planner.constraints.t_user.ranks=[0]` works without a `constraints` section.
- **Errors** name the file (and the override, if one is involved), the key path, the value and the rule:
  unknown keys (with a did-you-mean), wrong types, missing required keys and impossible values.
- **Numbers**: integer fields take integers only; number fields take integers, decimals and strings such as
  `1e-3` (which YAML 1.1 reads as a string).
- **Paths** are relative to the working directory.
- **Terms** (HBM, UVM, TBE, the sharding types): [architecture.md](architecture.md#terms).

This file is generated from the dataclasses' field docstrings by `python -m embshard.config.doc docs/config.md`
(`make docs`); a test fails if it is out of date. Keys: `a[]` is every item of list `a`; `a.<name>` is every entry
of mapping `a`.
"""


def _dataclass_in(tp: Any) -> tuple[type | None, str]:
    """(the dataclass nested in a field type, the key suffix leading into it)."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return tp, ""
    if origin in (Union, types.UnionType):
        for a in args:
            dc, suffix = _dataclass_in(a)
            if dc is not None:
                return dc, suffix
    if origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1], ".<name>"
    return None, ""


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(value):
        return "(section defaults)"
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key path, expected type, default, description) of every field under dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        yield path, type_name(hints[f.name]), _default(f), docs.get(f.name, "")
        inner, suffix = _dataclass_in(hints[f.name])
        if inner is not None:
            yield from rows(inner, f"{path}{suffix}.")


def generate() -> str:
    from embshard.config import TrainConfig

    out = [INTRO]
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        inner, _ = _dataclass_in(hints[f.name])
        section_doc = " ".join((inner.__doc__ or "").split()) if inner is not None else docs[f.name]
        out.append(f"## `{f.name}`\n\n{section_doc}\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        if inner is None:
            out.append(f"| `{f.name}` | {type_name(hints[f.name])} | {_default(f)} | {docs[f.name]} |")
        else:
            for path, tp, default, doc in rows(inner, f"{f.name}."):
                cells = [tp, default, doc]
                out.append(f"| `{path}` | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command line: write the reference to OUT (default: standard output), or with `--check` compare OUT with it.
    Returns the exit status (1: `--check` found OUT missing or out of date)."""
    parser = argparse.ArgumentParser(
        prog="python -m embshard.config.doc",
        description="Generate the configuration reference (docs/config.md) from the config dataclasses' field "
        "docstrings.",
    )
    parser.add_argument("out", nargs="?", help="file to write (default: standard output), e.g. docs/config.md")
    parser.add_argument(
        "--check", action="store_true", help="write nothing: exit 1 if OUT is missing or differs from the output"
    )
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if args.out is None:
            parser.error("--check needs OUT, the file to compare (e.g. docs/config.md)")
        path = Path(args.out)
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date: run `python -m embshard.config.doc {path}` (make docs)", file=sys.stderr)
            return 1
        return 0
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
