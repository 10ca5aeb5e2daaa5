"""The `model:` section: the embedding tables (embshard.spec.tables.TableConfig) and the dense architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.config.schema import FieldError
from embshard.spec.tables import ConfigError, TableConfig, validate_tables


def positive_ints(key: str, sizes: tuple[int, ...], allow_empty: bool = True) -> None:
    """Raise FieldError unless every size is a positive integer (and the list is non-empty if required)."""
    if not allow_empty and not sizes:
        raise FieldError(key, list(sizes), "give at least one layer size")
    for i, s in enumerate(sizes):
        if s < 1:
            raise FieldError(f"{key}[{i}]", s, "layer sizes must be positive integers")


@dataclass(frozen=True)
class DLRMConfig:
    """DLRM's dense part: bottom MLP over the dense features, interaction, top MLP to one logit."""

    bottom_mlp: tuple[int, ...] = (64, 32)
    """Hidden layer widths of the bottom MLP, in units; its output width is the (first) table's embedding_dim."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden layer widths of the top MLP, in units (a final 1-unit logit layer is added)."""

    def __post_init__(self) -> None:
        positive_ints("bottom_mlp", self.bottom_mlp)
        positive_ints("top_mlp", self.top_mlp)


@dataclass(frozen=True)
class DCNConfig:
    """DLRM-DCNv2 interaction: a low-rank cross network over the concatenated dense and sparse vector."""

    num_layers: int = 3
    """Number of cross layers (count)."""
    low_rank: int = 64
    """Rank r of each cross layer's weight W = U V (U: d x r, V: r x d), in units."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise FieldError("num_layers", self.num_layers, "a cross network needs at least 1 layer")
        if self.low_rank < 1:
            raise FieldError("low_rank", self.low_rank, "the rank must be a positive integer")


@dataclass(frozen=True)
class InBatchConfig:
    """In-batch softmax: each user's own item is its positive, the other items of the batch are its negatives."""

    global_negatives: bool = False
    """Negatives from every rank's batch (all-gathered: B_global - 1 per user), else from this rank's (B - 1)."""
    remove_duplicates: bool = True
    """Catalog mode (item_mlp: []): a batch item with the same id as a user's own item is not one of its negatives."""


@dataclass(frozen=True)
class SampledSoftmaxConfig:
    """Sampled softmax over the catalog: the target against negatives drawn per step, logQ-corrected."""

    num_negatives: int = 1024
    """Negatives drawn from the whole catalog per step, shared by the global batch (count; >= ranks)."""
    sampler: Literal["unigram", "uniform"] = "unigram"
    """Proposal within each rank's row block: unigram (items by their count as training targets so far, plus
    smoothing) or uniform."""
    smoothing: float = 1.0
    """Unigram only: pseudo-count added to every item's target count (count)."""

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise FieldError("num_negatives", self.num_negatives, "draw at least 1 negative per step")
        if not self.smoothing > 0:
            raise FieldError("smoothing", self.smoothing, "it must be > 0 (an unseen item needs a probability)")


CATALOG_LOSSES = ("full_softmax", "sampled_softmax")

BUILTIN_KINDS = ("dlrm", "dlrm_dcnv2", "two_tower", "hstu")
"""The model kinds of embshard/models; more are registered from Python with embshard.models.register_model."""
_REGISTERED_KINDS: list[str] = []


def add_model_kind(name: str) -> None:
    """Accept `model.kind: name` from now on, in this process (called by embshard.models.register_model)."""
    if name not in BUILTIN_KINDS and name not in _REGISTERED_KINDS:
        _REGISTERED_KINDS.append(name)


def model_kinds() -> list[str]:
    """The kinds a ModelConfig accepts in this process: the built-in ones, then those registered from Python."""
    return [*BUILTIN_KINDS, *_REGISTERED_KINDS]


