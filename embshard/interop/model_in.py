"""A TorchRec model on embshard's runtime: its EmbeddingBagCollection becomes a ShardedEmbeddingBagCollection on any
embshard plan (with its weights, when materialized), and the rest of the model, unchanged, becomes the dense part of
an embshard RecModel that trains in embshard's TrainPipeline.

    model = rec_model_from_torchrec(DLRM(ebc, ...), plan, device)   # ebc: meta or materialized
    pipeline = TrainPipeline(model, torch.optim.SGD(model.dense_parameters(), lr=0.1))

The TorchRec model must look up its sparse features by calling its one EmbeddingBagCollection on the
KeyedJaggedTensor it is given, as `forward(dense_features, sparse_features)` (TorchRec's DLRM, DLRM_DCN,
DLRM_Projection; for DLRMTrain pass its `.model`). The dense part is a copy of the model in which the collection is
replaced by a pass-through: it receives the KeyedTensor of pooled embeddings that embshard's collection returns (the
same keys, order and widths as TorchRec's) where TorchRec's collection would have returned it. The loss is binary
cross-entropy of the logits (DLRMTrain's). The user's model is left as it was.

A model with one EmbeddingCollection (sequence embeddings) beside its EmbeddingBagCollection is taken too: the
collection's tables become the RecModel's sequence tables (`pooling: none`, served by its ShardedEmbeddingCollection
under the same plan, trained with the same sparse optimizer), and in the dense copy each TorchRec collection is
replaced by a module that returns embshard's output for this batch (the KeyedTensor, and the `{feature:
JaggedTensor}` of the sequence features, as TorchRec's collections return them), whatever the model passes it: the
model's forward gets the batch's KeyedJaggedTensor and may call each collection once, on any of its features.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.interop.tables_in import optimizer_from_torchrec, tables_from_torchrec
from embshard.models.build import RecModel
from embshard.models.registry import ModelKind, StepOutput, bce_output, register_model
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import ConfigError

KIND = "torchrec"


class TorchRecDense(nn.Module):
    """A TorchRec model without its EmbeddingBagCollection: `forward(dense_BN, pooled KeyedTensor)` -> logits `[B]`.
    `model` is the copy (its collection, at `ebc_path`, replaced by nn.Identity)."""

    def __init__(self, model: nn.Module, ebc_path: str) -> None:
        super().__init__()
        self.model = model
        self.ebc_path = ebc_path

    def forward(self, dense_BN: torch.Tensor, pooled: Any) -> torch.Tensor:
        return self.model(dense_BN, pooled).reshape(-1)


class Injected(nn.Module):
    """Stands in for a TorchRec collection in the dense copy: returns the output embshard set for this forward."""

    def __init__(self) -> None:
        super().__init__()
        self.output: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.output is None:
            raise RuntimeError("the collection's output was not set: call the dense part through TorchRecSeqDense")
        return self.output


class TorchRecSeqDense(nn.Module):
    """A TorchRec model without its EmbeddingBagCollection and EmbeddingCollection (each replaced by an `Injected`):
    `forward(dense_BN, kjt, pooled KeyedTensor, {feature: JaggedTensor})` -> logits `[B]`."""

    def __init__(self, model: nn.Module, ebc_path: str, ec_path: str) -> None:
        super().__init__()
        self.model = model
        self.ebc_path, self.ec_path = ebc_path, ec_path

    def forward(self, dense_BN: torch.Tensor, kjt: Any, pooled: Any, sequences: Any) -> torch.Tensor:
        ebc, ec = self.model.get_submodule(self.ebc_path), self.model.get_submodule(self.ec_path)
        ebc.output, ec.output = pooled, dict(sequences)
        try:
            return self.model(dense_BN, kjt).reshape(-1)
        finally:
            ebc.output = ec.output = None


def find_ebc(model: nn.Module) -> tuple[str, nn.Module]:
    """(path, module) of the one TorchRec EmbeddingBagCollection in `model`, which has no other embedding module
    (`find_collections` for one with an EmbeddingCollection too)."""
    path, ebc, ec_path, _ = find_collections(model)
    if ec_path is not None:
        raise ConfigError(
            f"EmbeddingCollection at {ec_path!r} of {type(model).__name__}: sequence embeddings beside the "
            f"EmbeddingBagCollection need rec_model_from_torchrec. {_SUPPORTED}"
        )
    return path, ebc


def find_collections(model: nn.Module) -> tuple[str, nn.Module, str | None, nn.Module | None]:
    """(path, module) of the one TorchRec EmbeddingBagCollection in `model`, then of its one plain EmbeddingCollection
    (None, None without one). Refused, naming the module's path: a model with embedding modules embshard cannot run
    (feature-processed or managed-collision collections, quantized or other collection kinds), and one with no or
    several EmbeddingBagCollections or several EmbeddingCollections."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingBagCollectionInterface,
        EmbeddingCollection,
        EmbeddingCollectionInterface,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    refused = (
        (FeatureProcessedEmbeddingBagCollection, "its feature processors change ids and weights before the lookup"),
        (BaseManagedCollisionEmbeddingCollection, "managed collision remaps raw ids to rows before the lookup"),
    )
    found, sequence = [], []
    for name, m in model.named_modules():
        where = f"{type(m).__name__} at {name or '(the model itself)'!r} of {type(model).__name__}"
        for cls, why in refused:
            if isinstance(m, cls):
                raise ConfigError(f"{where}: {why}. {_SUPPORTED}")
        if isinstance(m, EmbeddingBagCollection):
            found.append((name, m))
        elif isinstance(m, EmbeddingBagCollectionInterface):
            raise ConfigError(f"{where} is not TorchRec's EmbeddingBagCollection. {_SUPPORTED}")
        elif type(m) is EmbeddingCollection:
            sequence.append((name, m))
        elif isinstance(m, EmbeddingCollectionInterface):
            raise ConfigError(f"{where} is not TorchRec's plain EmbeddingCollection. {_SUPPORTED}")
    if len(found) != 1:
        raise ConfigError(
            f"{type(model).__name__} has {len(found)} EmbeddingBagCollections ({[n for n, _ in found]}). {_SUPPORTED}"
        )
    if len(sequence) > 1:
        raise ConfigError(
            f"{type(model).__name__} has {len(sequence)} EmbeddingCollections ({[n for n, _ in sequence]}). "
            f"{_SUPPORTED}"
        )
    ec_path, ec = sequence[0] if sequence else (None, None)
    return found[0][0], found[0][1], ec_path, ec


