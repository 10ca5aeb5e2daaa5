"""Names shared by the TorchRec adapters: where an EmbeddingBagCollection's tables and their fused-optimizer state
sit in a DistributedModelParallel (DMP) state dict, and how a nested state dict is flattened into the keys of a
torch.distributed.checkpoint (DCP) checkpoint.

A DMP over a model whose EmbeddingBagCollection is at `module_path` (e.g. 'model.sparse_arch.embedding_bag_collection'
for a DLRMTrain, '' for a bare collection) holds table T as `{module_path}.embedding_bags.T.weight`, and its fused
optimizer (`dmp.fused_optimizer.state_dict()`) holds the state of that parameter under the same name, in
`state[param]['T.momentum1']` (the first state: row-wise Adagrad's `[rows]` sum, Adagrad's sum, Adam's first moment)
and `state[param]['T.exp_avg_sq']` (Adam's second moment). DCP flattens `{'model': sd, 'optim': osd}` by joining
the dict keys with '.': 'model.{param}' and 'optim.state.{param}.T.momentum1'. An EmbeddingCollection (sequence
tables) is the same with `embeddings` in place of `embedding_bags`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATE_NAMES = {"m": "momentum1", "v": "exp_avg_sq"}
"""embshard's optimizer-state names (embshard.lookup.updates.optimizer_state) -> TorchRec's (FBGEMM's) state keys."""

GRADIENT_DIVISION = """TorchRec divides the embeddings' gradients by its world size W (torchrec.distributed.comm_ops
gradient division, on by default, to match DDP's averaging of the dense gradients); embshard does not (a table's
gradient is the sum of every rank's loss gradient). So TorchRec's optimizer state is embshard's scaled: Adagrad sums
and Adam's second moment by 1 / W^2, Adam's first moment by 1 / W; checkpoints are converted by these factors.
The same updates take SGD's lr / W, and eps x W for Adagrad, row-wise Adagrad and Adam, in embshard."""


def state_scale(kind: str, state: str, world_size: int) -> float:
    """Factor from TorchRec's optimizer state `state` ('m', 'v') to embshard's, for optimizer `kind`
    (GRADIENT_DIVISION): W^2 for sums of squares, W for Adam's first moment."""
    return float(world_size) if (kind == "adam" and state == "m") else float(world_size) ** 2


def default_world_size(world_size: int | None) -> int:
    """`world_size`, else this job's (1 without a process group)."""
    import torch.distributed as dist

    if world_size is not None:
        return int(world_size)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def join(*parts: str) -> str:
    """Dotted path of the non-empty parts: join('', 'embedding_bags.t.weight') == 'embedding_bags.t.weight'."""
    return ".".join(p.strip(".") for p in parts if p and p.strip("."))


BAGS, SEQUENCES = "embedding_bags", "embeddings"
"""The attribute holding the tables of TorchRec's EmbeddingBagCollection and of its EmbeddingCollection."""


def weight_param(module_path: str, table: str, attr: str = BAGS) -> str:
    """The DMP parameter name of table `table` of the EmbeddingBagCollection (`attr` SEQUENCES: the
    EmbeddingCollection) at `module_path`."""
    return join(module_path, f"{attr}.{table}.weight")


def weight_key(module_path: str, table: str, model_key: str | None, attr: str = BAGS) -> str:
    """The flattened checkpoint key of the table's weights (under `model_key`, e.g. 'model', or at the top)."""
    return join(model_key or "", weight_param(module_path, table, attr))


def state_key(module_path: str, table: str, state: str, optim_key: str | None, attr: str = BAGS) -> str:
    """The flattened checkpoint key of embshard optimizer state `state` ('m' or 'v') of the table."""
    return join(optim_key or "", "state", weight_param(module_path, table, attr), f"{table}.{STATE_NAMES[state]}")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state dict as DCP flattens it: leaves keyed by their dict keys joined with '.'."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