@dataclass(frozen=True)
class TwoTowerConfig:
    """Two-tower retrieval: a user tower and an item tower, each an MLP over its group of pooled embeddings; or,
    with item_mlp: [] (catalog mode), the item vector is the row of the item's id in its table (the catalog)."""

    user_features: tuple[str, ...]
    """Sparse features whose pooled embeddings are concatenated into the user tower's input."""
    item_features: tuple[str, ...]
    """Sparse features whose pooled embeddings are concatenated into the item tower's input; catalog mode: the one
    feature holding each sample's item id (one id per sample)."""
    user_mlp: tuple[int, ...] = (64, 32)
    """Layer widths of the user tower, in units; the last is the output (dot-product) dimension."""
    item_mlp: tuple[int, ...] = (64, 32)
    """Layer widths of the item tower, in units; the last must equal user_mlp's last. []: catalog mode, no item
    tower (the item feature's table, one feature only, has embedding_dim = user_mlp's last)."""
    loss: Literal["bce", "in_batch", "full_softmax", "sampled_softmax"] = "bce"
    """bce: binary cross-entropy of dot(user, item) against the label; in_batch: softmax over the batch's items;
    full_softmax: softmax over every item of the catalog; sampled_softmax: over sampled catalog items (the last two
    need catalog mode; docs/retrieval.md)."""
    temperature: float = 1.0
    """Softmax losses: logits are dot products divided by this (dimensionless)."""
    in_batch: InBatchConfig | None = None
    """Options of loss in_batch (defaults apply when omitted)."""
    sampled_softmax: SampledSoftmaxConfig | None = None
    """Options of loss sampled_softmax (defaults apply when omitted)."""
    chunk_mib: float = 256.0
    """Catalog mode: memory of one chunk of logits [global batch, catalog rows] in the softmax and top-k (MiB)."""
    recall_at: tuple[int, ...] = (10,)
    """Catalog mode: evaluation reports recall@K over the whole catalog for each K (count of items); [] for none."""

    def __post_init__(self) -> None:
        for key in ("user_features", "item_features"):
            if not getattr(self, key):
                raise FieldError(key, [], "a tower needs at least one feature")
        positive_ints("user_mlp", self.user_mlp, allow_empty=False)
        positive_ints("item_mlp", self.item_mlp)
        if self.item_mlp and self.user_mlp[-1] != self.item_mlp[-1]:
            raise FieldError(
                "item_mlp",
                list(self.item_mlp),
                f"the towers' output widths must match for a dot product: user_mlp ends in {self.user_mlp[-1]}, "
                f"item_mlp in {self.item_mlp[-1]}",
            )
        if not self.item_mlp and len(self.item_features) != 1:
            raise FieldError(
                "item_features",
                list(self.item_features),
                "item_mlp: [] (catalog mode) takes the item vector from one feature, the item id: list exactly one",
            )
        if self.loss in CATALOG_LOSSES and self.item_mlp:
            raise FieldError(
                "item_mlp",
                list(self.item_mlp),
                f"loss {self.loss} scores the catalog's rows themselves: set item_mlp: [] (no item tower)",
            )
        if not self.temperature > 0:
            raise FieldError("temperature", self.temperature, "it must be > 0")
        if not self.chunk_mib > 0:
            raise FieldError("chunk_mib", self.chunk_mib, "it must be > 0 MiB")
        positive_ints("recall_at", self.recall_at)
        for key, loss, default in (
            ("in_batch", "in_batch", InBatchConfig),
            ("sampled_softmax", "sampled_softmax", SampledSoftmaxConfig),
        ):
            if getattr(self, key) is not None and self.loss != loss:
                raise FieldError(key, "{...}", f"loss {self.loss!r} does not use it: remove it or set loss: {loss}")
            if getattr(self, key) is None and self.loss == loss:
                object.__setattr__(self, key, default())

    @property
    def catalog_mode(self) -> bool:
        """The item vectors are catalog rows (item_mlp: [])."""
        return not self.item_mlp


