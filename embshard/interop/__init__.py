"""Adopting embshard one piece at a time alongside TorchRec (docs/torchrec.md).

- plan_out.py: an embshard plan as TorchRec's ShardingPlan, and the JSON plan file (`load_torchrec_plan`)
- plan_ec.py: an embshard plan of sequence tables as TorchRec's ShardingPlan for an EmbeddingCollection
- plan_file.py: the plan file checked field by field, and a plan checked against the TorchRec model's tables
- plan_in.py: TorchRec's ShardingPlan as an embshard plan
- tables_in.py: EmbeddingBagConfig, ParameterConstraints and the fused optimizer as embshard's configuration
- model_in.py: a TorchRec model (DLRM, DLRM_DCN, ...) as an embshard RecModel on any plan, with its weights
- checkpoint_in.py: a TorchRec DMP checkpoint (DCP, or state dicts) into an embshard model on any plan
- checkpoint_world.py: the world size of the TorchRec job that saved a DCP checkpoint, from its index
- checkpoint_out.py: an embshard model as a DCP checkpoint that TorchRec's DMP loads

Names are imported on first use (torchrec is imported only by the functions that need it).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "to_torchrec_plan": "plan_out",
    "save_torchrec_plan": "plan_out",
    "load_torchrec_plan": "plan_out",
    "to_torchrec_ec_plan": "plan_ec",
    "save_torchrec_ec_plan": "plan_ec",
    "from_torchrec_plan": "plan_in",
    "tables_from_torchrec": "tables_in",
    "constraints_from_torchrec": "tables_in",
    "with_pooling_factors": "tables_in",
    "optimizer_from_torchrec": "tables_in",
    "rec_model_from_torchrec": "model_in",
    "load_weights": "model_in",
    "load_torchrec_checkpoint": "checkpoint_in",
    "load_torchrec_state_dict": "checkpoint_in",
    "save_torchrec_checkpoint": "checkpoint_out",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'embshard.interop' has no attribute {name!r}")
    return getattr(importlib.import_module(f"embshard.interop.{_NAMES[name]}"), name)