_SUPPORTED = (
    "embshard takes a model with exactly one plain TorchRec EmbeddingBagCollection (pooled SUM or MEAN tables, "
    "called on the KeyedJaggedTensor), at most one plain EmbeddingCollection beside it, and no other embedding "
    "module; keep this model in TorchRec"
)


def dense_copy(model: nn.Module) -> TorchRecDense:
    """The dense part: a deep copy of `model` without its EmbeddingBagCollection (not copied, left in `model`)."""
    path, ebc = find_ebc(model)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, nn.Identity())
    try:
        dense = copy.deepcopy(model)
    finally:
        setattr(parent, attr, ebc)
    return TorchRecDense(dense, path)


def load_weights(ebc: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy every table's full weights `{table: [rows, dim]}` (e.g. a materialized TorchRec collection's, on every
    rank) into this rank's shards of the ShardedEmbeddingBagCollection `ebc` (any plan)."""
    ebc.drop_caches()  # UVM-caching: written back and emptied before the weights are written
    with torch.no_grad():
        for name, s, w in ebc.local_shards():
            full = weights.get(name)
            if full is None:
                raise ConfigError(f"no weights given for table {name!r}; given: {sorted(weights)}")
            if full.is_meta:
                raise ConfigError(f"table {name!r} is on the meta device: it has no weights to load")
            block = full[s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols]
            w.copy_(block.to(device=w.device, dtype=w.dtype))