@dataclass(frozen=True)
class SequentialConfig:
    """Generative sequential recommender (kind hstu, embshard/models/sequential.py): causal HSTU layers over each
    user's item sequence predict the next item at every position, scored against the item catalog (the item
    feature's table, row-sharded; its rows are also the sequence's input embeddings); docs/sequence.md."""

    item_feature: str
    """Feature holding each user's items, oldest first (a jagged feature); its table is the catalog (one feature,
    embedding_dim = the model width)."""
    context_features: tuple[str, ...]
    """Pooled features of the user (e.g. the user id): projected and added to every position's input (at least
    one: they are the model's embedding-bag collection)."""
    side_features: tuple[str, ...] = ()
    """Per-position side features (e.g. each history item's category or the action taken on it): features of
    sequence tables (pooling: none) with one id per item of the history, looked up by the model's sharded sequence
    collection and added to the item's vector at its position; their tables' embedding_dim is the catalog's."""
    num_layers: int = 2
    """HSTU layers (count)."""
    num_heads: int = 2
    """Attention heads per layer (count); the catalog's embedding_dim must be a multiple of it."""
    max_length: int = 50
    """The longest history the model reads (items): a batch's sequences hold at most max_length + 1 items (the
    history and the item it predicts; the data sources keep each user's last max_length + 1), and the relative
    position bias has that many distances; a longer sequence is an error."""
    loss: Literal["full_softmax", "sampled_softmax"] = "full_softmax"
    """full_softmax: each position's next item against every item of the catalog (fused cross-entropy);
    sampled_softmax: against sampled catalog items (logQ-corrected)."""
    sampled_softmax: SampledSoftmaxConfig | None = None
    """Options of loss sampled_softmax (defaults apply when omitted)."""
    temperature: float = 1.0
    """Logits are dot products divided by this (dimensionless)."""
    chunk_mib: float = 256.0
    """Memory of one chunk of logits [positions, catalog rows] in the softmax and top-k (MiB)."""
    metrics_at: tuple[int, ...] = (10,)
    """Evaluation reports HR@K and NDCG@K of each user's held-out last item, and the popularity baseline's, for
    each K (count of items)."""
    attention: Literal["jagged", "padded"] = "jagged"
    """How the HSTU layers lay out the batch's histories: jagged (each history padded only to a multiple of
    attention_tile positions, work ~ sum of squared lengths) or padded (to the batch's longest history, work
    ~ batch x longest^2: the reference). Both compute the same function."""
    attention_tile: int = 64
    """Jagged attention: positions per tile (count); a batch whose longest history fits in one tile is laid out
    padded (the same work, without the tiles' gathers)."""
    time_bias: bool = False
    """Add a learned bias per head over log-bucketed time gaps between the query's time (that of the item it
    predicts) and each key's to the attention scores (HSTU's relative time bias); needs data with timestamps."""

    def __post_init__(self) -> None:
        if not self.context_features:
            raise FieldError("context_features", [], "list at least one pooled feature of the user (e.g. user_id)")
        for key in ("num_layers", "num_heads", "max_length", "attention_tile"):
            if getattr(self, key) < 1:
                raise FieldError(key, getattr(self, key), "it must be >= 1")
        if not self.temperature > 0:
            raise FieldError("temperature", self.temperature, "it must be > 0")
        if not self.chunk_mib > 0:
            raise FieldError("chunk_mib", self.chunk_mib, "it must be > 0 MiB")
        positive_ints("metrics_at", self.metrics_at, allow_empty=False)
        if self.sampled_softmax is not None and self.loss != "sampled_softmax":
            raise FieldError("sampled_softmax", "{...}", f"loss {self.loss!r} does not use it: remove it")
        if self.sampled_softmax is None and self.loss == "sampled_softmax":
            object.__setattr__(self, "sampled_softmax", SampledSoftmaxConfig())


