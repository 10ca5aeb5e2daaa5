"""Embedding-bag table configuration: what a table is, independent of how it is sharded."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any


class Pooling(str, enum.Enum):
    """How the rows looked up by one bag are combined into one vector."""

    SUM = "sum"
    MEAN = "mean"  # (weighted) sum divided by the number of ids in the bag; an empty bag gives zeros
    NONE = "none"  # a sequence table: one row per id, in the ids' order (ShardedEmbeddingCollection); never weighted


class DataType(str, enum.Enum):
    """Storage type of the embedding weights."""

    FP32 = "fp32"
    FP16 = "fp16"

    @property
    def bytes(self) -> int:
        """Bytes per element."""
        return 4 if self is DataType.FP32 else 2


class IdKind(str, enum.Enum):
    """What a table's ids are."""

    INDEX = "index"  # row numbers 0 .. num_embeddings-1 (hashed or looked up in a vocabulary before training)
    RAW = "raw"  # any 64-bit ids, mapped to rows on the device by the table's id -> row map (embshard/rawids)


class Eviction(str, enum.Enum):
    """Which resident id of a full raw-id table gives up its row to a new id."""

    LRU = "lru"  # the least recently used
    LFU = "lfu"  # the least frequently used (ties: the least recently used)


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the item, the value and a fix."""


class AllRanksError(ConfigError):
    """A ConfigError that every rank raises together (one rank's, received in a collective): a launcher prints it
    once (rank 0) and the ranks stop together."""


class FieldError(ConfigError):
    """An impossible value found by a config dataclass's own checks; `key` is the path relative to that dataclass
    (the YAML reader, embshard.config.schema, prefixes the file and the path to the dataclass)."""

    def __init__(self, key: str, value: Any, rule: str) -> None:
        super().__init__(f"{key}={value!r} is invalid: {rule}")
        self.key, self.value, self.rule = key, value, rule


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_NAME_RULE = (
    "a table or feature name is a plain name of letters, digits, '_', '-' and '.' (not '.' or '..'; no '/', '\\', "
    "spaces or control characters): it names files (checkpoint export); rename it"
)


@dataclass(frozen=True)
class TableConfig:
    """One embedding-bag table and the features that look it up."""

    name: str
    """Unique table name."""
    num_embeddings: int
    """Number of rows (ids 0 .. num_embeddings-1; for ids: raw the capacity: rows that each hold one raw id)."""
    embedding_dim: int
    """Width of each row, in elements."""
    feature_names: tuple[str, ...]
    """Features that look this table up; several features may share one table."""
    pooling: Pooling = Pooling.SUM
    """How a bag's rows are combined: sum or mean."""
    weighted: bool = False
    """Whether the features carry one float weight per id (per-sample weights)."""
    data_type: DataType = DataType.FP32
    """Storage type of the weights."""
    ids_per_bag: float = 1.0
    """Planner hint: expected number of ids per bag (pooling factor), averaged over the batch."""
    init_std: float | None = None
    """Weights are drawn uniformly from [-a, a] with a = sqrt(1 / num_embeddings) unless set; this sets a."""
    ids: IdKind = IdKind.INDEX
    """index: ids are rows 0..num_embeddings-1; raw: any int64 ids, mapped to rows on the device by an id -> row map
    that admits new ids and evicts old ones (num_embeddings is then the capacity in rows; docs/raw_ids.md)."""
    eviction: Eviction = Eviction.LRU
    """ids raw: which resident id gives up its row when a new id comes and no row is free: lru (least recently
    used) or lfu (least frequently used)."""
    admit_min_count: int = 1
    """ids raw: a new id gets a row once seen this many times (count, estimated by a count-min sketch); until then
    it looks up a row of zeros and trains nothing."""
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Free-form annotations (not used by embshard itself)."""

    def __post_init__(self) -> None:
        def bad(fld: str, value: object, rule: str) -> ConfigError:
            return ConfigError(f"table {self.name!r}: {fld}={value!r} is invalid: {rule}")

        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"table name must be a non-empty string, got {self.name!r}")
        if not _PLAIN_NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise bad("name", self.name, _NAME_RULE)
        for fld in ("num_embeddings", "embedding_dim"):
            value = getattr(self, fld)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(fld, value, "it must be a positive integer")
        if isinstance(self.feature_names, str):
            raise bad("feature_names", self.feature_names, "give a list of feature names, e.g. ['f1']")
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if not self.feature_names:
            raise bad("feature_names", [], "a table needs at least one feature that looks it up")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise bad("feature_names", list(self.feature_names), "feature names must not repeat")
        for f in self.feature_names:
            if not isinstance(f, str) or not f:
                raise bad("feature_names", list(self.feature_names), "each feature name is a non-empty string")
            if not _PLAIN_NAME.fullmatch(f) or f in (".", ".."):
                raise bad("feature_names", f, _NAME_RULE)
        set_enum_field(self, "pooling", Pooling, f"table {self.name!r}: ")
        set_enum_field(self, "data_type", DataType, f"table {self.name!r}: ")
        if not isinstance(self.weighted, bool):
            raise bad("weighted", self.weighted, "it must be true or false")
        if not isinstance(self.ids_per_bag, int | float) or not self.ids_per_bag >= 0:
            raise bad("ids_per_bag", self.ids_per_bag, "it must be a number >= 0")
        if self.init_std is not None and not self.init_std > 0:
            raise bad("init_std", self.init_std, "it must be > 0 (or left unset)")
        set_enum_field(self, "ids", IdKind, f"table {self.name!r}: ")
        set_enum_field(self, "eviction", Eviction, f"table {self.name!r}: ")
        n = self.admit_min_count
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad("admit_min_count", n, "it must be an integer >= 1 (1: every new id gets a row at once)")
        if self.ids is IdKind.INDEX and (self.eviction is not Eviction.LRU or n != 1):
            key, value = (
                ("eviction", self.eviction.value) if self.eviction is not Eviction.LRU else ("admit_min_count", n)
            )
            raise bad(key, value, "it applies to raw-id tables only: set ids: raw, or remove it")
        if self.ids is IdKind.RAW and self.num_embeddings < 2:
            raise bad(
                "num_embeddings",
                self.num_embeddings,
                "a raw-id table needs >= 2 rows (one row of zeros for ids without a row, the rest hold ids)",
            )

    @property
    def init_bound(self) -> float:
        """Half-width of the uniform initialisation range."""
        return self.init_std if self.init_std is not None else (1.0 / self.num_embeddings) ** 0.5

    @property
    def sequence(self) -> bool:
        """Whether the table is a sequence table (pooling none: one row per id, not pooled)."""
        return self.pooling is Pooling.NONE

    @property
    def raw_ids(self) -> bool:
        """Whether the table's ids are raw 64-bit ids (mapped to rows by an id -> row map)."""
        return self.ids is IdKind.RAW

    @property
    def weight_bytes(self) -> int:
        """Bytes taken by the weights alone."""
        return self.num_embeddings * self.embedding_dim * self.data_type.bytes


_VALIDATED = object()  # the key only validate_tables passes to Tables


class Tables(tuple):
    """Tables that `validate_tables` checked: an immutable sequence of TableConfig (a tuple) with unique names, each
    feature looking up one table. Only `validate_tables` makes one, so a function given Tables skips the checks;
    functions that take tables accept a plain sequence too and call `validate_tables`, which returns Tables as
    they are. `Tables(items)` itself gives a plain tuple (as `dataclasses.asdict` rebuilds one of converted items):
    call `validate_tables`."""

    __slots__ = ()

    def __new__(cls, items: Iterable[Any], key: object = None) -> Tables | tuple:
        if key is not _VALIDATED:  # what rebuilds a tuple's items (dataclasses.asdict): a plain tuple, unchecked
            return tuple(items)
        return super().__new__(cls, items)

    def __reduce__(self) -> tuple[Any, tuple[tuple[TableConfig, ...]]]:
        return validate_tables, (tuple(self),)  # a copy or an unpickled one is checked again


def validate_tables(tables: Sequence[TableConfig]) -> Tables:
    """The tables as Tables, checked by `check_tables` (given Tables: returned as they are, checked when made)."""
    if isinstance(tables, Tables):
        return tables
    check_tables(tables)
    return Tables(tables, _VALIDATED)


def check_tables(tables: Sequence[TableConfig]) -> None:
    """Raise ConfigError unless these are TableConfigs with unique names, each feature looking up one table, and at
    least one table."""
    seen_tables: set[str] = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, TableConfig):
            raise ConfigError(f"expected TableConfig, got {type(t).__name__}: {t!r}")
        if t.name in seen_tables:
            raise ConfigError(f"table name {t.name!r} appears twice; table names must be unique")
        seen_tables.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ConfigError(
                    f"feature {f!r} is listed by tables {owner[f]!r} and {t.name!r}; a feature looks up one "
                    "table: give the second use its own feature name"
                )
            owner[f] = t.name
    if not tables:
        raise ConfigError("no tables given: an embedding collection needs at least one table")


