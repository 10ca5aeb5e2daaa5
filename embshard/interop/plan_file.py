"""The TorchRec plan file (embshard.interop.plan_out), checked field by field before TorchRec's plan is built from
it, and an embshard plan checked against the TorchRec model's tables before it is converted.

A file edited by hand, or written for another model, fails here with one error naming the file and the field
(`modules['m']['t'].sharding_type`), or the table, rather than inside TorchRec's DistributedModelParallel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig

FORMAT = "torchrec-sharding-plan"
VERSION = 1
DEVICE_TYPES = ("cuda", "cpu")
KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "dense")
CACHE_ALGORITHMS = ("lru", "lfu")
_TOP = ("format", "version", "world_size", "local_world_size", "device_type", "modules")
_TABLE = ("sharding_type", "compute_kernel", "ranks", "shards", "cache_params")


def check_plan_file(data: Any, where: str) -> None:
    """Raise one ConfigError naming `where` (the file) and the field unless `data` is a TorchRec plan file's
    content as embshard writes it (plan_out's module docstring): every field present, of its type, every enum
    value known, every rank inside the world size."""

    def bad(field: str, problem: str) -> ConfigError:
        return ConfigError(
            f"{where}: not a valid TorchRec plan file: {field}{problem}; fix the file or write a new one with "
            "`embshard plan ... --format torchrec --out FILE`"
        )

    if not isinstance(data, Mapping):
        raise bad("the file", f" holds a {type(data).__name__}, not a JSON object")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ConfigError(
            f"{where}: not a TorchRec plan file of this embshard (format {data.get('format')!r} version "
            f"{data.get('version')!r}, expected {FORMAT!r} {VERSION}): write it with "
            "`embshard plan ... --format torchrec --out FILE`"
        )
    _fields(data, _TOP, ("notes",), "", bad)
    world, local = data["world_size"], data["local_world_size"]
    for key in ("world_size", "local_world_size"):
        if not _is_int(data[key]) or data[key] < 1:
            raise bad(key, f"={data[key]!r} is invalid: it must be an integer >= 1")
    if world % local:
        raise bad("local_world_size", f"={local!r} is invalid: it must divide world_size={world}")
    if data["device_type"] not in DEVICE_TYPES:
        raise bad("device_type", f"={data['device_type']!r} is invalid: choose one of {list(DEVICE_TYPES)}")
    if not isinstance(data.get("notes", []), list):
        raise bad("notes", f"={data['notes']!r} is invalid: it must be a list")
    if not isinstance(data["modules"], Mapping):
        raise bad("modules", f" is a {type(data['modules']).__name__}, not an object of module paths")
    for path, tables in data["modules"].items():
        if not isinstance(tables, Mapping):
            raise bad(f"modules[{path!r}]", f" is a {type(tables).__name__}, not an object of tables")
        for name, t in tables.items():
            _table(t, f"modules[{path!r}][{name!r}]", world, bad)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fields(data: Any, required: tuple[str, ...], optional: tuple[str, ...], at: str, bad: Any) -> None:
    if not isinstance(data, Mapping):
        raise bad(at, f" is a {type(data).__name__}, not an object")
    prefix = f"{at}." if at else ""
    for key in required:
        if key not in data:
            raise bad(prefix + key, " is missing")
    for key in data:
        if key not in required and key not in optional:
            raise bad(prefix + str(key), f" is not a field of the file (known: {sorted(required + optional)})")


def _table(t: Any, at: str, world: int, bad: Any) -> None:
    _fields(t, _TABLE, (), at, bad)
    st, kernel = t["sharding_type"], t["compute_kernel"]
    choices = [s.value for s in ShardingType]
    if st not in choices:
        raise bad(f"{at}.sharding_type", f"={st!r} is invalid: choose one of {choices}")
    if kernel not in KERNELS:
        raise bad(f"{at}.compute_kernel", f"={kernel!r} is invalid: choose one of {list(KERNELS)}")
    dp = st == ShardingType.DATA_PARALLEL.value
    if (kernel == "dense") != dp:
        raise bad(
            f"{at}.compute_kernel", f"={kernel!r} is invalid for sharding_type {st!r}: 'dense' is data_parallel's"
        )

    def rank(v: Any, field: str) -> None:
        if not _is_int(v) or not 0 <= v < world:
            raise bad(field, f"={v!r} is invalid: it must be a rank in 0..{world - 1} (world_size {world})")

    if not isinstance(t["ranks"], list) or not t["ranks"]:
        raise bad(f"{at}.ranks", f"={t['ranks']!r} is invalid: it must be a non-empty list of ranks")
    for i, r in enumerate(t["ranks"]):
        rank(r, f"{at}.ranks[{i}]")
    shards = t["shards"]
    if dp:
        if shards is not None:
            raise bad(f"{at}.shards", " is invalid: a data_parallel table has none (null)")
    elif not isinstance(shards, list) or not shards:
        raise bad(f"{at}.shards", f"={shards!r} is invalid: it must be a non-empty list of shards")
    for i, s in enumerate(shards or []):
        field = f"{at}.shards[{i}]"
        _fields(s, ("rank", "offsets", "sizes"), (), field, bad)
        rank(s["rank"], f"{field}.rank")
        for key in ("offsets", "sizes"):
            v = s[key]
            if not isinstance(v, list) or len(v) != 2 or not all(_is_int(x) and x >= 0 for x in v):
                raise bad(f"{field}.{key}", f"={v!r} is invalid: it must be [rows, columns], two integers >= 0")
    cache = t["cache_params"]
    if cache is not None:
        _fields(cache, ("algorithm", "load_factor"), (), f"{at}.cache_params", bad)
        if cache["algorithm"] not in CACHE_ALGORITHMS:
            raise bad(
                f"{at}.cache_params.algorithm",
                f"={cache['algorithm']!r} is invalid: choose one of {list(CACHE_ALGORITHMS)}",
            )
        lf = cache["load_factor"]
        if isinstance(lf, bool) or not isinstance(lf, int | float) or not 0 < lf <= 1:
            raise bad(f"{at}.cache_params.load_factor", f"={lf!r} is invalid: it must be a number in (0, 1]")


def model_tables(tables: Any) -> list[TableConfig]:
    """embshard TableConfigs of the TorchRec model's tables: a TorchRec EmbeddingBagCollection, a list of its
    EmbeddingBagConfigs, or embshard TableConfigs."""
    from embshard.interop.tables_in import tables_from_torchrec

    if isinstance(tables, list | tuple) and tables and all(isinstance(t, TableConfig) for t in tables):
        return list(tables)
    return tables_from_torchrec(tables)


def check_tables(plan: ShardingPlan, tables: Any) -> None:
    """Raise a ConfigError naming the tables unless `plan` places exactly the TorchRec model's `tables` (names and
    shapes, see model_tables), each completely (ShardingPlan.check)."""
    configs = model_tables(tables)
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in configs}
    planned = {t.table for t in plan.tables}
    missing, extra = sorted(set(shapes) - planned), sorted(planned - set(shapes))
    if missing or extra:
        raise ConfigError(
            f"the plan does not match the TorchRec model's tables: the model's tables {missing} are not in the plan, "
            f"the plan's tables {extra} are not in the model: plan for the model's tables (e.g. "
            "tables_from_torchrec(ebc))"
        )
    for tp in plan.tables:
        rows = max((s.row_offset + s.num_rows for s in tp.shards), default=0)
        cols = max((s.col_offset + s.num_cols for s in tp.shards), default=0)
        if (rows, cols) != shapes[tp.table]:
            r, d = shapes[tp.table]
            raise ConfigError(
                f"table {tp.table!r} is {rows} rows x {cols} columns in the plan but {r} x {d} in the TorchRec "
                "model: plan again for the model's tables"
            )
    plan.check(configs)
