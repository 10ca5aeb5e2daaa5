"""The `data:` section: which source feeds the model, and how each rank reads its part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.config.schema import FieldError


def _fraction(key: str, value: float, one_allowed: bool = False) -> None:
    if one_allowed and not 0 < value <= 1:
        raise FieldError(key, value, "it must be in (0, 1]: the fraction of the evaluation files' rows used")
    if not one_allowed and not 0 < value < 1:
        raise FieldError(key, value, "it must be strictly between 0 and 1 (the fraction of the rows held out)")


@dataclass(frozen=True)
class DenseColumnConfig:
    """One numeric column feeding one dense feature: missing values filled, optionally floored and transformed."""

    column: str
    """Column name in the files."""
    fill: float = 0.0
    """Value used where the column is missing (null, empty field or NaN), before `min` and `transform`."""
    min: float | None = None
    """Values below this are raised to it before the transform (Criteo: 0, so log1p sees no negatives); null: none."""
    transform: Literal["none", "log1p"] = "none"
    """Applied last: none, or log1p (log(1 + x), for counts)."""


@dataclass(frozen=True)
class CategoricalColumnConfig:
    """One column of ids or categorical values feeding one sparse feature (one table lookup per value)."""

    column: str
    """Column name in the files: strings, integers, or lists of them (Parquet list columns)."""
    feature: str | None = None
    """The feature this column feeds (a name in some table's feature_names); null: the column's name."""
    separator: str | None = None
    """Multi-valued text: one character splitting a field into several values ("Comedy|Drama"); null: one value."""
    weights: str | None = None
    """Column of per-id weights for a weighted table: numbers, lists of numbers (as long as the ids) or text split by
    `separator`; null: no weights."""

    def __post_init__(self) -> None:
        if self.separator is not None and len(self.separator) != 1:
            raise FieldError("separator", self.separator, "give exactly one character")

    @property
    def feature_name(self) -> str:
        return self.feature or self.column


@dataclass(frozen=True)
class TableSourceConfig:
    """Any tabular data set: Parquet, CSV or TSV files read in row groups, columns mapped to features in YAML."""

    files: tuple[str, ...]
    """Training files: paths or glob patterns, read in the order given (each pattern's matches sorted by name)."""
    label: str
    """Column of the label: 0/1 clicks, or any number with label_threshold."""
    categorical: tuple[CategoricalColumnConfig, ...]
    """Sparse feature columns; every feature of the model's tables needs one."""
    dense: tuple[DenseColumnConfig, ...] = ()
    """Dense feature columns, in the order of the model's dense input."""
    format: Literal["auto", "parquet", "csv", "tsv"] = "auto"
    """File format; auto: by extension (.parquet/.pq, .csv, .tsv/.tab; other extensions need format)."""
    header: bool = True
    """CSV/TSV: the first line names the columns; false: give column_names."""
    column_names: tuple[str, ...] | None = None
    """CSV/TSV without a header: the name of every field of a line, in order."""
    delimiter: str | None = None
    """CSV/TSV field delimiter (one character); null: comma for csv, tab for tsv."""
    chunk_rows: int = 65536
    """CSV/TSV: lines per group, the unit of reading, sharding and shuffling (Parquet files use their row groups)."""
    label_threshold: float | None = None
    """Label = 1 where the label column is >= this, else 0 (ratings to clicks); null: the column is the label, in
    [0, 1]."""
    mapping: Literal["hash", "vocab", "identity", "raw"] = "hash"
    """How values become table rows: hash (embshard-hash-v1 modulo the table size; row 0 = missing), vocab (a
    vocabulary, most frequent value first; row 0 = missing, row 1 = out of vocabulary), identity (the values are
    row numbers already, e.g. the output of `embshard preprocess`; null = empty bag, out of range = bad row) or
    raw (raw 64-bit ids for tables with ids: raw: integers as they are, other text hashed to 64 bits, no modulo;
    the tables map them to rows on the device, docs/raw_ids.md)."""
    vocab_dir: str | None = None
    """Vocab only: folder of vocabulary files written by `embshard preprocess --vocab-only`; null builds the
    vocabulary at start-up from the training rows (one extra pass over them)."""
    vocab_min_count: int = 1
    """Vocab only: values seen fewer times than this (count of training rows) map to the out-of-vocabulary row."""
    eval_files: tuple[str, ...] | None = None
    """Held-out files (paths or globs); null: the last eval_fraction of the training files' rows are held out."""
    eval_fraction: float | None = None
    """Without eval_files: fraction of the rows (the last ones) held out, in (0, 1), default 0.1. With eval_files:
    fraction of their rows used (the first ones), in (0, 1], default 1 (MLPerf: 0.5 of day 23)."""

    def __post_init__(self) -> None:
        if not self.files:
            raise FieldError("files", self.files, "give at least one path or glob pattern")
        if not self.categorical:
            raise FieldError("categorical", self.categorical, "give at least one categorical column")
        if self.eval_fraction is not None:
            _fraction("eval_fraction", self.eval_fraction, self.eval_files is not None)
        if not self.header and self.format != "parquet" and not self.column_names:
            raise FieldError("column_names", None, "header: false needs the names of every field of a line")
        if self.delimiter is not None and len(self.delimiter) != 1:
            raise FieldError("delimiter", self.delimiter, "give exactly one character")
        if self.vocab_min_count < 1:
            raise FieldError("vocab_min_count", self.vocab_min_count, "it must be >= 1")
        if self.chunk_rows < 1:
            raise FieldError("chunk_rows", self.chunk_rows, "it must be >= 1 line")
        if self.vocab_dir is not None and self.mapping != "vocab":
            raise FieldError("vocab_dir", self.vocab_dir, f"it is read by mapping: vocab, not {self.mapping}")
        seen: dict[str, int] = {}
        for i, c in enumerate(self.categorical):
            if c.feature_name in seen:
                raise FieldError(
                    f"categorical[{i}].feature",
                    c.feature_name,
                    f"categorical[{seen[c.feature_name]}] already feeds this feature: one column per feature",
                )
            seen[c.feature_name] = i
        dense = [d.column for d in self.dense]
        for i, name in enumerate(dense):
            if name in dense[:i]:
                raise FieldError(f"dense[{i}].column", name, "this column is listed twice")
        if self.label in dense:
            raise FieldError("label", self.label, "the label column is also listed under dense")

    @property
    def held_out_fraction(self) -> float:
        """eval_fraction with its default (0.1 of the training files, or all of the eval files)."""
        if self.eval_fraction is not None:
            return self.eval_fraction
        return 1.0 if self.eval_files is not None else 0.1


@dataclass(frozen=True)
class CriteoConfig:
    """Criteo click logs: label, 13 integer features I1..I13, 26 hex categorical features C1..C26."""

    path: tuple[str, ...] | str
    """Data file(s), paths or glob patterns, read in the order given (each pattern's matches sorted by name): the
    original tab-separated day files (no header) or CSV with a header row."""
    format: Literal["auto", "tsv", "csv"] = "auto"
    """File format; auto: tab in the first line means tsv, else csv with a header."""
    eval_fraction: float = 0.1
    """Fraction of the rows (the last ones) held out for evaluation, in (0, 1); ignored if eval_path is set."""
    eval_path: tuple[str, ...] | str | None = None
    """Optional separate evaluation file(s), paths or globs, in the same format."""
    categorical: Literal["hash", "vocab", "raw"] = "hash"
    """How a categorical value becomes a table row: hash (embshard-hash-v1 modulo the table size, docs/data.md),
    vocab (a vocabulary of the training rows' values, most frequent first) or raw (the value's raw 64-bit id, for
    tables with ids: raw, docs/raw_ids.md)."""
    vocab_dir: str | None = None
    """Vocab only: folder of vocabulary files written by `embshard preprocess --vocab-only`; null builds the
    vocabulary at start-up from the training rows (one extra pass over them)."""
    vocab_min_count: int = 1
    """Vocab only: values seen fewer times than this (count of training rows) map to the out-of-vocabulary row."""

    def __post_init__(self) -> None:
        _fraction("eval_fraction", self.eval_fraction)
        if self.vocab_min_count < 1:
            raise FieldError("vocab_min_count", self.vocab_min_count, "it must be >= 1")


@dataclass(frozen=True)
class MovieLensConfig:
    """MovieLens ratings joined with user and movie attributes, CSV with a header."""

    path: str
    """CSV file with columns user_id, movie_id, rating, ... (relative to the working directory; a glob reads
    several)."""
    eval_fraction: float = 0.1
    """Fraction of the file's rows (its last rows) held out for evaluation, in (0, 1)."""
    positive_rating: int = 4
    """Label is 1 for ratings >= this (stars), else 0."""
    multi_valued: tuple[str, ...] = ("genres",)
    """Columns holding several values separated by `separator`; they become jagged features."""
    separator: str = "|"
    """Separator of multi-valued columns (one character)."""
    categorical: Literal["hash", "vocab"] = "hash"
    """How a value becomes a table row: hash (embshard-hash-v1 modulo the table size) or vocab (training rows)."""
    vocab_min_count: int = 1
    """Vocab only: values seen fewer times than this (count) map to the out-of-vocabulary row."""

    def __post_init__(self) -> None:
        _fraction("eval_fraction", self.eval_fraction)
        if len(self.separator) != 1:
            raise FieldError("separator", self.separator, "give exactly one character")
        if self.vocab_min_count < 1:
            raise FieldError("vocab_min_count", self.vocab_min_count, "it must be >= 1")


@dataclass(frozen=True)
class AffinityConfig:
    """Synthetic retrieval data: each sample's item depends on its user, so a two-tower model can learn it. Users
    and items fall into `clusters` groups (user u: a hash of u; item j: j mod clusters, before scrambling); with
    probability `strength` the item is drawn from the user's group (Zipf over the group's items, zipf_exponent),
    else from the whole table as usual. Every sample is a positive (label 1)."""

    user_feature: str
    """Feature holding the sample's user id (one id per sample)."""
    item_feature: str
    """Feature holding the sample's item id (one id per sample): from the user's group with probability strength."""
    clusters: int = 100
    """Number of user and item groups (count); the item table's rows must be a multiple of it."""
    strength: float = 0.8
    """Probability that a sample's item comes from its user's group, in [0, 1]."""

    def __post_init__(self) -> None:
        if self.clusters < 1:
            raise FieldError("clusters", self.clusters, "it must be >= 1")
        if not 0 <= self.strength <= 1:
            raise FieldError("strength", self.strength, "it is a probability: give a value in [0, 1]")


@dataclass(frozen=True)
class SyntheticConfig:
    """Generated click data at any scale: Zipf-skewed ids, per-feature pooling factors, learnable labels."""

    num_dense: int = 13
    """Number of dense (continuous) features per sample (count)."""
    zipf_exponent: float = 1.05
    """Skew of the ids: P(k-th most popular row) ~ 1 / k^exponent; 0 gives uniform ids."""
    pooling: dict[str, float] | None = None
    """Mean ids per bag for each named feature (ids/bag); features not named use their table's ids_per_bag."""
    bag_lengths: Literal["poisson", "fixed"] = "poisson"
    """poisson: 1 + Poisson(p - 1) ids per bag for a pooling factor p >= 1 (0 or 1 with P(1) = p below 1);
    fixed: every bag holds round(p) ids (MLPerf DLRM-DCNv2's multi-hot sizes)."""
    scramble: bool = True
    """Spread the popular ids over the table by a fixed bijective hash instead of rows 0, 1, 2, ... (tables up to
    2^31 rows; larger tables keep popularity order)."""
    eval_batches: int = 4
    """Held-out batches per rank per evaluation (count); drawn from their own fixed random stream."""
    workers: int = 0
    """Worker processes per rank drawing the training batches (count; 0: drawn in the training process's host
    thread). The batches are the same with any number of workers; pinned for the copy to the GPU."""
    affinity: AffinityConfig | None = None
    """Retrieval data: items drawn from their user's group (two-tower softmax losses); unset: independent ids."""

    def __post_init__(self) -> None:
        if self.num_dense < 0:
            raise FieldError("num_dense", self.num_dense, "it must be >= 0")
        if not self.zipf_exponent >= 0:
            raise FieldError("zipf_exponent", self.zipf_exponent, "it must be >= 0 (0 means uniform)")
        for f, p in (self.pooling or {}).items():
            if not p > 0:
                raise FieldError(f"pooling.{f}", p, "a pooling factor must be > 0 ids per bag")
            if self.bag_lengths == "fixed" and round(p) < 1:
                raise FieldError(f"pooling.{f}", p, "bag_lengths fixed holds round(p) ids per bag: give p >= 0.5")
        if self.eval_batches < 1:
            raise FieldError("eval_batches", self.eval_batches, "it must be >= 1")
        if self.workers < 0:
            raise FieldError("workers", self.workers, "it must be >= 0 processes (0: no worker processes)")


@dataclass(frozen=True)
class SequencesConfig:
    """Per-user item sequences, oldest first, for sequential recommenders (model kind hstu; data/sequences.py): a
    synthetic Markov chain over Zipf-popular items, or interactions of a CSV file (the MovieLens layout) grouped by
    user and ordered by time. Each user's last item is held out: evaluation predicts it from the items before."""

    item_feature: str
    """Feature receiving each user's item sequence (the model's sequential.item_feature)."""
    path: str | None = None
    """CSV file with a header (user, item and time columns; other columns feed the context features, hashed);
    null: the synthetic Markov chain."""
    user_column: str = "user_id"
    """File: the column of the user id."""
    item_column: str = "movie_id"
    """File: the column of the item id (items get catalog rows by a vocabulary, most frequent first)."""
    time_column: str = "timestamp"
    """File: the column ordering each user's items (ties keep the file's order)."""
    max_length: int = 50
    """Items of history a sample holds at most (count): a user's last max_length + 1 items are kept."""
    min_length: int = 5
    """Synthetic: each user has between min_length and max_length + 1 items, uniformly (count, >= 2)."""
    successors: int = 3
    """Synthetic: each item's successor set, Zipf-drawn items (count)."""
    strength: float = 0.9
    """Synthetic: probability that the next item comes from the current item's successor set (else a Zipf draw)."""
    zipf_exponent: float = 1.05
    """Synthetic: skew of the item popularity, P(k-th most popular) ~ 1 / k^exponent."""
    eval_batches: int = 4
    """Synthetic: held-out batches of users per rank per evaluation (count)."""
    visit_gap: float | None = None
    """Synthetic: each item has a time (each user's gaps are exponential around a mean of its own, log-uniform
    from a minute to a week); a gap longer than this (seconds) starts a new visit whose item is a fresh Zipf draw
    rather than a successor; null: the chain ignores the times."""

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise FieldError("max_length", self.max_length, "it must be >= 1 item")
        if self.path is None and not 2 <= self.min_length <= self.max_length + 1:
            raise FieldError(
                "min_length", self.min_length, f"it must be in [2, max_length + 1 = {self.max_length + 1}]"
            )
        if self.successors < 1:
            raise FieldError("successors", self.successors, "it must be >= 1 item")
        if not 0 <= self.strength <= 1:
            raise FieldError("strength", self.strength, "it is a probability: give a value in [0, 1]")
        if self.visit_gap is not None and not self.visit_gap > 0:
            raise FieldError("visit_gap", self.visit_gap, "it must be > 0 seconds (or null: times carry no signal)")
        if not self.zipf_exponent >= 0:
            raise FieldError("zipf_exponent", self.zipf_exponent, "it must be >= 0 (0 means uniform)")
        if self.eval_batches < 1:
            raise FieldError("eval_batches", self.eval_batches, "it must be >= 1")


@dataclass(frozen=True)
class DataConfig:
    """The data source, and how each rank reads its part: shuffle, worker processes, prefetch, bad rows."""

    source: Literal["table", "criteo", "movielens", "synthetic", "sequences"]
    """Which loader: table (any Parquet/CSV/TSV files, columns in YAML), criteo, movielens (presets of table),
    synthetic, or sequences (per-user item sequences); the section of the same name configures it."""
    table: TableSourceConfig | None = None
    """Generic columnar loader settings (source: table)."""
    criteo: CriteoConfig | None = None
    """Criteo loader settings (source: criteo)."""
    movielens: MovieLensConfig | None = None
    """MovieLens loader settings (source: movielens)."""
    synthetic: SyntheticConfig | None = None
    """Synthetic generator settings (source: synthetic; defaults apply when omitted)."""
    sequences: SequencesConfig | None = None
    """Per-user item sequences (source: sequences), for model kind hstu."""
    shuffle: bool = True
    """Files: each epoch, shuffle the order of the rank's row groups and the rows within every shuffle window."""
    shuffle_rows: int = 65536
    """Files: rows shuffled together (a window of consecutive row groups, at least this many rows; memory per
    worker is about twice a window)."""
    workers: int = 0
    """Files: reader processes per rank (0: read in the training process); each owns disjoint row groups."""
    prefetch: int = 4
    """Files, workers > 0: batches each worker prepares ahead (count)."""
    pin_memory: bool = True
    """Files: copy batches into page-locked memory when CUDA is available (asynchronous copies to the GPU)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """Files: a row that cannot be read (field count, a non-number, a missing or out-of-range label, an id out of
    range): error names file, row and column; skip drops it, counts skipped rows per file and reports them."""

    def __post_init__(self) -> None:
        if self.source == "synthetic" and self.synthetic is None:
            object.__setattr__(self, "synthetic", SyntheticConfig())
        if getattr(self, self.source) is None:
            raise FieldError(self.source, None, f"data source {self.source!r} needs its section, e.g. path: ...")
        for other in ("table", "criteo", "movielens", "synthetic", "sequences"):
            if other != self.source and getattr(self, other) is not None:
                raise FieldError(other, "{...}", f"source is {self.source!r}: remove this section or change source")
        if self.shuffle_rows < 1:
            raise FieldError("shuffle_rows", self.shuffle_rows, "it must be >= 1 row")
        if self.workers < 0:
            raise FieldError("workers", self.workers, "it must be >= 0 (0 reads in the training process)")
        if self.prefetch < 1:
            raise FieldError("prefetch", self.prefetch, "it must be >= 1 batch")

    def check_features(self, features: list[str], weighted: set[str]) -> None:
        """source table: every feature of the tables has a column, every column a feature, weights where needed."""
        if self.table is not None:
            check_table_features(self.table, features, weighted, "table.")


def check_table_features(cfg: TableSourceConfig, features: list[str], weighted: set[str], prefix: str = "") -> None:
    """Every feature of the tables has one column, every column feeds a feature, weights exactly where needed."""
    fed = {c.feature_name: i for i, c in enumerate(cfg.categorical)}
    for i, c in enumerate(cfg.categorical):
        key = f"{prefix}categorical[{i}]"
        if c.feature_name not in features:
            raise FieldError(f"{key}.feature", c.feature_name, f"no table lists this feature (features: {features})")
        if c.weights is None and c.feature_name in weighted:
            raise FieldError(f"{key}.weights", None, "its table is weighted: name the column of per-id weights")
        if c.weights is not None and c.feature_name not in weighted:
            raise FieldError(f"{key}.weights", c.weights, "its table is not weighted: set weighted: true there")
    missing = [f for f in features if f not in fed]
    if missing:
        raise FieldError(
            f"{prefix}categorical", f"{len(fed)} columns", f"features {missing} have no column: add {{column: ...}}"
        )
