"""Models built on a ShardedEmbeddingBagCollection: RecModel (build.py) and one file per model kind (dlrm.py,
dcn.py, two_tower.py), each registering its dense part and loss (registry.py). Your own model kind:
`register_model(name, ModelKind(build_dense=..., step=...))` from your code (registry.py, examples/custom_model.py).
"""

from embshard.models.build import RecModel
from embshard.models.registry import ModelKind, StepOutput, bce_output, feature_widths, model_kind, register_model

__all__ = ["ModelKind", "RecModel", "StepOutput", "bce_output", "feature_widths", "model_kind", "register_model"]
