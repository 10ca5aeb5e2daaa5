"""The memory model of one shard: the numbers of its tables (`TableStats`), the ids and bags it handles per step,
the bytes it keeps per tier (`Storage`) and the memory its step allocates (`MemoryModel`, which CostModel in
cost.py extends with the time model; notation: cost.py's module docstring).

Storage per shard: weights r*c*e and state r*sb in their tier (data-parallel: fp32 replica). Memory of one step
(GPU memory; host memory for tier host), model-parallel shards: n*(80 + 12w) for the ids (80 B/id: the received
id, its permuted copy kept for backward and the TBE backward's workspace: linearised, sorted, run-length-encoded
ids and their positions, radix sort scratch; 32 B/id on CPUs) + b*c*4*2 (the pooled rows it sends and their
gradient it receives); UVM-caching adds k*(rb + 16) (cache rows and their LRU state) + r*4 (row -> table map) +
n*48 (the prefetch's linearised ids, the cache locations kept for backward, its sort); data-parallel:
n*(68 + 4w) (its ids and the dense backward's workspace) + b*c*4*2 + 2*r*(c+1)*4 (the dense gradient and the
flat all-reduce buffer with counts). Every rank also holds its own batch (`batch_bytes`): its ids and the
permuted copy it sends, 2*B*F*(L*i + 4), and the pooled rows it receives, their regrouped output and that
output's gradient, 3*B*F*D*4. The planner's budget for the sum per rank is capacity - reserve, so the predicted
peak includes every buffer the step allocates.

Raw-id tables (ids: raw, embshard/rawids): the shard's id -> row map costs r*m bytes more state, kept where the
shard computes (HBM for GPU tiers, host memory for host; m = spec.id_map.map_bytes_per_row, ~60-100 B), and
n*RAW_ID_STEP_BYTES of step memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from embshard.planner import kernel_cost
from embshard.planner.topology import Topology
from embshard.spec.id_map import map_bytes_per_row
from embshard.spec.plan import LookupKernel, MemoryTier, ShardingType
from embshard.spec.tables import Eviction, TableConfig

ID_BYTES = 8
WEIGHT_BYTES = 4
LENGTH_BYTES = 4
# GPU memory per step (bytes per id / per row); see the module docstring.
ID_STEP_BYTES = 80
HOST_ID_STEP_BYTES = 32
DP_ID_STEP_BYTES = 68
CACHE_STEP_BYTES = 48
CACHE_SLOT_BYTES = 16
CACHE_MAP_BYTES = 4
OWN_POOLED_COPIES = 3
RAW_ID_STEP_BYTES = 512
"""Step memory per id of a raw-id table's remap (its int64 working arrays, a bucket's slots at a time)."""

ROW_KINDS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


@dataclass(frozen=True)
class TableStats:
    """The numbers of tables the model needs (scalars, or numpy arrays for many tables at once)."""

    rows: np.ndarray | float
    dim: np.ndarray | float
    elem: np.ndarray | float
    features: np.ndarray | float
    ids_per_bag: np.ndarray | float
    weighted: np.ndarray | float
    raw: np.ndarray | float = 0.0
    """1 for raw-id tables (ids: raw), else 0."""
    map_row: np.ndarray | float = 0.0
    """Bytes of the id -> row map per row (raw-id tables; `spec.id_map.map_bytes_per_row`), else 0."""
    lfu: np.ndarray | float = 0.0
    """1 for raw-id tables evicting by LFU."""
    seq: np.ndarray | float = 0.0
    """1 for sequence tables (pooling none: one output row per id, not per bag), else 0."""

    @property
    def rows_per_bag(self) -> np.ndarray | float:
        """Output rows per bag: 1 for pooled tables, the ids per bag for sequence tables (one row per id)."""
        return 1.0 + self.seq * (self.ids_per_bag - 1.0)

    @classmethod
    def of(cls, tables: Sequence[TableConfig]) -> TableStats:
        """Arrays over `tables`, one per field."""
        numbers = np.array([_numbers(t) for t in tables], dtype=float).reshape(len(tables), len(fields(cls)))
        return cls(*np.ascontiguousarray(numbers.T))

    @classmethod
    def one(cls, t: TableConfig) -> TableStats:
        """Scalars of one table."""
        return cls(*_numbers(t))


def _numbers(t: TableConfig) -> tuple[float, ...]:
    """One table's TableStats fields, in their order; a raw-id table's map is priced for one table-wise shard of all
    its rows."""
    raw = t.raw_ids
    map_row = map_bytes_per_row(t.num_embeddings, t.eviction, t.admit_min_count) if raw else 0.0
    lfu = raw and t.eviction is Eviction.LFU
    dims = (t.num_embeddings, t.embedding_dim, t.data_type.bytes, len(t.feature_names), t.ids_per_bag)
    return (*map(float, dims), float(t.weighted), float(raw), float(map_row), float(lfu), float(t.sequence))


@dataclass(frozen=True)
class Storage:
    """Bytes a shard (or a rank) keeps, by tier and kind."""

    hbm_weights: np.ndarray | float = 0.0
    hbm_state: np.ndarray | float = 0.0
    hbm_cache: np.ndarray | float = 0.0
    hbm_buffers: np.ndarray | float = 0.0
    ddr_weights: np.ndarray | float = 0.0
    ddr_state: np.ndarray | float = 0.0
    ddr_buffers: np.ndarray | float = 0.0

    @property
    def hbm(self) -> np.ndarray | float:
        """Total GPU memory."""
        return self.hbm_weights + self.hbm_state + self.hbm_cache + self.hbm_buffers

    @property
    def ddr(self) -> np.ndarray | float:
        """Total host memory."""
        return self.ddr_weights + self.ddr_state + self.ddr_buffers


class MemoryModel:
    """The bytes of shards and their steps; CostModel (cost.py) sets the attributes below and adds the time model."""

    topo: Topology
    batch: int
    """Samples per rank per step."""
    out_bytes: float
    """Bytes per pooled element."""
    state_fixed: float
    state_per_col: float
    """Optimizer state bytes per row: state_fixed + state_per_col * columns."""
    state_in_hbm: bool
    """One-value-per-row state, which FBGEMM keeps in HBM even for UVM tables."""
    hierarchical: bool
    """Table-row-wise tables use the hierarchical output exchange (exchange.py)."""

    # ---- volumes ------------------------------------------------------------------------------------------
    def volumes(self, t: TableStats, sharding: ShardingType, rows):
        """(ids looked up, output rows: bags pooled, or ids for sequence tables) per step by one shard of `rows`
        rows."""
        B, W = self.batch, self.topo.world_size
        if sharding is ShardingType.DATA_PARALLEL:
            return B * t.features * t.ids_per_bag, B * t.features * t.rows_per_bag
        frac = rows / t.rows if sharding in ROW_KINDS else 1.0
        # a row-wise sequence shard returns one row per id it looks up (its share), not one per bag
        out = W * B * t.features * np.where(t.seq > 0, t.ids_per_bag * frac, 1.0)
        return W * B * t.features * t.ids_per_bag * frac, out

    def state_bytes(self, cols):
        """Optimizer state bytes per row of a shard `cols` wide."""
        return self.state_fixed + self.state_per_col * cols

    # ---- storage ------------------------------------------------------------------------------------------
    def storage(
        self, t: TableStats, sharding: ShardingType, tier: MemoryTier, rows, cols, clf=0.0, kernel=None
    ) -> Storage:
        """Bytes one shard keeps, and the GPU memory its step allocates (formulas in the module docstring)."""
        n, bags = self.volumes(t, sharding, rows)
        pooled = bags * cols * self.out_bytes * 2
        state = rows * self.state_bytes(cols)
        id_map = rows * t.map_row  # raw-id tables: the id -> row map, where the shard computes
        if kernel is LookupKernel.SMALL:  # fp32 weights in the compute device's memory (kernel_cost.py)
            weights = rows * cols * 4.0
            buffers = kernel_cost.small_step_bytes(sharding, rows, cols, n, WEIGHT_BYTES * t.weighted) + pooled
        elif sharding is ShardingType.DATA_PARALLEL:
            weights = rows * cols * 4.0
            buffers = n * (DP_ID_STEP_BYTES + WEIGHT_BYTES * t.weighted) + pooled + 2 * rows * (cols + 1) * 4.0
        else:
            weights = rows * cols * t.elem
            per_id = HOST_ID_STEP_BYTES if tier is MemoryTier.HOST else ID_STEP_BYTES
            buffers = n * (per_id + 3 * WEIGHT_BYTES * t.weighted + RAW_ID_STEP_BYTES * t.raw) + pooled
        if sharding is ShardingType.TABLE_ROW_WISE and self.hierarchical:  # whatever the kernel
            buffers = buffers + pooled  # the host's partials it receives to add up, and their gradient
        if tier is MemoryTier.HBM:
            return Storage(hbm_weights=weights, hbm_state=state + id_map, hbm_buffers=buffers)
        if tier is MemoryTier.HOST:
            return Storage(ddr_weights=weights, ddr_state=state + id_map, ddr_buffers=buffers)
        hbm_state = (state if self.state_in_hbm else 0.0) + id_map
        ddr_state = 0.0 if self.state_in_hbm else state
        cache = 0.0
        if tier is MemoryTier.UVM_CACHING:
            k = np.minimum(np.ceil(clf * rows), rows)
            cache = k * (cols * t.elem + CACHE_SLOT_BYTES) + rows * CACHE_MAP_BYTES
            buffers = buffers + n * CACHE_STEP_BYTES
        return Storage(
            hbm_state=hbm_state, hbm_cache=cache, hbm_buffers=buffers, ddr_weights=weights, ddr_state=ddr_state
        )

    def batch_bytes(self, tables: Sequence[TableConfig]) -> float:
        """Bytes every rank needs for its own batch whatever the plan: its ids and the permuted copy it sends,
        the pooled rows it receives, their regrouped output and that output's gradient."""
        B = self.batch
        total = 0.0
        for t in tables:
            idb = ID_BYTES + WEIGHT_BYTES * t.weighted
            f = len(t.feature_names)
            total += 2 * B * f * (t.ids_per_bag * idb + LENGTH_BYTES)
            per_bag = t.ids_per_bag if t.sequence else 1.0  # a sequence table: one row per id
            total += OWN_POOLED_COPIES * B * f * per_bag * t.embedding_dim * self.out_bytes
        return total
