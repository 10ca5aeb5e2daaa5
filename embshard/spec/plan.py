"""The sharding plan: where every shard of every table lives. Printable, serializable, checked on load.

The plan is the one contract between whoever places tables (embshard.planner: the simple placement, the search, a
saved file) and the distributed module, which consumes it and nothing else about placement.

Shape rules every placement must follow (checked by `ShardingPlan.check`; the block rules are embshard.spec.geometry's):
- row-wise / table-row-wise: the row blocks, in row order, all have one block size `bs` except the last, which
  may be shorter (ids are routed by `id // bs`); `geometry.row_blocks(rows, n)` gives the canonical split.
- column-wise: any tiling of the columns; FBGEMM's TBE needs every block a multiple of 4 columns wide
  (`geometry.column_blocks`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from embshard.spec.geometry import is_row_split, row_blocks
from embshard.spec.tables import ConfigError, TableConfig, set_enum_field, validate_tables
from embshard.spec.yaml_file import check_keys as _check_keys
from embshard.spec.yaml_file import is_int as _is_int
from embshard.spec.yaml_file import read_yaml_file


class ShardingType(str, enum.Enum):
    """How one table is cut into shards and spread over ranks."""

    TABLE_WISE = "table_wise"  # whole table on one rank
    ROW_WISE = "row_wise"  # contiguous row blocks over all ranks
    COLUMN_WISE = "column_wise"  # column blocks, each a table-wise shard
    TABLE_ROW_WISE = "table_row_wise"  # row blocks over the ranks of one host
    DATA_PARALLEL = "data_parallel"  # a full replica on every rank


class Exchange(str, enum.Enum):
    """How table-row-wise partial sums reach the ranks that own the samples (sharding/table_row_wise.py)."""

    FLAT = "flat"  # one all-to-all over every rank: each row block sends its partial sums to every sample's rank
    HIERARCHICAL = "hierarchical"  # reduce within the host first, then one all-to-all between hosts' peer ranks


GRAPH_SHARDING_TYPES = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL)
"""The sharding types a whole training step captured as one CUDA graph can hold (embshard/training/step_graph.py): their
exchanges are sized from the host's counts (a column-wise table's blocks are routed like table-wise tables: each
block's rank receives every id of its features)."""


class ReplicaSync(str, enum.Enum):
    """How the sharding groups of a 2D plan (`ShardingPlan.sharding_group_size`) keep their replicas together."""

    EXACT = "exact"  # every step: each group's update is the whole world batch's (embshard/twod)
    PERIODIC = "periodic"  # every `replica_sync_every` steps: weights and optimizer state averaged over the groups


class MemoryTier(str, enum.Enum):
    """Where a shard's weights and optimizer state live."""

    HBM = "hbm"  # GPU memory
    UVM = "uvm"  # host memory mapped into the GPU (unified virtual memory)
    UVM_CACHING = "uvm_caching"  # UVM with a cache of hot rows in HBM
    HOST = "host"  # host memory, CPU compute (CPU training)


class CacheAlgorithm(str, enum.Enum):
    """Which rows a UVM-caching table keeps in its HBM cache when a new row must come in."""

    LRU = "lru"  # evict the least recently used row
    LFU = "lfu"  # evict the least frequently used row (a new row enters only if used more often)


class LookupKernel(str, enum.Enum):
    """Which kernel looks up a table's shards on their rank."""

    FBGEMM = "fbgemm"  # FBGEMM's TBE (split TBE; dense TBE for data-parallel tables)
    SMALL = "small"  # embshard's small-table kernel (embshard/kernels/small_tables.py): hbm/host, fp32 tables


@dataclass(frozen=True)
class Shard:
    """One rectangular block of a table, held by one rank."""

    rank: int
    """Rank that holds the block."""
    row_offset: int
    """First row of the block."""
    num_rows: int
    """Rows in the block."""
    col_offset: int
    """First column of the block."""
    num_cols: int
    """Columns in the block."""