@dataclass(frozen=True)
class ModelConfig:
    """The model: its embedding tables and its dense architecture."""

    kind: str
    """Architecture: dlrm (dot interaction), dlrm_dcnv2 (low-rank cross network), two_tower (retrieval), hstu (the
    generative sequential recommender, model.sequential), or a kind registered from Python with
    embshard.models.register_model (in the process that reads the config)."""
    tables: tuple[TableConfig, ...]
    """The embedding tables; each lists the sparse features that look it up. Pooled tables (pooling sum or mean) form
    the embedding-bag collection; sequence tables (pooling: none, one row per id) the sequence collection (kind hstu's
    side features, or a registered kind's)."""
    dlrm: DLRMConfig | None = None
    """Bottom and top MLPs; used by kind dlrm and dlrm_dcnv2 (defaults apply when omitted)."""
    dcn: DCNConfig | None = None
    """Cross network; used by kind dlrm_dcnv2 (defaults apply when omitted)."""
    two_tower: TwoTowerConfig | None = None
    """Towers and loss; required for kind two_tower."""
    sequential: SequentialConfig | None = None
    """Sequence features and HSTU layers; required for kind hstu."""

    def __post_init__(self) -> None:
        if self.kind not in model_kinds():
            raise FieldError(
                "kind",
                self.kind,
                f"choose one of {model_kinds()}, or register your own model first "
                "(embshard.models.register_model, in Python)",
            )
        if not self.tables:
            raise FieldError("tables", [], "list at least one table")
        names: dict[str, int] = {}
        owner: dict[str, str] = {}
        for i, t in enumerate(self.tables):
            if t.name in names:
                raise FieldError(
                    f"tables[{i}].name", t.name, f"tables[{names[t.name]}] has the same name; names are unique"
                )
            names[t.name] = i
            for f in t.feature_names:
                if f in owner:
                    raise FieldError(
                        f"tables[{i}].feature_names",
                        list(t.feature_names),
                        f"feature {f!r} is already looked up by table {owner[f]!r}; a feature looks up one table",
                    )
                owner[f] = t.name
        try:
            object.__setattr__(self, "tables", validate_tables(self.tables))  # Tables: the planner checks them no more
        except ConfigError as e:
            raise FieldError("tables", [t.name for t in self.tables], str(e)) from None
        if self.kind in ("dlrm", "dlrm_dcnv2") and self.dlrm is None:
            object.__setattr__(self, "dlrm", DLRMConfig())
        if self.kind == "dlrm_dcnv2" and self.dcn is None:
            object.__setattr__(self, "dcn", DCNConfig())
        unused = {
            "dlrm": self.kind in ("two_tower", "hstu"),
            "dcn": self.kind != "dlrm_dcnv2",
            "two_tower": self.kind != "two_tower",
            "sequential": self.kind != "hstu",
        }
        for key, is_unused in unused.items():
            if is_unused and getattr(self, key) is not None:
                raise FieldError(key, "{...}", f"model kind {self.kind!r} does not use it: remove it or change kind")
        if self.kind == "dlrm":
            d0 = self.tables[0].embedding_dim
            for i, t in enumerate(self.tables):
                if t.embedding_dim != d0:
                    raise FieldError(
                        f"tables[{i}].embedding_dim",
                        t.embedding_dim,
                        f"DLRM's dot interaction needs equal widths: table {t.name!r} differs from the first table's "
                        f"{d0}; make them equal or use kind dlrm_dcnv2",
                    )
        sequence = [t.name for t in self.tables if t.sequence]
        if sequence and self.kind in ("dlrm", "dlrm_dcnv2", "two_tower"):
            raise FieldError(
                "tables",
                sequence,
                f"model kind {self.kind!r} pools every feature, but these tables have pooling: none (sequence tables, "
                "one row per id): give them pooling sum or mean, or use kind hstu (side_features) or a kind "
                "registered with embshard.models.register_model that reads RecModel.sequences",
            )
        if self.kind == "hstu":
            check_sequential(self)
        if self.kind == "two_tower":
            if self.two_tower is None:
                raise FieldError("two_tower", None, "kind two_tower needs a two_tower section (user/item features)")
            known = {f for t in self.tables for f in t.feature_names}
            for key in ("user_features", "item_features"):
                for i, f in enumerate(getattr(self.two_tower, key)):
                    if f not in known:
                        raise FieldError(
                            f"two_tower.{key}[{i}]", f, f"no table lists this feature; known features: {sorted(known)}"
                        )
            if self.two_tower.catalog_mode:
                item = self.two_tower.item_features[0]
                i, t = next((i, t) for i, t in enumerate(self.tables) if item in t.feature_names)
                width = self.two_tower.user_mlp[-1]
                if t.raw_ids:
                    raise FieldError(
                        f"tables[{i}].ids",
                        "raw",
                        f"table {t.name!r} is the catalog (item_mlp: []): the softmax scores its rows by row number, "
                        "which raw ids are not: give it ids: index (hash or vocabulary item ids into its rows)",
                    )
                if list(t.feature_names) != [item]:
                    raise FieldError(
                        f"tables[{i}].feature_names",
                        list(t.feature_names),
                        f"table {t.name!r} is the catalog (item_mlp: []): its rows are read whole by the softmax, so "
                        f"only the item id {item!r} may look it up; give the other features their own table",
                    )
                if t.embedding_dim != width:
                    raise FieldError(
                        f"tables[{i}].embedding_dim",
                        t.embedding_dim,
                        f"table {t.name!r} is the catalog (item_mlp: []): its rows are the item vectors, so its width "
                        f"must be the user tower's output, user_mlp's last ({width})",
                    )

    @property
    def features(self) -> list[str]:
        """All sparse features, in table order."""
        return [f for t in self.tables for f in t.feature_names]


