"""Plain YAML/JSON files the spec layer reads (plans, topologies): parsed safely, their keys checked, errors naming the
file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embshard.spec.tables import ConfigError


def read_yaml_file(path: str | Path, what: str) -> Any:
    """The content of a YAML (or JSON) file, parsed with yaml.safe_load; a file that cannot be read or parsed (or
    that asks for Python objects) is a ConfigError naming the file and `what` it should hold."""
    import yaml

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the {what} file ({e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not a {what} file of plain YAML or JSON ({' '.join(str(e).split())})") from None


def is_int(value: Any) -> bool:
    """Whether `value` is an int (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_keys(data: Any, spec: Mapping[str, bool] | Sequence[str], field: str, where: str) -> None:
    """ConfigError naming `where` and `field` unless `data` is a mapping with every required key of `spec` (a
    mapping key -> required, or a sequence of required keys) and no other."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}: not a valid embshard plan: {field} must be a mapping, not {type(data).__name__} {data!r}; "
            "produce one with `embshard plan`"
        )
    required = [k for k, need in spec.items() if need] if isinstance(spec, Mapping) else list(spec)
    missing = [k for k in required if k not in data]
    unknown = [k for k in data if k not in spec]
    if missing or unknown:
        raise ConfigError(
            f"{where}: not a valid embshard plan: {field} "
            + (f"lacks {missing}" if missing else f"has unknown keys {unknown}")
            + f" (its keys: {list(spec)}); produce one with `embshard plan`"
        )
