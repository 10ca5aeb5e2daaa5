"""Per-table planner constraints and hints: allowed sharding types and tiers, pinned ranks, co-location, and the
hints the cost model uses (cache size, access skew). Empty tuples and None mean "no constraint"."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from embshard.spec.plan import LookupKernel, MemoryTier, ShardingType
from embshard.spec.tables import ConfigError, TableConfig, check_known_keys


@dataclass(frozen=True)
class ParameterConstraints:
    """What the planner may do with one table, and hints about how the table is used."""

    sharding_types: tuple[ShardingType, ...] = ()
    """Allowed sharding types (table_wise, row_wise, column_wise, table_row_wise, data_parallel); empty: any."""
    tiers: tuple[MemoryTier, ...] = ()
    """Allowed memory tiers (hbm, uvm_caching, uvm on GPUs; host on CPUs); empty: any."""
    ranks: tuple[int, ...] = ()
    """Ranks the table's shards may use (table-wise, column-wise, table-row-wise); empty: any."""
    colocate_with: str | None = None
    """Name of another table whose rank this table must share; both are then table-wise."""
    column_shards: tuple[int, ...] = ()
    """Allowed numbers of column blocks for column-wise (counts); empty: 2, 4, 8, ... up to world size."""
    cache_load_factor: float | None = None
    """UVM-caching: HBM cache size as a fraction of the shard's rows (0-1]; unset: the planner's default."""
    zipf_alpha: float | None = None
    """Access skew hint: ids follow Zipf(alpha) by row popularity (0 = uniform, ~1 = typical click logs)."""
    kernels: tuple[LookupKernel, ...] = ()
    """Allowed lookup kernels (fbgemm, small); empty: any, the planner gives small where it predicts a win."""

    def __post_init__(self) -> None:
        def bad(fld: str, value: object, rule: str) -> ConfigError:
            return ConfigError(f"constraints: {fld}={value!r} is invalid: {rule}")

        for fld, enum_cls in (("sharding_types", ShardingType), ("tiers", MemoryTier), ("kernels", LookupKernel)):
            raw = getattr(self, fld)
            if isinstance(raw, str):
                raw = (raw,)
            try:
                object.__setattr__(self, fld, tuple(enum_cls(v) for v in raw))
            except ValueError:
                raise bad(fld, raw, f"choose from {[e.value for e in enum_cls]}") from None
        for fld in ("ranks", "column_shards"):
            raw = getattr(self, fld)
            if isinstance(raw, int):
                raw = (raw,)
            values = tuple(raw)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < (0 if fld == "ranks" else 1) for v in values):
                raise bad(fld, list(values), "give a list of integers (ranks >= 0, column shard counts >= 1)")
            object.__setattr__(self, fld, tuple(sorted(set(values))))
        if self.cache_load_factor is not None and not 0 < self.cache_load_factor <= 1:
            raise bad("cache_load_factor", self.cache_load_factor, "it must be in (0, 1]")
        if self.zipf_alpha is not None and not 0 <= self.zipf_alpha <= 5:
            raise bad("zipf_alpha", self.zipf_alpha, "it must be in [0, 5] (0 = uniform access)")
        if self.colocate_with is not None and self.sharding_types and self.sharding_types != (ShardingType.TABLE_WISE,):
            raise bad("sharding_types", [s.value for s in self.sharding_types], "co-located tables are table-wise")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "constraints") -> ParameterConstraints:
        """From plain data (parsed YAML); unknown keys are an error naming `where` and the key."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of constraint fields, got {data!r}")
        check_known_keys(cls, data, where)
        try:
            return cls(**dict(data))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (only the fields that are set)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v in ((), None):
                continue
            out[f.name] = [getattr(x, "value", x) for x in v] if isinstance(v, tuple) else v
        return out


def resolve_constraints(
    tables: Sequence[TableConfig],
    constraints: Mapping[str, ParameterConstraints | Mapping[str, Any]] | None,
    world_size: int,
) -> dict[str, ParameterConstraints]:
    """One ParameterConstraints per table. Keys are table names or glob patterns (``small_*``); an exact name wins
    over patterns, and a table matched by two patterns is an error. Unknown names and bad ranks are errors."""
    names = [t.name for t in tables]
    parsed = {
        key: c if isinstance(c, ParameterConstraints) else ParameterConstraints.from_dict(c, f"constraints[{key!r}]")
        for key, c in (constraints or {}).items()
    }
    out: dict[str, ParameterConstraints] = {}
    known = set(names)
    for key, c in parsed.items():
        is_pattern = any(ch in key for ch in "*?[")
        if not is_pattern and key not in known:
            raise ConfigError(f"constraints name table {key!r}, which does not exist; tables: {names[:20]}")
        if is_pattern and not fnmatch.filter(names, key):
            raise ConfigError(f"constraints pattern {key!r} matches no table; tables: {names[:20]}")
        bad_ranks = [r for r in c.ranks if r >= world_size]
        if bad_ranks:
            raise ConfigError(
                f"constraints[{key!r}]: ranks {bad_ranks} do not exist with world_size={world_size}: use 0..{world_size - 1}"
            )
        cap = max(c.column_shards, default=1)
        if cap > world_size:
            raise ConfigError(
                f"constraints[{key!r}]: column_shards {list(c.column_shards)} exceed world_size={world_size}: each "
                "column block needs its own rank"
            )
    patterns = [k for k in parsed if any(ch in k for ch in "*?[")]
    unconstrained = ParameterConstraints()  # frozen: one instance serves every table without constraints
    for name in names:
        if name in parsed:
            out[name] = parsed[name]
            continue
        hits = [k for k in patterns if fnmatch.fnmatchcase(name, k)]
        if len(hits) > 1:
            raise ConfigError(
                f"table {name!r} matches constraint patterns {hits}: make them disjoint or add an entry for {name!r}"
            )
        out[name] = parsed[hits[0]] if hits else unconstrained
    for name, c in out.items():
        target = c.colocate_with
        if target is None:
            continue
        if target not in out:
            raise ConfigError(f"table {name!r}: colocate_with={target!r} names no table")
        if target == name:
            raise ConfigError(f"table {name!r}: colocate_with names the table itself")
    return out


def colocation_groups(names: Sequence[str], constraints: Mapping[str, ParameterConstraints]) -> list[list[str]]:
    """Tables that must share a rank, as groups (union of colocate_with links), in table order; singletons too."""
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in names:
        target = constraints[n].colocate_with
        if target is not None:
            a, b = find(n), find(target)
            if a != b:
                parent[max(a, b, key=names.index)] = min(a, b, key=names.index)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())
