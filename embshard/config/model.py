"""The `model:` section: the embedding tables (embshard.tables.TableConfig) and the dense architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.config.schema import FieldError
from embshard.tables import ConfigError, TableConfig, validate_tables


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
class TwoTowerConfig:
    """Two-tower retrieval: a user tower and an item tower, each an MLP over its group of pooled embeddings."""

    user_features: tuple[str, ...]
    """Sparse features whose pooled embeddings are concatenated into the user tower's input."""
    item_features: tuple[str, ...]
    """Sparse features whose pooled embeddings are concatenated into the item tower's input."""
    user_mlp: tuple[int, ...] = (64, 32)
    """Layer widths of the user tower, in units; the last is the output (dot-product) dimension."""
    item_mlp: tuple[int, ...] = (64, 32)
    """Layer widths of the item tower, in units; the last must equal user_mlp's last."""
    loss: Literal["bce", "softmax"] = "bce"
    """bce: binary cross-entropy of dot(user, item) against the label; softmax: in-batch sampled softmax (every
    row is a positive, the other items of the rank's local batch are its negatives)."""
    temperature: float = 1.0
    """Softmax loss only: logits are dot products divided by this (dimensionless)."""

    def __post_init__(self) -> None:
        for key in ("user_features", "item_features"):
            if not getattr(self, key):
                raise FieldError(key, [], "a tower needs at least one feature")
        positive_ints("user_mlp", self.user_mlp, allow_empty=False)
        positive_ints("item_mlp", self.item_mlp, allow_empty=False)
        if self.user_mlp[-1] != self.item_mlp[-1]:
            raise FieldError(
                "item_mlp",
                list(self.item_mlp),
                f"the towers' output widths must match for a dot product: user_mlp ends in {self.user_mlp[-1]}, "
                f"item_mlp in {self.item_mlp[-1]}",
            )
        if not self.temperature > 0:
            raise FieldError("temperature", self.temperature, "it must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """The model: its embedding tables and its dense architecture."""

    kind: Literal["dlrm", "dlrm_dcnv2", "two_tower"]
    """Architecture: dlrm (dot interaction), dlrm_dcnv2 (low-rank cross network) or two_tower (retrieval)."""
    tables: tuple[TableConfig, ...]
    """The embedding-bag tables; each lists the sparse features that look it up."""
    dlrm: DLRMConfig | None = None
    """Bottom and top MLPs; used by kind dlrm and dlrm_dcnv2 (defaults apply when omitted)."""
    dcn: DCNConfig | None = None
    """Cross network; used by kind dlrm_dcnv2 (defaults apply when omitted)."""
    two_tower: TwoTowerConfig | None = None
    """Towers and loss; required for kind two_tower."""

    def __post_init__(self) -> None:
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
            validate_tables(self.tables)
        except ConfigError as e:
            raise FieldError("tables", [t.name for t in self.tables], str(e)) from None
        if self.kind in ("dlrm", "dlrm_dcnv2") and self.dlrm is None:
            object.__setattr__(self, "dlrm", DLRMConfig())
        if self.kind == "dlrm_dcnv2" and self.dcn is None:
            object.__setattr__(self, "dcn", DCNConfig())
        unused = {
            "dlrm": self.kind == "two_tower",
            "dcn": self.kind != "dlrm_dcnv2",
            "two_tower": self.kind != "two_tower",
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

    @property
    def features(self) -> list[str]:
        """All sparse features, in table order."""
        return [f for t in self.tables for f in t.feature_names]
