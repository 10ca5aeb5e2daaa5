"""An embshard ShardingPlan as TorchRec's ShardingPlan for an EmbeddingBagCollection, and the plan file that carries it.

    tr_plan, notes = to_torchrec_plan(plan, module_path="model.sparse_arch.embedding_bag_collection")
    save_torchrec_plan("plan.torchrec.json", plan, module_path=...)    # or: embshard plan ... --format torchrec
    tr_plan = load_torchrec_plan("plan.torchrec.json")                 # in the TorchRec script: one call
    model = DistributedModelParallel(module, device=device, plan=tr_plan)

Per table, one `ParameterSharding`: the sharding type (the same names), the compute kernel of the tier (hbm: fused,
uvm: fused_uvm, uvm_caching: fused_uvm_caching with `CacheParams(algorithm, load_factor)`; data-parallel: dense),
the ranks and an `EnumerableShardingSpec` of one `ShardMetadata` per shard (offsets, sizes, placement
'rank:{r}/cuda:{r % local_world_size}', or 'rank:{r}/cpu' for a CPU job). TorchRec routes row-wise ids to rank
`id // ceil(rows / ranks)`: row-wise and table-row-wise blocks are embshard's canonical ones (embshard.spec.geometry),
with TorchRec's empty shards added where a small table has fewer blocks than ranks.

What TorchRec cannot express maps to its nearest equivalent, and each such choice is returned as a note: the
small-table kernel (TorchRec uses FBGEMM's TBE), the host tier on GPUs (fused_uvm: weights in host memory, lookup on
the GPU), UVM tiers in a CPU job (fused), column-wise row-wise Adagrad's exact per-row state (TorchRec keeps a state
per column block) and data-parallel training (TorchRec's DDP averages the replicas' gradients over ranks).

The file is JSON (no pickle): {"format": "torchrec-sharding-plan", "version": 1, "world_size", "local_world_size",
"device_type", "modules": {module_path: {table: {"sharding_type", "compute_kernel", "ranks", "shards": [{"rank",
"offsets", "sizes"}], "cache_params": {"algorithm", "load_factor"} or null}}}, "notes": [...]}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embshard.interop.plan_file import DEVICE_TYPES, FORMAT, VERSION, check_plan_file, check_tables
from embshard.spec.geometry import row_blocks
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import LookupOptions
from embshard.spec.plan import LookupKernel, MemoryTier, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError

_GPU_KERNELS = {
    MemoryTier.HBM: "fused",
    MemoryTier.UVM: "fused_uvm",
    MemoryTier.UVM_CACHING: "fused_uvm_caching",
    MemoryTier.HOST: "fused_uvm",
}


def plan_dict(
    plan: ShardingPlan,
    module_path: str = "",
    device_type: str = "cuda",
    optimizer: FusedOptimizerConfig | None = None,
    options: LookupOptions | None = None,
    tables: Any = None,
) -> dict[str, Any]:
    """The plan file's content (module docstring) for an EmbeddingBagCollection at `module_path` of the model DMP
    wraps, on `device_type` ('cuda' or 'cpu'); `optimizer` and `options` (optional) add the notes that depend on
    them. `tables` (optional): the TorchRec model's tables (its EmbeddingBagCollection, EmbeddingBagConfigs or
    embshard TableConfigs), checked against the plan (names and shapes). Raises ConfigError for a row-wise
    placement TorchRec cannot route (non-canonical blocks)."""
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"device_type={device_type!r} is invalid: TorchRec plans here are for {DEVICE_TYPES}")
    if tables is not None:
        check_tables(plan, tables)
    if plan.sharding_group_size is not None and plan.num_replicas > 1:
        raise ConfigError(
            f"the plan is 2D (sharding_group_size={plan.sharding_group_size}); a TorchRec plan holds one sharding "
            "group: export `plan.group_plan()` (and wrap the model in TorchRec's DMPCollection for the replicas)"
        )
    notes: list[str] = []
    tables = {
        tp.table: _table(tp, plan, device_type, optimizer, options or LookupOptions(), notes) for tp in plan.tables
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": plan.world_size,
        "local_world_size": plan.local_world_size,
        "device_type": device_type,
        "modules": {module_path: tables},
        "notes": notes,
    }


def _table(
    tp: TablePlan,
    plan: ShardingPlan,
    device_type: str,
    optimizer: FusedOptimizerConfig | None,
    options: LookupOptions,
    notes: list[str],
) -> dict[str, Any]:
    name, st = tp.table, tp.sharding_type
    if tp.kernel is LookupKernel.SMALL:
        notes.append(
            f"table {name!r}: kernel 'small' (embshard's small-table kernel) has no TorchRec equivalent: TorchRec "
            "looks it up with FBGEMM's TBE"
        )
    if st is ShardingType.DATA_PARALLEL:
        kernel = "dense"
        notes.append(
            f"table {name!r}: data_parallel: TorchRec trains the replicas with its dense kernel under DDP, the "
            "optimizer applied outside FBGEMM (embshard: a fused kernel)"
        )
    elif device_type == "cpu":
        kernel = "fused"
        if tp.tier in (MemoryTier.UVM, MemoryTier.UVM_CACHING):
            notes.append(f"table {name!r}: tier {tp.tier.value!r} on the CPU: TorchRec's CPU kernel is 'fused'")
    else:
        kernel = _GPU_KERNELS[tp.tier]
        if tp.tier is MemoryTier.HOST:
            notes.append(
                f"table {name!r}: tier 'host' (host memory, CPU lookup) has no TorchRec GPU kernel: mapped to "
                "fused_uvm (host memory, GPU lookup)"
            )
    if (
        st is ShardingType.COLUMN_WISE
        and optimizer is not None
        and optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD
        and options.column_wise_exact
        and tp.tier is not MemoryTier.UVM_CACHING
    ):
        notes.append(
            f"table {name!r}: column_wise with rowwise_adagrad: embshard keeps the exact per-row state "
            "(column_wise_exact); TorchRec keeps one state per column block, so its updates differ slightly "
            "(LookupOptions(column_wise_exact=False) trains as TorchRec does)"
        )
    shards = sorted(tp.shards, key=lambda s: (s.row_offset, s.col_offset))
    entries = [
        {"rank": s.rank, "offsets": [s.row_offset, s.col_offset], "sizes": [s.num_rows, s.num_cols]} for s in shards
    ]
    if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        entries = _row_entries(tp, plan, entries)
    cache = None
    if kernel == "fused_uvm_caching":
        cache = {"algorithm": tp.cache_algorithm.value, "load_factor": tp.cache_load_factor}
    ranks = [e["rank"] for e in entries] if st is not ShardingType.DATA_PARALLEL else list(range(plan.world_size))
    return {
        "sharding_type": st.value,
        "compute_kernel": kernel,
        "ranks": ranks,
        "shards": entries if st is not ShardingType.DATA_PARALLEL else None,
        "cache_params": cache,
    }


def _row_entries(tp: TablePlan, plan: ShardingPlan, entries: list[dict]) -> list[dict]:
    """Row blocks as TorchRec routes them: block i of size ceil(rows / n) on the i-th rank of the group (every rank,
    or the host's ranks), empty shards on the group's ranks past the last block."""
    rows, dim = sum(e["sizes"][0] for e in entries), entries[0]["sizes"][1]
    if tp.sharding_type is ShardingType.ROW_WISE:
        group = list(range(plan.world_size))
    else:
        host = entries[0]["rank"] // plan.local_world_size
        group = list(range(host * plan.local_world_size, (host + 1) * plan.local_world_size))
    want = row_blocks(rows, len(group))
    got = [(e["rank"], e["sizes"][0]) for e in entries]
    if got != list(zip(group, want)):
        raise ConfigError(
            f"plan for table {tp.table!r} ({tp.sharding_type.value}): TorchRec routes id i to the "
            f"(i // ceil(rows / {len(group)}))-th rank of {group}, so it needs the blocks (rank, rows) "
            f"{list(zip(group, want))}, but this plan has {got}: cut the table with embshard.spec.geometry.row_blocks on "
            "the ranks in order (as embshard's planner does)"
        )
    return entries + [{"rank": r, "offsets": [rows, 0], "sizes": [0, dim]} for r in group[len(entries) :]]


def plan_from_dict(data: dict[str, Any], device_type: str | None = None, where: str = "TorchRec plan") -> Any:
    """TorchRec's `ShardingPlan` from the plan file's content, checked field by field first (ConfigError naming
    `where`, e.g. the file, and the field); `device_type` overrides the file's ('cpu' runs a GPU plan in a CPU
    job, e.g. a test)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, ParameterSharding
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan

    check_plan_file(data, where)
    device = device_type or data["device_type"]
    if device not in DEVICE_TYPES:
        raise ConfigError(f"device_type={device!r} is invalid: choose one of {DEVICE_TYPES}")
    local = int(data["local_world_size"])

    def placement(rank: int) -> str:
        return f"rank:{rank}/cpu" if device == "cpu" else f"rank:{rank}/cuda:{rank % local}"

    modules = {}
    for path, tables in data["modules"].items():
        params = {}
        for name, t in tables.items():
            kernel = t["compute_kernel"]
            if device == "cpu" and kernel != "dense":
                kernel = "fused"  # TorchRec's only sharded kernel on the CPU
            spec = None
            if t["shards"] is not None:
                spec = EnumerableShardingSpec(
                    [ShardMetadata(list(s["offsets"]), list(s["sizes"]), placement(s["rank"])) for s in t["shards"]]
                )
            cache = None
            if t["cache_params"] is not None and kernel == "fused_uvm_caching":
                algorithm = {"lru": CacheAlgorithm.LRU, "lfu": CacheAlgorithm.LFU}[t["cache_params"]["algorithm"]]
                cache = CacheParams(algorithm=algorithm, load_factor=float(t["cache_params"]["load_factor"]))
            params[name] = ParameterSharding(
                sharding_type=t["sharding_type"],
                compute_kernel=kernel,
                ranks=list(t["ranks"]),
                sharding_spec=spec,
                cache_params=cache,
            )
        modules[path] = EmbeddingModuleShardingPlan(params)
    return TorchRecPlan(modules)


