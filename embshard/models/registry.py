"""Model kinds: what each kind of model adds to the sharded embeddings, looked up by the config's `model.kind`.

A kind is one file of this package that registers itself when imported:

    register("dlrm", ModelKind(build_dense=dlrm_dense, step=dlrm_step))

RecModel (build.py) asks the kind for the feature groups the embeddings hand over (`output_groups`), for a table it
serves as a retrieval catalog in a collection of its own (`build_catalog`, embshard.retrieval), builds the kind's
dense part (`build_dense`) and computes a batch's loss with the kind's `step(model, batch)`, which runs the
model's collections and dense part.

Your own model, from your own code (no file of embshard changes; examples/custom_model.py):

    register_model("my_model", ModelKind(build_dense=my_dense, step=my_step, output_groups=my_groups))
    model = RecModel(ModelConfig(kind="my_model", tables=tables), num_dense, plan, sparse_optimizer, device, world)

A built-in kind is one file of this package with a config section of its own (embshard.config.model); the
package's files are imported on the first lookup.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embshard.config.model import BUILTIN_KINDS, ModelConfig, add_model_kind
from embshard.data.common import Batch
from embshard.spec.tables import ConfigError


@dataclass
class StepOutput:
    """A step's mean loss, the scores and 0/1 labels that the AUC is computed on (None: no AUC), and in evaluation
    in catalog mode {K: local samples whose item is among the catalog's K best-scored items}."""

    loss: torch.Tensor
    scores: torch.Tensor | None
    labels: torch.Tensor | None
    hits: dict[int, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Evaluation: {name: sum over the local samples} of per-sample metrics (e.g. hr@10); reported as the mean
    over every rank's samples."""
    dense_updated: bool = False
    """The dense parameters are already updated (a replayed CUDA graph did the step): backward of `loss` only."""
    updated: bool = False
    """Every parameter is already updated (the whole step ran as one graph, embshard/training/step_graph.py): no backward."""


@dataclass(frozen=True)
class ModelKind:
    """How one kind of model is built on the sharded embeddings and scored."""

    build_dense: Callable[[ModelConfig, int], nn.Module]
    """(model config, dense features per sample) -> the dense part (wrapped in DistributedDataParallel later)."""
    step: Callable[[Any, Batch], StepOutput]
    """(the RecModel: its `ebc`, `dense`, `catalog`, `cfg`, `training`; a batch) -> the loss (and scores). With
    sequence tables (`pooling: none`) the step hands `ebc` the pooled features, `model.ebc(model.pooled(kjt))`, and
    reads the sequence features' rows with `model.sequences(kjt)` (a SequenceOutput; on every rank every step)."""
    output_groups: Callable[[ModelConfig], dict[str, list[str]]] | None = None
    """Feature groups the embeddings return, one tensor each (None: one KeyedTensor of every feature)."""
    build_catalog: Callable[..., nn.Module | None] | None = None
    """(model config, plan, sparse optimizer, device, seed) -> a retrieval Catalog serving one table in a
    collection of its own (left out of `ebc`), or None."""
    sparse_input: Callable[[Any, Batch], torch.Tensor] | None = None
    """(the RecModel, a batch) -> the dense part's second input, for kinds whose step is
    `bce_output(model.dense(batch.dense, sparse_input(model, batch)), batch.labels)`: their dense step can be
    replayed as a CUDA graph (training.cuda_graph)."""


_KINDS: dict[str, ModelKind] = {}


def register(name: str, kind: ModelKind) -> None:
    """Make `kind` the model of `model.kind: name` (called by the kind's file when it is imported)."""
    if name in _KINDS and _KINDS[name] is not kind:
        raise ValueError(f"model kind {name!r} is registered twice")
    _KINDS[name] = kind
    add_model_kind(name)  # ModelConfig(kind=name) accepts it from now on


def register_model(name: str, kind: ModelKind) -> None:
    """Make `kind` the model of `ModelConfig(kind=name)` (and of `model.kind: name` in a YAML config read later in
    this process): your own dense part and loss on embshard's sharded embeddings, registered from your code.

    Register at the top level of a module that every process imports (for processes started with `spawn`, the
    script itself), before building the model. Registering a name again replaces the earlier registration (a
    notebook re-running its cell); the built-in kinds cannot be replaced."""
    if not isinstance(kind, ModelKind):
        raise TypeError(f"register_model({name!r}, ...) takes a ModelKind(build_dense=..., step=...), not {kind!r}")
    if not name or not isinstance(name, str) or name in BUILTIN_KINDS:
        raise ConfigError(
            f"register_model: the name {name!r} is invalid: give a non-empty string other than the built-in kinds "
            f"{list(BUILTIN_KINDS)}"
        )
    _KINDS[name] = kind
    add_model_kind(name)


def model_kind(name: str) -> ModelKind:
    """The registered kind `name`; the first lookup imports every file of embshard/models."""
    if name not in _KINDS:
        for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
            importlib.import_module(f"{__package__}.{module.name}")
    if name not in _KINDS:
        raise ConfigError(
            f"model.kind={name!r} has no model: known kinds are {sorted(_KINDS)}; register your own with "
            "embshard.models.register_model(name, ModelKind(...)) before building the model"
        )
    return _KINDS[name]


def feature_widths(cfg: ModelConfig) -> dict[str, int]:
    """Sparse feature -> the width of its pooled embedding (its table's embedding_dim), in table order."""
    return {f: t.embedding_dim for t in cfg.tables for f in t.feature_names}


def bce_output(logits_B: torch.Tensor, labels_B: torch.Tensor) -> StepOutput:
    """Binary cross-entropy of one logit per sample against its 0/1 label (mean over the samples; an empty batch,
    which a rank feeds while others still have data, gives 0 and zero gradients)."""
    if logits_B.shape[0] == 0:
        return StepOutput(logits_B.sum() * 0.0, logits_B, labels_B)
    return StepOutput(nn.functional.binary_cross_entropy_with_logits(logits_B, labels_B), logits_B, labels_B)
