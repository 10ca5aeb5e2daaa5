"""TorchRec's ShardingPlan for an EmbeddingBagCollection as an embshard ShardingPlan: run TorchRec's own placement
on embshard's runtime (or predict it with embshard's cost model), to compare both runtimes on one placement.

    plan = from_torchrec_plan(tr_plan, module_path="model.sparse_arch.embedding_bag_collection")

Per table: the sharding type (the same names), the tier of the compute kernel (fused and dense: hbm, or host where
the shards are placed on the CPU; fused_uvm: uvm; fused_uvm_caching: uvm_caching with its CacheParams' load factor
and algorithm, 0.2 and lru where unset) and the shards of the sharding spec (TorchRec's empty row-wise shards
dropped). The inverse of embshard.interop.plan_out where TorchRec can express the plan (tested round trip).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from embshard.spec.plan import CacheAlgorithm, MemoryTier, Shard, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError

_KERNEL_TIERS = {"fused_uvm": MemoryTier.UVM, "fused_uvm_caching": MemoryTier.UVM_CACHING}


def from_torchrec_plan(
    tr_plan: Any,
    module_path: str = "",
    world_size: int | None = None,
    local_world_size: int | None = None,
    tables: Sequence[Any] | None = None,
    device_type: str | None = None,
) -> ShardingPlan:
    """The embshard plan of the collection at `module_path` in TorchRec's `ShardingPlan` (or of a module plan:
    {table: ParameterSharding}). `world_size`: default read from the plan's row-wise and data-parallel tables
    (which span every rank); a plan without one does not say it: then pass it. `local_world_size`: default
    `world_size`. `tables`: the tables (embshard TableConfigs or TorchRec EmbeddingBagConfigs: their name,
    num_embeddings, embedding_dim), in the order the plan lists them; needed for data-parallel tables, whose
    TorchRec plan has no shape. `device_type` ('cuda' or 'cpu'): where TorchRec computes (fused and dense kernels
    become hbm or host), default read from the shards' placements (a plan of data-parallel tables only: cuda)."""
    module = tr_plan.plan.get(module_path) if hasattr(tr_plan, "plan") else tr_plan
    if module is None:
        raise ConfigError(
            f"the TorchRec plan has no module {module_path!r}; it has {sorted(tr_plan.plan)}: pass the module path "
            "of the EmbeddingBagCollection"
        )
    shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables or []}
    world = _world_size(module, world_size)
    placed = [s.placement.device().type for p in module.values() if p.sharding_spec for s in p.sharding_spec.shards]
    on_cpu = device_type == "cpu" if device_type else bool(placed) and all(d == "cpu" for d in placed)
    order = {name: i for i, name in enumerate(shapes)}
    names = sorted(module, key=lambda n: order.get(n, len(order)))
    out = [_table(name, module[name], world, on_cpu, shapes) for name in names]
    return ShardingPlan(world, local_world_size or world, tuple(out))


def _world_size(module: Any, given: int | None) -> int:
    """The TorchRec job's world size: `given`, checked against the ranks the plan names, or the number of ranks its
    row-wise tables (one block per rank, empty ones included) and data-parallel tables (a replica per rank) span."""
    named: dict[int, str] = {}  # rank -> a table naming it
    spans: dict[str, int] = {}  # table spanning every rank -> the ranks it spans
    for name, p in module.items():
        ranks = list(p.ranks or [])
        if p.sharding_spec is not None:
            ranks += [s.placement.rank() for s in p.sharding_spec.shards]
        for r in ranks:
            named.setdefault(r, name)
        if p.sharding_type in (ShardingType.ROW_WISE.value, ShardingType.DATA_PARALLEL.value) and ranks:
            spans[name] = len(set(ranks))
    if given is not None:
        world = int(given)
        wrong = {r: t for r, t in named.items() if not 0 <= r < world}
        wrong_span = {t: n for t, n in spans.items() if n != world}
        if world < 1 or wrong or wrong_span:
            raise ConfigError(
                f"TorchRec plan: world_size={given!r} does not fit the plan: "
                + (f"tables {sorted(set(wrong.values()))} name ranks {sorted(wrong)}; " if wrong else "")
                + (f"row-wise / data-parallel tables span {wrong_span} ranks; " if wrong_span else "")
                + "pass the world size of the TorchRec job the plan was made for"
            )
        return world
    if len(set(spans.values())) > 1:
        raise ConfigError(
            f"TorchRec plan: its row-wise / data-parallel tables span different numbers of ranks {spans}: TorchRec "
            "spreads them over every rank; pass world_size= to check it against one job"
        )
    if not spans:
        raise ConfigError(
            f"TorchRec plan: no row-wise or data-parallel table spans every rank, so the plan does not say its world "
            f"size (its tables name ranks {sorted(named)}): pass world_size= (the TorchRec job's number of ranks)"
        )
    world = next(iter(spans.values()))
    outside = {r: t for r, t in named.items() if r >= world}
    if outside:
        raise ConfigError(
            f"TorchRec plan: row-wise / data-parallel tables span {world} ranks but tables "
            f"{sorted(set(outside.values()))} name ranks {sorted(outside)}: pass world_size= (the TorchRec job's "
            "number of ranks)"
        )
    return world


def _table(name: str, p: Any, world: int, on_cpu: bool, shapes: dict[str, tuple[int, int]]) -> TablePlan:
    try:
        st = ShardingType(p.sharding_type)
    except ValueError:
        raise ConfigError(
            f"TorchRec plan for table {name!r}: sharding type {p.sharding_type!r} has no embshard equivalent: "
            f"choose one of {[s.value for s in ShardingType]} for it"
        ) from None
    kernel = p.compute_kernel
    if kernel in ("fused", "dense"):
        tier = MemoryTier.HOST if on_cpu else MemoryTier.HBM
    elif kernel in _KERNEL_TIERS:
        tier = _KERNEL_TIERS[kernel]
    else:
        raise ConfigError(
            f"TorchRec plan for table {name!r}: compute kernel {kernel!r} has no embshard tier: embshard has "
            "fused (hbm), fused_uvm (uvm) and fused_uvm_caching (uvm_caching)"
        )
    clf, algorithm = 0.2, CacheAlgorithm.LRU
    cache = getattr(p, "cache_params", None)
    if tier is MemoryTier.UVM_CACHING and cache is not None:
        clf = cache.load_factor if cache.load_factor is not None else clf
        if cache.algorithm is not None:
            algorithm = CacheAlgorithm(cache.algorithm.name.lower())
    if st is ShardingType.DATA_PARALLEL:
        if name not in shapes:
            raise ConfigError(
                f"TorchRec plan for table {name!r}: data_parallel plans carry no table shape: pass the tables, "
                "tables=[TableConfig or EmbeddingBagConfig, ...] (e.g. from embshard.interop.tables_from_torchrec)"
            )
        rows, dim = shapes[name]
        shards = tuple(Shard(r, 0, rows, 0, dim) for r in range(world))
    else:
        shards = tuple(
            Shard(s.placement.rank(), s.shard_offsets[0], s.shard_sizes[0], s.shard_offsets[1], s.shard_sizes[1])
            for s in p.sharding_spec.shards
            if s.shard_sizes[0] > 0 and s.shard_sizes[1] > 0
        )
    return TablePlan(name, st, tier, shards, cache_load_factor=clf, cache_algorithm=algorithm)