def seq_dense_copy(model: nn.Module, ebc_path: str, ec_path: str) -> TorchRecSeqDense:
    """The dense part of a model with both collections: a deep copy with each replaced by an `Injected`."""
    parts = []
    for path in (ebc_path, ec_path):
        parent_path, _, attr = path.rpartition(".")
        parts.append((model.get_submodule(parent_path) if parent_path else model, attr))
    kept = [getattr(parent, attr) for parent, attr in parts]
    try:
        for parent, attr in parts:
            setattr(parent, attr, Injected())
        dense = copy.deepcopy(model)
    finally:
        for (parent, attr), module in zip(parts, kept):
            setattr(parent, attr, module)
    return TorchRecSeqDense(dense, ebc_path, ec_path)


def torchrec_step(model: Any, batch: Any) -> StepOutput:
    """BCE of the TorchRec model's logits, fed the dense features and embshard's pooled KeyedTensor (and, with an
    EmbeddingCollection, the batch's KeyedJaggedTensor and embshard's sequence output)."""
    if model.ec is None:
        return bce_output(model.dense(batch.dense, model.ebc(batch.sparse)), batch.labels)
    kjt = batch.sparse
    sequences = model.sequences(kjt)
    return bce_output(model.dense(batch.dense, kjt, model.ebc(model.pooled(kjt)), sequences), batch.labels)


def _no_builder(cfg: ModelConfig, num_dense: int) -> nn.Module:
    raise ConfigError(
        f"model kind {KIND!r} takes a TorchRec model's dense part: build it with embshard.interop.rec_model_from_torchrec"
    )


register_model(KIND, ModelKind(build_dense=_no_builder, step=torchrec_step))


def rec_model_from_torchrec(
    model: nn.Module,
    plan: ShardingPlan,
    device: torch.device,
    sparse_optimizer: FusedOptimizerConfig | None = None,
    num_dense: int | None = None,
    seed: int = 0,
    options: LookupOptions | None = None,
) -> RecModel:
    """An embshard RecModel of the TorchRec `model` (module docstring) on `plan` (for the collection's tables; see
    embshard.interop.tables_from_torchrec). `sparse_optimizer`: default the optimizer that
    apply_optimizer_in_backward attached to the collection, with TorchRec's updates at the plan's world size
    (`optimizer_from_torchrec(ebc, world_size=plan.world_size)`). `num_dense`: dense features per sample, default the
    input width of the model's `dense_arch`. A materialized collection's weights are loaded; a meta one's tables
    start from embshard's deterministic initialisation (`seed`). A model with an EmbeddingCollection too (module
    docstring): `plan` covers both collections' tables, and the sparse optimizer (the EmbeddingBagCollection's by
    default) trains both."""
    path, ebc, ec_path, ec = find_collections(model)
    tables = tables_from_torchrec(ebc) + (tables_from_torchrec(ec) if ec is not None else [])
    optimizer = sparse_optimizer or optimizer_from_torchrec(ebc, world_size=plan.world_size)
    dense = dense_copy(model) if ec is None else seq_dense_copy(model, path, ec_path)
    if num_dense is None:
        arch = getattr(model, "dense_arch", None)
        linears = [m for m in (arch.modules() if arch is not None else []) if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError(f"{type(model).__name__} has no dense_arch to read the dense width from: pass num_dense")
        num_dense = linears[0].in_features
    cfg = ModelConfig(kind=KIND, tables=tuple(tables))
    rec = RecModel(cfg, num_dense, plan, optimizer, device, plan.world_size, seed, options, dense=dense)
    weights = {name: bag.weight for name, bag in ebc.embedding_bags.items()}
    if not any(w.is_meta for w in weights.values()):
        load_weights(rec.ebc, weights)
    if ec is not None:
        rows = {name: emb.weight for name, emb in ec.embeddings.items()}
        if not any(w.is_meta for w in rows.values()):
            load_weights(rec.ec, rows)
    return rec