def check_sequential(cfg: ModelConfig) -> None:
    """Kind hstu: the sequential section is there, its features are the tables', the item feature's table is a
    catalog (its only feature, index ids, width divisible by the heads)."""
    sq = cfg.sequential
    if sq is None:
        raise FieldError("sequential", None, "kind hstu needs a sequential section (item_feature, context_features)")
    known = {f: (i, t) for i, t in enumerate(cfg.tables) for f in t.feature_names}
    named = (
        ("item_feature", [sq.item_feature]),
        ("context_features", list(sq.context_features)),
        ("side_features", list(sq.side_features)),
    )
    for key, names in named:
        for f in names:
            if f not in known:
                raise FieldError(f"sequential.{key}", f, f"no table lists this feature; known: {sorted(known)}")
    if sq.item_feature in sq.context_features:
        raise FieldError("sequential.context_features", list(sq.context_features), "the item feature is not context")
    i, t = known[sq.item_feature]
    if list(t.feature_names) != [sq.item_feature]:
        raise FieldError(
            f"tables[{i}].feature_names",
            list(t.feature_names),
            f"table {t.name!r} is the item catalog: only {sq.item_feature!r} may look it up; give the others a table",
        )
    if t.raw_ids:
        raise FieldError(f"tables[{i}].ids", "raw", f"table {t.name!r} is the item catalog: give it ids: index")
    if t.embedding_dim % sq.num_heads:
        raise FieldError(
            f"tables[{i}].embedding_dim",
            t.embedding_dim,
            f"table {t.name!r} is the item catalog, whose width is the model's: make it a multiple of "
            f"sequential.num_heads ({sq.num_heads})",
        )
    for f in sq.context_features:
        j, c = known[f]
        if c.pooling.value == "none":
            raise FieldError(
                f"tables[{j}].pooling",
                "none",
                f"table {c.name!r} feeds a context feature, pooled per user: sum or mean",
            )
    check_side_features(cfg, known)
    used = {sq.item_feature, *sq.context_features, *sq.side_features}
    unused = [f for f in known if f not in used]
    if unused:
        raise FieldError(
            "tables", sorted(known), f"features {unused} are used by none of item_feature, context and side features"
        )


def check_side_features(cfg: ModelConfig, known: dict[str, tuple[int, TableConfig]]) -> None:
    """Kind hstu's side features: sequence tables of the catalog's width, other than the item and context features,
    that keep every id of a history (max_length at least the model's max_length + 1)."""
    sq = cfg.sequential
    width = known[sq.item_feature][1].embedding_dim
    for k, f in enumerate(sq.side_features):
        if f == sq.item_feature or f in sq.context_features or f in sq.side_features[:k]:
            raise FieldError(
                f"sequential.side_features[{k}]", f, "it is already the item feature, a context or a side feature"
            )
        i, t = known[f]
        if not t.sequence:
            raise FieldError(
                f"tables[{i}].pooling",
                t.pooling.value,
                f"table {t.name!r} feeds side feature {f!r}, one id per history position: give it pooling: none",
            )
        if t.embedding_dim != width:
            raise FieldError(
                f"tables[{i}].embedding_dim",
                t.embedding_dim,
                f"table {t.name!r} feeds side feature {f!r}, added to the item vectors: make it the catalog's "
                f"width {width}",
            )
        if t.max_length is not None and t.max_length < sq.max_length + 1:
            raise FieldError(
                f"tables[{i}].max_length",
                t.max_length,
                f"table {t.name!r} feeds side feature {f!r}, one id per history position, but the model reads "
                f"histories of up to sequential.max_length + 1 = {sq.max_length + 1} items: raise it to "
                f"{sq.max_length + 1} or more (or remove it)",
            )
