"""Sharding options: the ways one table may be placed (sharding type x tier x number of blocks), which of them a
table's constraints and the topology allow, their forms with embshard's small-table kernel (`small_form`), and the
shards an option gives on chosen ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np

from embshard.planner.constraints import ParameterConstraints
from embshard.planner.kernel_model import eligible
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.spec.geometry import column_blocks, offsets, row_blocks, row_runs, runs
from embshard.spec.plan import LookupKernel, MemoryTier, Shard, ShardingType
from embshard.spec.raw_ids import RAW_SHARDING_TYPES, RAW_TIERS, sharding_refused, small_block_refused
from embshard.spec.tables import ConfigError, TableConfig

MIN_COLUMN_BLOCK = 16  # narrowest column block the planner proposes on its own (columns)
MAX_COLUMN_SHARDS = 8  # most column blocks it proposes on its own (row-wise spreads wider tables further)

GPU_TIERS = (MemoryTier.HBM, MemoryTier.UVM_CACHING, MemoryTier.UVM)
TYPE_ORDER = (
    ShardingType.TABLE_WISE,
    ShardingType.DATA_PARALLEL,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.ROW_WISE,
)


@dataclass(frozen=True)
class Option:
    """One way to place a table."""

    sharding: ShardingType
    """Sharding type."""
    tier: MemoryTier
    """Memory tier of every shard."""
    parts: int = 1
    """Column blocks (column-wise), row blocks asked for (row-wise kinds), 1 (table-wise), world size (DP)."""
    cache_load_factor: float = 0.0
    """UVM-caching cache size (fraction of rows); 0 for other tiers."""
    kernel: LookupKernel = LookupKernel.FBGEMM
    """Lookup kernel of its shards (kernel_choice.py gives small tables 'small' forms of their options)."""
    raw: bool = False
    """Whether the table has raw ids (ids: raw): its shards form lookup groups of their own, each with its remap's
    launches (CostModel.group_fixed)."""

    @property
    def label(self) -> str:
        """Short text, e.g. 'column_wise/4 hbm', 'table_wise uvm_caching(0.2)' or 'data_parallel hbm small'."""
        kind = self.sharding.value
        if self.sharding is ShardingType.COLUMN_WISE:
            kind += f"/{self.parts}"
        tier = self.tier.value
        if self.tier is MemoryTier.UVM_CACHING:
            tier += f"({self.cache_load_factor:g})"
        return f"{kind} {tier}" + (" small" if self.kernel is LookupKernel.SMALL else "")


def table_options(
    table: TableConfig,
    constraint: ParameterConstraints,
    topology: Topology,
    settings: PlannerSettings,
    colocated: bool = False,
) -> list[Option]:
    """Every option the constraints, settings and topology allow for `table`, in a fixed order. Raises
    ConfigError (naming the table and constraints) when none is left."""
    W = topology.world_size
    types = _allowed(TYPE_ORDER, constraint.sharding_types, settings.sharding_types)
    tiers = GPU_TIERS if topology.is_gpu else (MemoryTier.HOST,)
    tiers = _allowed(tiers, constraint.tiers, settings.tiers)
    if table.raw_ids:  # its id -> row map lives with whole rows, re-initialised in place (spec/raw_ids.py)
        if constraint.sharding_types and not set(constraint.sharding_types) & set(RAW_SHARDING_TYPES):
            raise ConfigError(sharding_refused(table, constraint.sharding_types[0]))
        types = tuple(t for t in types if t in RAW_SHARDING_TYPES)
        tiers = tuple(t for t in tiers if t in RAW_TIERS)
    pinned = set(constraint.ranks)
    everyone = not pinned or pinned == set(range(W))
    clf = constraint.cache_load_factor or settings.cache_load_factor
    out: list[Option] = []
    refused = None  # a raw-id table's row-wise blocks of fewer than 2 rows
    for st in types:
        if colocated and st is not ShardingType.TABLE_WISE:
            continue
        if st is ShardingType.TABLE_WISE:
            parts_list = [1]
        elif W == 1:
            continue
        elif st is ShardingType.DATA_PARALLEL:
            parts_list = [W] if everyone else []
        elif st is ShardingType.ROW_WISE:
            parts_list = [W] if everyone else []
        elif st is ShardingType.TABLE_ROW_WISE:
            lws = topology.local_world_size
            hosts_ok = any(
                pinned >= set(range(h * lws, (h + 1) * lws)) or not pinned for h in range(topology.num_hosts)
            )
            parts_list = [lws] if topology.num_hosts > 1 and lws > 1 and hosts_ok else []
        else:
            parts_list = _column_parts(table, constraint, W, len(pinned) if pinned else W)
        if table.raw_ids and st is ShardingType.ROW_WISE:
            small = [p for p in parts_list if small_block_refused(table, row_blocks(table.num_embeddings, p))]
            refused = refused or (small and small_block_refused(table, row_blocks(table.num_embeddings, small[0])))
            parts_list = [p for p in parts_list if p not in small]
        for parts in parts_list:
            for tier in tiers:
                if st is ShardingType.DATA_PARALLEL and tier not in (MemoryTier.HBM, MemoryTier.HOST):
                    continue
                if st is ShardingType.COLUMN_WISE and tier is MemoryTier.UVM and not constraint.column_shards:
                    continue  # duplicated ids over the host link: never better than table-wise UVM
                out.append(Option(st, tier, parts, clf if tier is MemoryTier.UVM_CACHING else 0.0, raw=table.raw_ids))
    if not out and refused:
        raise ConfigError(refused)
    if not out:
        raise ConfigError(
            f"table {table.name!r}: no sharding option is left: constraints {constraint.to_dict()} and planner "
            f"settings (types {[s.value for s in settings.sharding_types]}, tiers "
            f"{[t.value for t in settings.tiers]}) exclude every option on {W} {topology.compute_device} rank(s); "
            "allow more sharding types or tiers (data_parallel needs hbm/host; row_wise needs all ranks)"
        )
    return out


def small_forms(
    tables: Sequence[TableConfig],
    options: Sequence[Sequence[Option]],
    constraints: Sequence[ParameterConstraints],
    topology: Topology,
    settings: PlannerSettings,
    column_wise: bool = True,
) -> list[list[Option | None]]:
    """Per table, each option with the small-table kernel if the planner may consider it, else None: fp32 weights
    in GPU memory (tier hbm), on a GPU topology, with settings.small_table_kernel and the table's `kernels`
    constraint allowing it, and every block small enough for the kernel (kernel_model.eligible: the block and its
    gradient buffer within half the L2). A table constrained to `kernels: [small]` gets it wherever the runtime
    can run it (tier hbm, or host on CPUs), without the size rule. `column_wise` False: none for column-wise
    options (under the exact column-wise update, whose backward replaces either kernel's)."""
    out: list[list[Option | None]] = [[None] * len(o) for o in options]
    auto = settings.small_table_kernel and topology.is_gpu
    sized = []  # (table, option, largest block rows, cols) under the size rule
    for i, (t, opts, c) in enumerate(zip(tables, options, constraints)):
        if t.raw_ids:  # raw-id tables use FBGEMM's kernel (spec/raw_ids.py)
            continue
        allowed, fp32 = c.kernels, t.data_type.bytes == 4
        if allowed == (LookupKernel.SMALL,) and fp32:
            tiers = (MemoryTier.HBM, MemoryTier.HOST)
            out[i] = [_with_kernel(o) if o.tier in tiers else None for o in opts]
        elif auto and fp32 and (not allowed or LookupKernel.SMALL in allowed):
            for j, o in enumerate(opts):
                if o.tier is MemoryTier.HBM and (column_wise or o.sharding is not ShardingType.COLUMN_WISE):
                    sized.append((i, j, *shard_runs(t, o)[0][:2]))
    if sized:
        blocks = np.array(sized, dtype=float)
        for (i, j, _, _), ok in zip(sized, eligible(blocks[:, 2], blocks[:, 3], 4, True, topology.l2_bytes)):
            out[i][j] = _with_kernel(options[i][j]) if ok else None
    return out


@cache
def _with_kernel(o: Option) -> Option:
    return Option(o.sharding, o.tier, o.parts, o.cache_load_factor, LookupKernel.SMALL)


def _allowed(order: Sequence, *filters: Sequence) -> tuple:
    return tuple(x for x in order if all(not f or x in f for f in filters))


def _column_parts(table: TableConfig, constraint: ParameterConstraints, W: int, n_ranks: int) -> list[int]:
    D = table.embedding_dim
    if D % 4:
        return []
    if constraint.column_shards:
        return [k for k in constraint.column_shards if 2 <= k <= min(n_ranks, D // 4)]
    out, k = [], 2
    while k <= min(n_ranks, MAX_COLUMN_SHARDS) and D // k >= MIN_COLUMN_BLOCK:
        out.append(k)
        k *= 2
    return out


def make_shards(table: TableConfig, option: Option, ranks: Sequence[int]) -> tuple[Shard, ...]:
    """Shards of `table` under `option` on `ranks`: one rank per block in block order (row blocks from
    geometry.row_blocks(rows, option.parts), column blocks from geometry.column_blocks); every rank for
    data-parallel."""
    R, D = table.num_embeddings, table.embedding_dim
    st = option.sharding
    if st in (ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL):
        return tuple(Shard(r, 0, R, 0, D) for r in ranks)
    if st is ShardingType.COLUMN_WISE:
        sizes = column_blocks(D, option.parts, table.name)
    else:
        sizes = row_blocks(R, option.parts)
    if len(sizes) != len(ranks):
        raise ValueError(f"{table.name}: {len(sizes)} blocks but {len(ranks)} ranks given")
    if st is ShardingType.COLUMN_WISE:
        return tuple(Shard(r, 0, R, c, n) for r, c, n in zip(ranks, offsets(sizes), sizes))
    return tuple(Shard(r, o, n, 0, D) for r, o, n in zip(ranks, offsets(sizes), sizes))


def shard_runs(table: TableConfig, option: Option) -> list[tuple[int, int, int]]:
    """The blocks of `option` in block order, as runs (rows, cols, how many blocks in a row have that shape):
    TW one block, DP one replica per rank, row-wise kinds one run of full blocks and a shorter last one."""
    R, D = table.num_embeddings, table.embedding_dim
    if option.sharding is ShardingType.COLUMN_WISE:
        return [(R, c, n) for c, n in column_runs(D, option.parts)]
    if option.sharding in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        return [(r, D, n) for r, n in row_runs(R, option.parts)]
    return [(R, D, option.parts)]


@lru_cache(maxsize=4096)
def column_runs(dim: int, parts: int) -> tuple[tuple[int, int], ...]:
    """`geometry.runs(geometry.column_blocks(dim, parts))`: (width, count) runs of the column blocks."""
    return runs(column_blocks(dim, parts))
