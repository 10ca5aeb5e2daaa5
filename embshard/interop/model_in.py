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


def find_ebc(model: nn.Module) -> tuple[str, nn.Module]:
    """(path, module) of the one TorchRec EmbeddingBagCollection in `model`. Refused, naming the module's path: a
    model with embedding modules embshard cannot run (feature-processed or managed-collision collections, sequence
    EmbeddingCollections, quantized or other EmbeddingBagCollection kinds), and one with no or several collections."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingBagCollectionInterface,
        EmbeddingCollectionInterface,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    refused = (
        (FeatureProcessedEmbeddingBagCollection, "its feature processors change ids and weights before the lookup"),
        (BaseManagedCollisionEmbeddingCollection, "managed collision remaps raw ids to rows before the lookup"),
        (EmbeddingCollectionInterface, "sequence embeddings (one per id, not pooled) are not supported yet"),
    )
    found = []
    for name, m in model.named_modules():
        where = f"{type(m).__name__} at {name or '(the model itself)'!r} of {type(model).__name__}"
        for cls, why in refused:
            if isinstance(m, cls):
                raise ConfigError(f"{where}: {why}. {_SUPPORTED}")
        if isinstance(m, EmbeddingBagCollection):
            found.append((name, m))
        elif isinstance(m, EmbeddingBagCollectionInterface):
            raise ConfigError(f"{where} is not TorchRec's EmbeddingBagCollection. {_SUPPORTED}")
    if len(found) != 1:
        raise ConfigError(
            f"{type(model).__name__} has {len(found)} EmbeddingBagCollections ({[n for n, _ in found]}). {_SUPPORTED}"
        )
    return found[0]


_SUPPORTED = (
    "embshard takes a model with exactly one plain TorchRec EmbeddingBagCollection (pooled SUM or MEAN tables, "
    "called on the KeyedJaggedTensor) and no other embedding module; keep this model in TorchRec"
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


def torchrec_step(model: Any, batch: Any) -> StepOutput:
    """BCE of the TorchRec model's logits, fed the dense features and embshard's pooled KeyedTensor."""
    return bce_output(model.dense(batch.dense, model.ebc(batch.sparse)), batch.labels)


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
    start from embshard's deterministic initialisation (`seed`)."""
    path, ebc = find_ebc(model)
    tables = tables_from_torchrec(ebc)
    optimizer = sparse_optimizer or optimizer_from_torchrec(ebc, world_size=plan.world_size)
    dense = dense_copy(model)
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
    return rec