def check_pooling_kinds(
    tables: Sequence[TableConfig], sequence: bool, what: str, others: Sequence[TableConfig] = ()
) -> None:
    """Raise ConfigError unless every table is a sequence table (`sequence`) or every one is pooled, as `what` (the
    collection) needs, and no feature of `others` (the model's other collection) is looked up the other way too."""
    for t in tables:
        if t.sequence != sequence:
            kind, fix = ("pooled", "pooling: none") if sequence else ("a sequence table", "pooling: sum or mean")
            raise ConfigError(
                f"table {t.name!r} (pooling {t.pooling.value}) is {kind}, but {what} takes only "
                f"{'sequence' if sequence else 'pooled'} tables: give it {fix}, or move it to the other collection"
            )
    mine = {f: t.name for t in tables for f in t.feature_names}
    for t in others:
        for f in t.feature_names:
            if f in mine:
                seq_table, pooled_table = (mine[f], t.name) if sequence else (t.name, mine[f])
                raise ConfigError(
                    f"feature {f!r} is looked up as a sequence by table {seq_table!r} and pooled by table "
                    f"{pooled_table!r}: a feature is looked up one way; give the second use its own feature name"
                )


def set_enum_field(obj: Any, name: str, kind: type[enum.Enum], where: str) -> None:
    """Set field `name` of the frozen dataclass `obj` to its member of `kind`; for a value that is none of them,
    ConfigError "{where}{name}=value is invalid: choose one of [the members' values]"."""
    value = getattr(obj, name)
    try:
        object.__setattr__(obj, name, kind(value))
    except ValueError:
        raise ConfigError(f"{where}{name}={value!r} is invalid: choose one of {[k.value for k in kind]}") from None


def check_known_keys(cls: type, keys: Iterable[str], where: str) -> None:
    """Raise ConfigError naming `where` and the first key that is not a field of dataclass `cls`."""
    known = {f.name for f in fields(cls)}
    for key in keys:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {sorted(known)}")


def feature_order(tables: Sequence[TableConfig]) -> list[str]:
    """The canonical feature order: tables in the given order, each table's features in its order."""
    return [f for t in tables for f in t.feature_names]


def feature_columns(tables: Sequence[TableConfig]) -> dict[str, int]:
    """Feature -> its position in the canonical order (the columns of the per-step id counts)."""
    return {f: i for i, f in enumerate(feature_order(tables))}
