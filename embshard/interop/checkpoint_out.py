"""An embshard model as a checkpoint that TorchRec's DistributedModelParallel loads (DCP, TorchRec's keys).

    save_torchrec_checkpoint(path, model, module_path="model")    # collective: every rank writes its shards

and, in the TorchRec job (any plan, any world size; DCP reshards):

    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)        # in place, into the DMP's shards
    dmp.load_state_dict(state["model"])

An embshard checkpoint exports the same way: load it into a model on any plan (`Checkpointer.resume` or
`embshard.checkpoint.load_checkpoint`), then save it here. `model` is a RecModel from `rec_model_from_torchrec`
(tables and the TorchRec dense part; `module_path`: where that TorchRec model sits in the module DMP wraps) or a
ShardedEmbeddingBagCollection (`module_path`: the path of TorchRec's EmbeddingBagCollection).

Written: every table's weights `[rows, dim]` (each rank its blocks; a data-parallel table from rank 0) and the
fused optimizer's state where TorchRec's fused optimizer keeps it: per-element state (Adagrad, Adam's moments) as
`[rows, dim]`, row-wise Adagrad's as `[rows]`, or for a table that TorchRec shards column-wise (in `torchrec_plan`,
default embshard's own plan) `[rows * blocks]`, block-major: each block gets embshard's per-row state (exact mode:
TorchRec's blocks then start equal, and drift apart as TorchRec trains them) or its own block's (the same blocks
only). Not written, and returned as notes: data-parallel tables' optimizer state (TorchRec keeps it outside the
fused optimizer), Adam's step count, the dense optimizer's state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from embshard.checkpoint.layout import PER_BLOCK, Piece, column_blocks, row_state_layout
from embshard.checkpoint.storage import PieceSavePlanner, writer
from embshard.interop.checkpoint_in import _targets
from embshard.interop.common import default_world_size, join, state_key, state_scale, weight_key
from embshard.spec.optim import OptimizerKind
from embshard.spec.plan import ShardingType
from embshard.spec.tables import ConfigError


def _torchrec_blocks(torchrec_plan: Any, ebc_path: str, table: str, default: list, dim: int) -> list[tuple[int, int]]:
    """The column blocks (first column, width) TorchRec gives `table` under `torchrec_plan` (default: `default`)."""
    if torchrec_plan is None:
        return default
    module = torchrec_plan.plan.get(ebc_path) if hasattr(torchrec_plan, "plan") else torchrec_plan
    p = module[table]
    if p.sharding_type != "column_wise":
        return [(0, dim)]
    return sorted({(s.shard_offsets[1], s.shard_sizes[1]) for s in p.sharding_spec.shards})


def save_torchrec_checkpoint(
    path: str | os.PathLike,
    source: Any,
    module_path: str = "",
    *,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
    torchrec_plan: Any = None,
    torchrec_world_size: int | None = None,
    gradient_division: bool = True,
) -> list[str]:
    """Write `source`'s tables, their fused-optimizer state and (RecModel) dense part as a DCP checkpoint under
    TorchRec's keys (module docstring). Collective. `torchrec_plan`: the TorchRec ShardingPlan the checkpoint will
    be loaded under (only column-wise tables' row-wise Adagrad layout depends on it). The optimizer state is
    converted to TorchRec's gradient scale (embshard.interop.common.GRADIENT_DIVISION) for a TorchRec job of
    `torchrec_world_size` ranks (default: this job's; `gradient_division=False`: none), in a copy of this rank's
    state. Returns notes on what is not written."""
    ebc, ebc_path, dense = _targets(source, module_path)
    ws = default_world_size(torchrec_world_size) if gradient_division else 1
    configs = {t.name: t for t in ebc.tables}
    pieces: list[Piece] = []
    notes: set[str] = set()
    for (name, sh, w), (_, _, state) in zip(ebc.local_shards(), ebc.local_optimizer_states()):
        tp, (R, D) = ebc.plan[name], (configs[name].num_embeddings, configs[name].embedding_dim)
        if tp.sharding_type is ShardingType.DATA_PARALLEL:
            if state:
                notes.add(f"table {name!r} (data_parallel): its optimizer state is not written (TorchRec keeps none)")
            if ebc.rank == 0:
                pieces.append(Piece(weight_key(ebc_path, name, model_key), (R, D), (0, 0), w))
            continue
        pieces.append(Piece(weight_key(ebc_path, name, model_key), (R, D), (sh.row_offset, sh.col_offset), w))
        for k, s in state.items():
            skey = state_key(ebc_path, name, k, optim_key)
            factor = state_scale(ebc.optimizer.kind.value, k, ws)
            s = s if factor == 1 else s / factor  # noqa: PLW2901 (a copy on TorchRec's scale)
            if s.dim() == 2:
                pieces.append(Piece(skey, (R, D), (sh.row_offset, sh.col_offset), s))
                continue
            mine = column_blocks(tp)
            blocks = _torchrec_blocks(torchrec_plan, ebc_path, name, mine, D)
            n = len(blocks)
            if row_state_layout(tp, ebc.optimizer, ebc.options) == PER_BLOCK:
                if blocks != mine:
                    raise ConfigError(
                        f"table {name!r}: its row-wise Adagrad state is kept per column block {mine}, but TorchRec's "
                        f"plan cuts it into {blocks}: export under a plan with the same column blocks"
                    )
                pieces.append(Piece(skey, (R * n,), (blocks.index((sh.col_offset, sh.num_cols)) * R,), s))
            elif tp.sharding_type is not ShardingType.COLUMN_WISE or sh.col_offset == 0:
                if n > 1:
                    notes.add(f"table {name!r}: each of TorchRec's {n} column blocks starts from the per-row state")
                r0 = 0 if tp.sharding_type is ShardingType.COLUMN_WISE else sh.row_offset
                pieces += [Piece(skey, (R * n,), (b * R + r0,), s) for b in range(n)]
    if ebc.optimizer.kind is OptimizerKind.ADAM:
        notes.add("Adam's step count is not written: TorchRec's bias correction restarts")
    plain = {}
    if dense is not None:
        plain = {join(model_key or "", module_path, k): v for k, v in dense.model.state_dict().items()}
        notes.add("the dense optimizer's state is not written: save it from the TorchRec side's own optimizer")
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(plain, storage_writer=writer(Path(path), io_threads=1), planner=PieceSavePlanner(pieces))
    return sorted(notes)
