"""An embshard ShardingPlan of sequence tables as TorchRec's ShardingPlan for an EmbeddingCollection, so that
`DistributedModelParallel` with TorchRec's `EmbeddingCollectionSharder` runs the same placement.

    tr_plan, notes = to_torchrec_ec_plan(plan, module_path="", device_type="cuda", tables=ec)
    save_torchrec_ec_plan("plan.torchrec.json", plan, tables=ec)      # load_torchrec_plan reads it back
    model = DistributedModelParallel(ec, device=device, plan=tr_plan, sharders=[EmbeddingCollectionSharder()])

The plan file and the per-table entries are those of plan_out.py (the same JSON format). TorchRec's
EmbeddingCollectionSharder shards sequence tables data_parallel, table_wise, column_wise or row_wise: a
table_row_wise table is refused (ConfigError naming it). Column-wise tables keep row-wise Adagrad's state per column
block on both sides (ShardedEmbeddingCollection works so). `tables`: the TorchRec model's tables (its
EmbeddingCollection, its EmbeddingConfigs, or embshard sequence TableConfigs), which the plan must place exactly.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from embshard.interop.plan_out import plan_dict, plan_from_dict
from embshard.interop.tables_in import tables_from_torchrec
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, Pooling, TableConfig

EC_TYPES = (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)
"""The sharding types TorchRec's EmbeddingCollectionSharder offers."""


def sequence_tables(tables: Any) -> list[TableConfig]:
    """embshard sequence TableConfigs (pooling none) of a TorchRec EmbeddingCollection or a list of its
    EmbeddingConfigs (converted by `tables_from_torchrec`), or embshard sequence TableConfigs (returned as they are)."""
    given = isinstance(tables, list | tuple) and tables and all(isinstance(t, TableConfig) for t in tables)
    out = list(tables) if given else tables_from_torchrec(tables)
    pooled = [t.name for t in out if t.pooling is not Pooling.NONE]
    if pooled:
        raise ConfigError(
            f"tables {pooled} are pooled: TorchRec's EmbeddingCollection holds sequence tables (pooling: none); "
            "export pooled tables with to_torchrec_plan for an EmbeddingBagCollection"
        )
    return out


def ec_plan_dict(
    plan: ShardingPlan,
    module_path: str = "",
    device_type: str = "cuda",
    optimizer: FusedOptimizerConfig | None = None,
    options: LookupOptions | None = None,
    tables: Any = None,
) -> dict[str, Any]:
    """The plan file's content (plan_out.py) for TorchRec's EmbeddingCollection at `module_path`; ConfigError for a
    sharding type its sharder does not offer, or tables that do not match `tables`."""
    refused = [f"{tp.table} ({tp.sharding_type.value})" for tp in plan.tables if tp.sharding_type not in EC_TYPES]
    if refused:
        raise ConfigError(
            f"tables {refused}: TorchRec's EmbeddingCollectionSharder shards sequence tables "
            f"{[t.value for t in EC_TYPES]} only: plan them with one of these (e.g. row_wise)"
        )
    configs = sequence_tables(tables) if tables is not None else None
    opts = replace(options or LookupOptions(), column_wise_exact=False)  # the sequence collection's state
    return plan_dict(plan, module_path, device_type, optimizer, opts, configs)


def to_torchrec_ec_plan(
    plan: ShardingPlan,
    module_path: str = "",
    device_type: str = "cuda",
    optimizer: FusedOptimizerConfig | None = None,
    options: LookupOptions | None = None,
    *,
    tables: Any,
) -> tuple[Any, list[str]]:
    """(TorchRec `ShardingPlan` for the EmbeddingCollection at `module_path`, notes on what was mapped to the
    nearest TorchRec equivalent); module docstring."""
    data = ec_plan_dict(plan, module_path, device_type, optimizer, options, tables)
    return plan_from_dict(data), data["notes"]


def save_torchrec_ec_plan(path: str | Path, plan: ShardingPlan, module_path: str = "", **kwargs: Any) -> list[str]:
    """Write the plan file (JSON; `load_torchrec_plan` reads it) for the EmbeddingCollection at `module_path`
    (kwargs: as `to_torchrec_ec_plan`, `tables` optional here); its notes."""
    data = ec_plan_dict(plan, module_path, **kwargs)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data["notes"]