@dataclass(frozen=True)
class TablePlan:
    """How one table is sharded."""

    table: str
    """Table name."""
    sharding_type: ShardingType
    """Sharding scheme."""
    tier: MemoryTier
    """Memory tier of every shard of this table."""
    shards: tuple[Shard, ...]
    """The blocks; for data-parallel, one full replica per rank."""
    cache_load_factor: float = 0.2
    """UVM-caching only: fraction of each shard's rows the HBM cache holds (0 < x <= 1)."""
    cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """UVM-caching only: cache replacement policy, lru or lfu."""
    kernel: LookupKernel = LookupKernel.FBGEMM
    """Lookup kernel of the table's shards: fbgemm, or small (small, hot fp32 tables in hbm or host)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_type", ShardingType(self.sharding_type))
        set_enum_field(self, "kernel", LookupKernel, f"plan for table {self.table!r}: ")
        object.__setattr__(self, "tier", MemoryTier(self.tier))
        set_enum_field(self, "cache_algorithm", CacheAlgorithm, f"plan for table {self.table!r}: ")
        clf = self.cache_load_factor
        if isinstance(clf, bool) or not isinstance(clf, int | float) or not 0 < clf <= 1:
            raise ConfigError(
                f"plan for table {self.table!r}: cache_load_factor={clf!r} is invalid: it must be a number in (0, 1], "
                "the fraction of the table's rows the HBM cache holds"
            )
        object.__setattr__(self, "shards", tuple(s if isinstance(s, Shard) else Shard(**s) for s in self.shards))

    @property
    def ranks(self) -> list[int]:
        """Ranks holding a shard, in shard order."""
        return [s.rank for s in self.shards]


@dataclass(frozen=True)
class ShardingPlan:
    """Placement of all tables over `world_size` ranks (`local_world_size` ranks per host)."""

    world_size: int
    """Number of ranks."""
    local_world_size: int
    """Ranks per host."""
    tables: tuple[TablePlan, ...]
    """One entry per table."""
    table_row_wise_exchange: Exchange = Exchange.FLAT
    """Output exchange of the table-row-wise tables: flat (one all-to-all over every rank) or hierarchical (a
    reduce within each host, then one all-to-all between the hosts' peer ranks; the same outputs)."""
    sharding_group_size: int | None = None
    """2D sharding: None (every rank in one sharding group), or G ranks per sharding group: G divides world_size,
    group g is ranks [g*G, (g+1)*G), every group holds the same layout (the shards' `rank`s are ranks within a
    group, 0..G-1) and the groups are data-parallel replicas of each other."""
    replica_sync: ReplicaSync = ReplicaSync.EXACT
    """2D only: how the groups' replicas stay together: exact (every step, the same update as without 2D) or
    periodic (weights and optimizer state averaged over the groups every `replica_sync_every` steps)."""
    replica_sync_every: int = 1
    """2D periodic only: steps between two averagings of the replicas (>= 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "tables", tuple(t if isinstance(t, TablePlan) else TablePlan(**t) for t in self.tables)
        )
        set_enum_field(self, "table_row_wise_exchange", Exchange, "plan: ")
        set_enum_field(self, "replica_sync", ReplicaSync, "plan: ")
        if self.world_size < 1 or self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ConfigError(
                f"plan: world_size={self.world_size} and local_world_size={self.local_world_size} are "
                "invalid: both must be >= 1 and world_size a multiple of local_world_size"
            )
        _check_twod(self.world_size, self.local_world_size, self.sharding_group_size, self.replica_sync_every)

    @property
    def group_size(self) -> int:
        """Ranks per sharding group: `sharding_group_size`, or world_size without 2D."""
        return self.sharding_group_size or self.world_size

    @property
    def shard_world_size(self) -> int:
        """Ranks one layout spans: the sharding group's size under 2D sharding, else world_size (= group_size)."""
        return self.group_size

    @property
    def num_replicas(self) -> int:
        """Sharding groups (replicas of the model-parallel tables): world_size // group_size."""
        return self.world_size // self.group_size

    def group_plan(self) -> ShardingPlan:
        """The layout one sharding group holds, as a plan of its own: world_size = group_size, ranks within the
        group (the plan itself without 2D). A group inside a host keeps the group's ranks as its host; its
        table-row-wise exchange is flat (the same outputs as the hierarchical one)."""
        if self.sharding_group_size is None:
            return self
        G, L = self.sharding_group_size, self.local_world_size
        return ShardingPlan(G, L if G % L == 0 else G, self.tables, Exchange.FLAT)

    def __getitem__(self, table: str) -> TablePlan:
        index = self.__dict__.get("_by_name")
        if index is None:  # built once: plans of thousands of tables are looked up per table
            index = {t.table: t for t in self.tables}
            object.__setattr__(self, "_by_name", index)
        if table in index:
            return index[table]
        raise KeyError(f"plan has no table {table!r}; it has {[t.table for t in self.tables]}")

    def check(self, tables: Sequence[TableConfig]) -> None:
        """Raise ConfigError unless the plan covers exactly these tables, each completely and once."""
        tables = validate_tables(tables)
        planned = {t.table for t in self.tables}
        given = {t.name for t in tables}
        if planned != given:
            raise ConfigError(
                f"plan does not match the tables: missing from plan {sorted(given - planned)}, "
                f"unknown to the model {sorted(planned - given)}; re-plan for this model"
            )
        group = self.group_plan()
        for cfg in tables:
            _check_table(self[cfg.name], cfg, group.world_size, group.local_world_size)
        dp = {t.table: t.kernel.value for t in self.tables if t.sharding_type is ShardingType.DATA_PARALLEL}
        if len(set(dp.values())) > 1:
            raise ConfigError(
                f"plan: the data-parallel tables share one lookup, so one kernel, but they name several: {dp}; give "
                "every data-parallel table the same kernel"
            )

    # ---- serialization -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for JSON/YAML)."""

        def enc(obj: Any) -> Any:
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return [enc(v) for v in obj]
            return obj

        out = enc(asdict(self))
        if self.sharding_group_size is None:  # plans without 2D keep their earlier form
            for key in ("sharding_group_size", "replica_sync", "replica_sync_every"):
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> ShardingPlan:
        """Inverse of to_dict. A mapping of another structure (a missing, unknown or mistyped field, a value out of
        range) is a ConfigError naming `where` (the file) and the field."""
        _check_plan_data(data, where)
        try:
            return cls(
                world_size=data["world_size"],
                local_world_size=data["local_world_size"],
                tables=tuple(
                    TablePlan(**{**t, "shards": tuple(Shard(**s) for s in t["shards"])}) for t in data["tables"]
                ),
                table_row_wise_exchange=data.get("table_row_wise_exchange", Exchange.FLAT.value),
                sharding_group_size=data.get("sharding_group_size"),
                replica_sync=data.get("replica_sync", ReplicaSync.EXACT.value),
                replica_sync_every=data.get("replica_sync_every", 1),
            )
        except ConfigError as e:
            raise ConfigError(f"{where}: not a valid embshard plan: {e}; produce one with `embshard plan`") from None

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    def to_yaml(self) -> str:
        """YAML text."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write as YAML or JSON, by the file's suffix."""
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml())

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        """Read a plan written by save(); a file that cannot be read or parsed, or is no plan, is a ConfigError
        naming the file."""
        return cls.from_dict(read_yaml_file(path, "plan"), where=str(path))

    def __str__(self) -> str:
        kernels = any(t.kernel is not LookupKernel.FBGEMM for t in self.tables)  # the column only when it says more
        rows = [("table", "sharding", "tier", *(("kernel",) * kernels), "ranks", "shards (rows x cols @ offset)")]
        for t in self.tables:
            shards = ", ".join(
                f"r{s.rank}:{s.num_rows}x{s.num_cols}@{s.row_offset},{s.col_offset}" for s in t.shards[:4]
            )
            if len(t.shards) > 4:
                shards += f", ... ({len(t.shards)} shards)"
            kernel = (t.kernel.value,) * kernels
            rows.append((t.table, t.sharding_type.value, t.tier.value, *kernel, ranks_text(t.ranks), shards))
        n = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(n)]
        head = f"ShardingPlan: world_size={self.world_size} local_world_size={self.local_world_size}"
        if any(t.sharding_type is ShardingType.TABLE_ROW_WISE for t in self.tables):
            head += f" table_row_wise_exchange={self.table_row_wise_exchange.value}"
        if self.sharding_group_size is not None:
            every = f" every {self.replica_sync_every} steps" if self.replica_sync is ReplicaSync.PERIODIC else ""
            head += f" sharding_group_size={self.sharding_group_size} ({self.num_replicas} replicas; ranks within a "
            head += f"group) replica_sync={self.replica_sync.value}{every}"
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:n], widths)) + "  " + r[n] for r in rows]
        return "\n".join(lines)