def to_torchrec_plan(
    plan: ShardingPlan,
    module_path: str = "",
    device_type: str = "cuda",
    optimizer: FusedOptimizerConfig | None = None,
    options: LookupOptions | None = None,
    *,
    tables: Any,
) -> tuple[Any, list[str]]:
    """(TorchRec `ShardingPlan` for the EmbeddingBagCollection at `module_path`, notes on what was mapped to the
    nearest TorchRec equivalent). `tables`: the TorchRec model's tables (its EmbeddingBagCollection, its
    EmbeddingBagConfigs, or embshard TableConfigs), which the plan must place exactly (names and shapes):
    ConfigError naming the tables otherwise."""
    data = plan_dict(plan, module_path, device_type, optimizer, options, tables)
    return plan_from_dict(data), data["notes"]


def save_torchrec_plan(path: str | Path, plan: ShardingPlan, module_path: str = "", **kwargs: Any) -> list[str]:
    """Write the plan file (JSON) for the collection at `module_path` (kwargs: as `to_torchrec_plan`, `tables`
    optional here); its notes."""
    data = plan_dict(plan, module_path, **kwargs)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data["notes"]


def load_torchrec_plan(path: str | Path, device_type: str | None = None) -> Any:
    """TorchRec's `ShardingPlan` from a plan file (`embshard plan ... --format torchrec --out FILE`), ready for
    `DistributedModelParallel(module, plan=...)`. `device_type` ('cuda' or 'cpu') overrides the file's."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the plan file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not a JSON plan file ({e}); write one with `embshard plan ... --format torchrec`"
        ) from None
    return plan_from_dict(data, device_type, str(path))
