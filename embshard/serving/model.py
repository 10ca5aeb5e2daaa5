"""What serving needs of a model kind: its config rebuilt from plain data, the dense part's width, and how the
pooled embeddings of every feature `[B, sum of widths]` (table order) become the dense part's second input.

Kinds served: those whose score is `dense(dense_BN, sparse_input)` with one logit per sample (dlrm: `[B, F, D]`;
dlrm_dcnv2: `[B, sum of widths]`)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from embshard.config.model import ModelConfig
from embshard.config.schema import Source, build
from embshard.spec.tables import ConfigError


def _dlrm_input(pooled_BS: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return pooled_BS.view(pooled_BS.shape[0], len(cfg.features), cfg.tables[0].embedding_dim)


def _dcn_input(pooled_BS: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return pooled_BS


SPARSE_INPUT: dict[str, Callable[[torch.Tensor, ModelConfig], torch.Tensor]] = {
    "dlrm": _dlrm_input,
    "dlrm_dcnv2": _dcn_input,
}
SUPPORTED_KINDS = tuple(SPARSE_INPUT)
KIND_MODULES = {"dlrm": "embshard.models.dlrm", "dlrm_dcnv2": "embshard.models.dcn"}
"""The file of each served kind: imported alone at load (not every model file, whose imports reach training code)."""


def build_dense(kind: str, cfg: ModelConfig, num_dense: int) -> torch.nn.Module:
    """The dense part of a served kind, built by its registered builder."""
    import importlib

    importlib.import_module(KIND_MODULES[kind])
    from embshard.models.registry import model_kind

    return model_kind(kind).build_dense(cfg, num_dense)


def model_config(data: object, where: str) -> ModelConfig:
    """The ModelConfig of the `model:` section as plain data (a checkpoint's or model.json's)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: no model section")
    return build(ModelConfig, json.loads(json.dumps(data)), "model", Source(where))


def num_dense_of(kind: str, dense: dict[str, torch.Tensor]) -> int:
    """Dense features per sample of a served kind: the input width of its bottom MLP's first layer."""
    w = dense.get("bottom.0.weight")
    if w is None or w.dim() != 2:
        raise ConfigError(f"model.kind {kind!r}: the dense state has no bottom.0.weight [hidden, num_dense]")
    return int(w.shape[1])
