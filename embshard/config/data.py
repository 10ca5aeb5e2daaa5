"""The `data:` section: which source feeds the model, and how each rank reads its part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.config.schema import FieldError


def _fraction(key: str, value: float) -> None:
    if not 0 < value < 1:
        raise FieldError(key, value, "it must be strictly between 0 and 1")


@dataclass(frozen=True)
class CriteoConfig:
    """Criteo click logs: label, 13 integer features I1..I13, 26 hex categorical features C1..C26."""

    path: str
    """Data file: the original tab-separated format (no header) or CSV with a header row (relative to the working
    directory)."""
    format: Literal["auto", "tsv", "csv"] = "auto"
    """File format; auto: tab in the first line means tsv, else csv with a header."""
    eval_fraction: float = 0.1
    """Fraction of the file's rows (its last rows) held out for evaluation, in (0, 1); ignored if eval_path is set."""
    eval_path: str | None = None
    """Optional separate evaluation file in the same format."""
    categorical: Literal["hash", "vocab"] = "hash"
    """How a categorical value becomes a table row: hash (stable 64-bit BLAKE2b modulo the table size) or vocab
    (a vocabulary of the training rows' values, most frequent first)."""
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
    """CSV file with columns user_id, movie_id, rating, ... (relative to the working directory)."""
    eval_fraction: float = 0.1
    """Fraction of the file's rows (its last rows) held out for evaluation, in (0, 1)."""
    positive_rating: int = 4
    """Label is 1 for ratings >= this (stars), else 0."""
    multi_valued: tuple[str, ...] = ("genres",)
    """Columns holding several values separated by `separator`; they become jagged features."""
    separator: str = "|"
    """Separator of multi-valued columns (one character)."""
    categorical: Literal["hash", "vocab"] = "hash"
    """How a value becomes a table row: hash (stable BLAKE2b modulo the table size) or vocab (training rows)."""
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
class DataConfig:
    """The data source and how ranks split it."""

    source: Literal["criteo", "movielens", "synthetic"]
    """Which loader: criteo, movielens or synthetic; the section of the same name configures it."""
    criteo: CriteoConfig | None = None
    """Criteo loader settings (source: criteo)."""
    movielens: MovieLensConfig | None = None
    """MovieLens loader settings (source: movielens)."""
    synthetic: SyntheticConfig | None = None
    """Synthetic generator settings (source: synthetic; defaults apply when omitted)."""
    shard: Literal["strided", "contiguous"] = "strided"
    """How file rows are split over ranks: strided (rank r reads rows r, r+W, r+2W, ...) or contiguous (rank r
    reads the r-th of W equal blocks). Each rank gets floor(rows / W) rows; the few left over are skipped."""
    shuffle: bool = True
    """Reshuffle each rank's training rows every epoch (seeded by seed and epoch)."""

    def __post_init__(self) -> None:
        if self.source == "synthetic" and self.synthetic is None:
            object.__setattr__(self, "synthetic", SyntheticConfig())
        if getattr(self, self.source) is None:
            raise FieldError(self.source, None, f"data source {self.source!r} needs its section, e.g. path: ...")
        for other in ("criteo", "movielens", "synthetic"):
            if other != self.source and getattr(self, other) is not None:
                raise FieldError(other, "{...}", f"source is {self.source!r}: remove this section or change source")