def ranks_text(ranks: Sequence[int]) -> str:
    """'3', '0-7' or '0,2,5'."""
    uniq = sorted(set(ranks))
    if len(uniq) > 2 and uniq == list(range(uniq[0], uniq[-1] + 1)):
        return f"{uniq[0]}-{uniq[-1]}"
    return ",".join(map(str, uniq))


def _check_twod(world: int, local: int, group: Any, every: Any) -> None:
    """Raise ConfigError naming the field, the value and the fix unless the 2D fields fit the world."""
    if group is not None:
        if not _is_int(group) or group < 1 or world % group:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(
                f"plan: sharding_group_size={group!r} is invalid: it must divide world_size={world} (one of "
                f"{divisors}), or be null for no 2D sharding"
            )
        if group % local and local % group:
            raise ConfigError(
                f"plan: sharding_group_size={group} with local_world_size={local} is invalid: a sharding group must "
                f"be whole hosts or lie inside one host: make it a multiple or a divisor of {local}"
            )
    if not _is_int(every) or every < 1:
        raise ConfigError(
            f"plan: replica_sync_every={every!r} is invalid: it must be an integer >= 1 (the steps between two "
            "averagings of a periodic 2D plan's replicas)"
        )


def _check_table(tp: TablePlan, cfg: TableConfig, world_size: int, local_world_size: int) -> None:
    def bad(rule: str) -> ConfigError:
        return ConfigError(f"plan for table {cfg.name!r} ({tp.sharding_type.value}): {rule}")

    if not tp.shards:
        raise bad("it has no shards")
    if tp.kernel is LookupKernel.SMALL and (
        tp.tier not in (MemoryTier.HBM, MemoryTier.HOST) or cfg.data_type.value != "fp32"
    ):
        raise bad(
            f"kernel 'small' takes fp32 tables in tier hbm or host, not {cfg.data_type.value} in {tp.tier.value}: use "
            "kernel 'fbgemm' for this table"
        )
    for s in tp.shards:
        if not 0 <= s.rank < world_size:
            raise bad(f"shard rank {s.rank} is outside 0..{world_size - 1}")
        if s.num_rows < 1 or s.num_cols < 1 or s.row_offset < 0 or s.col_offset < 0:
            raise bad(f"shard {s} has an empty or negative extent")
        if s.row_offset + s.num_rows > cfg.num_embeddings or s.col_offset + s.num_cols > cfg.embedding_dim:
            raise bad(f"shard {s} exceeds the table's {cfg.num_embeddings} rows x {cfg.embedding_dim} columns")
    st = tp.sharding_type
    full = (0, cfg.num_embeddings, 0, cfg.embedding_dim)
    extent = [(s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in tp.shards]
    if st is ShardingType.TABLE_WISE:
        if len(tp.shards) != 1 or extent[0] != full:
            raise bad("table-wise needs exactly one shard covering the whole table")
    elif st is ShardingType.DATA_PARALLEL:
        if sorted(tp.ranks) != list(range(world_size)) or any(e != full for e in extent):
            raise bad(f"data-parallel needs one full replica on each of the {world_size} ranks")
    elif st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        rows = sorted((s.row_offset, s.num_rows) for s in tp.shards)
        if any(s.col_offset != 0 or s.num_cols != cfg.embedding_dim for s in tp.shards):
            raise bad("row-wise shards must span all columns")
        _check_cover(rows, cfg.num_embeddings, "rows", bad)
        sizes = [n for _, n in rows]
        if not is_row_split(sizes):
            raise bad(
                f"row blocks of sizes {sizes} are not uniform: every block but the last must have the first "
                f"block's size ({sizes[0]}) and the last at most that (ids are routed by id // block size); "
                f"split with embshard.spec.geometry.row_blocks, e.g. {row_blocks(cfg.num_embeddings, len(rows))}"
            )
        if len(set(tp.ranks)) != len(tp.ranks):
            raise bad(f"a rank holds two row blocks: {tp.ranks}")
        if st is ShardingType.TABLE_ROW_WISE and len({r // local_world_size for r in tp.ranks}) != 1:
            raise bad(f"table-row-wise shards must sit on the ranks of one host; ranks {tp.ranks} span hosts")
    elif st is ShardingType.COLUMN_WISE:
        if any(s.row_offset != 0 or s.num_rows != cfg.num_embeddings for s in tp.shards):
            raise bad("column-wise shards must span all rows")
        _check_cover(sorted((s.col_offset, s.num_cols) for s in tp.shards), cfg.embedding_dim, "columns", bad)


def _check_cover(spans: list[tuple[int, int]], total: int, what: str, bad: Any) -> None:
    pos = 0
    for off, n in spans:
        if off != pos:
            raise bad(f"{what} blocks {spans} leave a gap or overlap at {pos}; they must tile 0..{total}")
        pos += n
    if pos != total:
        raise bad(f"{what} blocks {spans} cover {pos} of {total} {what}")


_PLAN_KEYS = {"world_size": True, "local_world_size": True, "tables": True, "table_row_wise_exchange": False}
_PLAN_KEYS.update(dict.fromkeys(("sharding_group_size", "replica_sync", "replica_sync_every"), False))  # 2D
_TABLE_KEYS = {
    "table": True,
    "sharding_type": True,
    "tier": True,
    "shards": True,
    "cache_load_factor": False,
    "cache_algorithm": False,
    "kernel": False,
}
_SHARD_KEYS = ("rank", "row_offset", "num_rows", "col_offset", "num_cols")
_PLAN_ENUMS: dict[str, type[enum.Enum]] = {
    "sharding_type": ShardingType,
    "tier": MemoryTier,
    "cache_algorithm": CacheAlgorithm,
    "kernel": LookupKernel,
}


def _check_plan_data(data: Any, where: str) -> None:
    """Raise ConfigError naming `where` and the field unless `data` has the structure of ShardingPlan.to_dict:
    the keys, their types and the ranges of the numbers (the placement rules are `ShardingPlan.check`'s)."""

    def bad(field: str, value: Any, rule: str) -> ConfigError:
        return ConfigError(
            f"{where}: not a valid embshard plan: {field}={value!r} is invalid: {rule}; produce one with `embshard plan`"
        )

    _check_keys(data, _PLAN_KEYS, "the plan", where)
    for key in ("world_size", "local_world_size"):
        if not _is_int(data[key]) or data[key] < 1:
            raise bad(key, data[key], "it must be an integer >= 1")
    world, tables = data["world_size"], data["tables"]
    group = data.get("sharding_group_size")
    if group is not None and (not _is_int(group) or group < 1 or world % group):
        raise bad("sharding_group_size", group, f"it must divide world_size={world}, or be null for no 2D sharding")
    if data.get("replica_sync", "exact") not in [k.value for k in ReplicaSync]:
        raise bad("replica_sync", data["replica_sync"], f"choose one of {[k.value for k in ReplicaSync]}")
    every = data.get("replica_sync_every", 1)
    if not _is_int(every) or every < 1:
        raise bad("replica_sync_every", every, "it must be an integer >= 1")
    ranks = group or world
    if not isinstance(tables, list):
        raise bad("tables", tables, "it must be a list of tables")
    seen: set[str] = set()
    for i, t in enumerate(tables):
        _check_keys(t, _TABLE_KEYS, f"tables[{i}]", where)
        name = t["table"]
        if not isinstance(name, str) or not name:
            raise bad(f"tables[{i}].table", name, "it must be the table's name")
        if name in seen:
            raise bad(f"tables[{i}].table", name, "the table is listed twice")
        seen.add(name)
        for key, kind in _PLAN_ENUMS.items():
            if key in t and t[key] not in [k.value for k in kind]:
                raise bad(f"table {name!r} {key}", t[key], f"choose one of {[k.value for k in kind]}")
        clf = t.get("cache_load_factor", 0.2)
        if isinstance(clf, bool) or not isinstance(clf, int | float) or not 0 < clf <= 1:
            raise bad(f"table {name!r} cache_load_factor", clf, "it must be a number in (0, 1]")
        if not isinstance(t["shards"], list) or not t["shards"]:
            raise bad(f"table {name!r} shards", t["shards"], "it must be a non-empty list of shards")
        for j, s in enumerate(t["shards"]):
            field = f"table {name!r} shards[{j}]"
            _check_keys(s, _SHARD_KEYS, field, where)
            for key in _SHARD_KEYS:
                low = 1 if key.startswith("num_") else 0
                if not _is_int(s[key]) or s[key] < low:
                    raise bad(f"{field}.{key}", s[key], f"it must be an integer >= {low}")
            if s["rank"] >= ranks:
                within = f"ranks within a sharding group are 0..{ranks - 1} (sharding_group_size={group})"
                raise bad(
                    f"{field}.rank", s["rank"], within if group else f"ranks are 0..{world - 1} (world_size={world})"
                )
