"""The cost and storage model of one shard: bytes it stores per tier, bytes it moves per step, seconds it takes.

Notation (per step): B local batch per rank, W ranks, G = W // local ranks per host hosts, and for the table:
R rows, D columns, F features reading it, L ids per bag (hint), w = 1 if weighted, e weight bytes (4 fp32, 2 fp16).
A shard holds r rows x c columns. Ids are assumed spread uniformly over the row blocks (hashed ids).

  ids it looks up      n = W*B*F*L * r/R (row-wise kinds) | W*B*F*L (table-/column-wise) | B*F*L (data-parallel)
  bags it pools        b = W*B*F (model-parallel) | B*F (data-parallel)
  rows it touches      u = r * (1 - exp(-n / r))                       (expected distinct ids, uniform access)
  id bytes             i = 8 + 4w                                      (int64 id, fp32 per-sample weight)
  row bytes            rb = c*e; optimizer state bytes per row sb = FusedOptimizerConfig.state_bytes_per_row(c)
  gather(x, g)         = ceil(x / g) * g + g   (random row access: whole sectors of g bytes plus one for the index;
                                                g = 32 B in HBM, 64 B over the host link and in host memory)

Communication, per step (model-parallel shards; data-parallel ones have none):
  in_b  = B*F*(L * r/R * i + 4)       bytes every other rank sends the shard's rank (ids, weights, lengths)
  out_b = B*F*c*4                      bytes the shard's rank sends every other rank (fp32 pooled rows), and
                                       receives back as gradients in backward
  Rank time on a link = bytes / (intra_host_bw or inter_host_bw), sends and receives counted apart.

Compute, per step, on the shard's rank (bytes / bandwidth of where they live):
  fwd = [n*i + b*c*4 + n*gather(rb)] / hbm_bw                                      (hbm)
  bwd = [n*(96 + 4c) + b*c*4 + u*(2rb + 2sb)] / hbm_bw    (96 B/id: radix sort of ids; 4c: gradient row per id)
  uvm:          the gathers and the touched rows' read+write go over the host link (uvm_bw) instead; row-wise
                optimizer state stays in HBM (FBGEMM does so), other state is in host memory.
  uvm_caching:  hit rate h = H(k, a) / H(r, a) for a cache of k = clf*r rows under Zipf(a) access, with
                H(n, a) = integral of x^-a from 0.5 to n + 0.5 (a = 0: h = clf); m = missed distinct rows
                = (r - k)(1 - exp(-n(1-h)/(r - k))) are fetched over the link (+ written into the cache) in
                forward and written back (evicted dirty) in backward; 16 B/id of cache probing.
  host (CPU):   as hbm with ddr_bw and 64 B sectors.
  data-parallel (fp32 replicas): fwd as hbm over the local batch; bwd forms the dense gradient and per-row
                counts: [n*(i + 12c) + b*c*4 + r*(c+1)*4] / bw; all-reduce of r*(c+1)*4 bytes:
                2(W-1)/W * bytes / link_bw (intra_host_bw on one host, else inter_host_bw); update: scan of the
                summed gradient plus the rows touched by the global batch: [r*(c+1)*4 + ug*(2rb+2sb+4c)] / bw.

Per-id overheads beyond bytes (Topology): every id looked up costs lookup_id_s (1/3 forward, 2/3 backward);
every id a model-parallel shard receives costs routed_id_s more (forward phase): routing permutes, bucketing and
the fused backward's per-id work, which data-parallel lookups of the local batch do not pay.

Fixed costs (seconds): per lookup-kernel group (sharding type x tier x dtype x weighted) on a rank: kernel_s
forward (3x with UVM-caching prefetch), 3*kernel_s backward; per sharding scheme in the plan: input
all-to-all 3 collectives (+1 for weights) + one host sync, output and gradient 1 collective each; data-parallel:
one all-reduce latency, 2*kernel_s of update, plus settings.dp_kernels_per_table kernels per table.

Storage per shard: weights r*c*e and state r*sb in their tier (data-parallel: fp32 replica); HBM buffers per
step: n*(32 + 4w) (ids received, permuted, sorted) + b*c*4*2 (pooled rows and their gradient); data-parallel adds
its dense gradient r*(c+1)*4; UVM-caching adds k*(rb + 16) (cache rows, LRU state) + r*4 (row -> table map) +
n*4 (cache locations). Every rank also reserves its own batch (ids in and out, pooled outputs): see `batch_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embshard.optim import FusedOptimizerConfig
from embshard.plan import MemoryTier, ShardingType
from embshard.planner import loads as R
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.tables import TableConfig

ID_BYTES = 8
WEIGHT_BYTES = 4
LENGTH_BYTES = 4
OUT_BYTES = 4
SORT_BYTES_PER_ID = 96
CACHE_PROBE_BYTES = 16
ID_BUFFER_BYTES = 32
CACHE_SLOT_BYTES = 16
CACHE_MAP_BYTES = 4
HBM_SECTOR = 32
LINK_SECTOR = 64

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

    @classmethod
    def of(cls, tables: Sequence[TableConfig]) -> TableStats:
        """Arrays over `tables`."""
        return cls(
            rows=np.array([t.num_embeddings for t in tables], dtype=float),
            dim=np.array([t.embedding_dim for t in tables], dtype=float),
            elem=np.array([t.data_type.bytes for t in tables], dtype=float),
            features=np.array([len(t.feature_names) for t in tables], dtype=float),
            ids_per_bag=np.array([t.ids_per_bag for t in tables], dtype=float),
            weighted=np.array([float(t.weighted) for t in tables]),
        )

    @classmethod
    def one(cls, t: TableConfig) -> TableStats:
        """Scalars of one table."""
        return cls(
            float(t.num_embeddings),
            float(t.embedding_dim),
            float(t.data_type.bytes),
            float(len(t.feature_names)),
            float(t.ids_per_bag),
            float(t.weighted),
        )


@dataclass(frozen=True)
class ShardWork:
    """What one shard costs per step (all may be arrays)."""

    in_b: np.ndarray | float
    """Bytes each other rank sends the shard's rank (ids)."""
    out_b: np.ndarray | float
    """Bytes the shard's rank sends each other rank (pooled rows), and gets back as gradients."""
    fwd_s: np.ndarray | float
    """Forward lookup seconds on the shard's rank."""
    bwd_s: np.ndarray | float
    """Backward + optimizer seconds on the shard's rank."""
    ar_s: np.ndarray | float = 0.0
    """Data-parallel gradient all-reduce seconds."""
    upd_s: np.ndarray | float = 0.0
    """Data-parallel update seconds."""


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


def zipf_hit_rate(cache_rows, rows, alpha):
    """Share of accesses that hit a cache of the `cache_rows` most popular of `rows` rows, ids ~ Zipf(alpha)."""
    cache_rows = np.minimum(cache_rows, rows)
    a = np.asarray(alpha, dtype=float)
    near1 = np.abs(a - 1.0) < 1e-6
    safe = np.where(near1, 0.5, 1.0 - a)

    def H(n):
        power = ((n + 0.5) ** safe - 0.5**safe) / safe
        return np.where(near1, np.log(2 * n + 1.0), power)

    return np.clip(H(cache_rows) / H(rows), 0.0, 1.0)


def gather(row_bytes, sector: int):
    """Bytes moved to fetch one row at a random address."""
    return np.ceil(row_bytes / sector) * sector + sector


class CostModel:
    """Per-shard work and storage for one topology, batch size and optimizer."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        optimizer: FusedOptimizerConfig,
        settings: PlannerSettings | None = None,
    ) -> None:
        self.topo = topology
        self.batch = batch_size
        self.optimizer = optimizer
        self.settings = settings or PlannerSettings()
        s0 = optimizer.state_bytes_per_row(0)
        self.state_fixed = float(s0)
        self.state_per_col = float(optimizer.state_bytes_per_row(1) - s0)
        # FBGEMM keeps one-value-per-row state in HBM even for UVM tables.
        self.state_in_hbm = self.state_per_col == 0
        self.mem_bw = topology.hbm_bw if topology.is_gpu else topology.ddr_bw
        self.ar_bw = topology.intra_host_bw if topology.num_hosts == 1 else topology.inter_host_bw
        self.latency = topology.collective_latency_s if topology.num_hosts == 1 else topology.inter_collective_latency_s
        self._fixed: dict[tuple, np.ndarray] = {}

    # ---- volumes ------------------------------------------------------------------------------------------
    def volumes(self, t: TableStats, sharding: ShardingType, rows):
        """(ids looked up, bags pooled) per step by one shard of `rows` rows."""
        B, W = self.batch, self.topo.world_size
        if sharding is ShardingType.DATA_PARALLEL:
            return B * t.features * t.ids_per_bag, B * t.features
        frac = rows / t.rows if sharding in ROW_KINDS else 1.0
        return W * B * t.features * t.ids_per_bag * frac, W * B * t.features

    def state_bytes(self, cols):
        """Optimizer state bytes per row of a shard `cols` wide."""
        return self.state_fixed + self.state_per_col * cols

    # ---- time ---------------------------------------------------------------------------------------------
    def work(self, t: TableStats, sharding: ShardingType, tier: MemoryTier, rows, cols, clf=0.0, alpha=0.0):
        """ShardWork of one shard (formulas in the module docstring)."""
        B = self.batch
        n, bags = self.volumes(t, sharding, rows)
        idb = ID_BYTES + WEIGHT_BYTES * t.weighted
        sb = self.state_bytes(cols)
        u = rows * -np.expm1(-n / rows)
        bw = self.mem_bw
        if sharding is ShardingType.DATA_PARALLEL:
            rb = cols * 4.0
            W = self.topo.world_size
            grad_bytes = rows * (cols + 1) * 4.0
            fwd = (n * idb + bags * cols * OUT_BYTES + n * gather(rb, HBM_SECTOR)) / bw
            bwd = (n * (idb + 12 * cols) + bags * cols * OUT_BYTES + grad_bytes) / bw
            ar = 2 * (W - 1) / W * grad_bytes / self.ar_bw
            ug = rows * -np.expm1(-W * n / rows)
            upd = (grad_bytes + ug * (2 * rb + 2 * sb + 4 * cols)) / bw
            extra = self.settings.dp_kernels_per_table * self.topo.kernel_s / 2
            per_id = n * self.topo.lookup_id_s
            return ShardWork(0.0, 0.0, fwd + extra + per_id / 3, bwd + extra + 2 * per_id / 3, ar, upd)
        rb = cols * t.elem
        in_b = B * t.features * ((n / (self.topo.world_size * B * t.features)) * idb + LENGTH_BYTES)
        out_b = B * t.features * cols * OUT_BYTES
        fwd_lin = n * idb + bags * cols * OUT_BYTES
        bwd_lin = n * (SORT_BYTES_PER_ID + cols * OUT_BYTES) + bags * cols * OUT_BYTES
        if tier is MemoryTier.HBM:
            fwd = (fwd_lin + n * gather(rb, HBM_SECTOR)) / bw
            bwd = (bwd_lin + u * (2 * rb + 2 * sb)) / bw
        elif tier is MemoryTier.HOST:
            fwd = (fwd_lin + n * gather(rb, LINK_SECTOR)) / bw
            bwd = (bwd_lin + u * (2 * rb + 2 * sb)) / bw
        else:
            link = self.topo.uvm_bw
            state_s = u * 2 * sb / (bw if self.state_in_hbm else link)
            if tier is MemoryTier.UVM:
                fwd = fwd_lin / bw + n * gather(rb, LINK_SECTOR) / link
                bwd = bwd_lin / bw + u * 2 * gather(rb, LINK_SECTOR) / link + state_s
            else:  # UVM caching
                k = np.minimum(np.ceil(clf * rows), rows)
                h = zipf_hit_rate(k, rows, alpha)
                cold = np.maximum(rows - k, 1.0)
                m = np.where(rows > k, cold * -np.expm1(-n * (1 - h) / cold), 0.0)
                fwd = (fwd_lin + n * (gather(rb, HBM_SECTOR) + CACHE_PROBE_BYTES) + m * rb) / bw + m * gather(
                    rb, LINK_SECTOR
                ) / link
                bwd = (bwd_lin + u * 2 * rb) / bw + m * gather(rb, LINK_SECTOR) / link + state_s
        per_id = n * self.topo.lookup_id_s
        fwd = fwd + n * self.topo.routed_id_s + per_id / 3
        return ShardWork(in_b, out_b, fwd, bwd + 2 * per_id / 3)

    # ---- storage ------------------------------------------------------------------------------------------
    def storage(self, t: TableStats, sharding: ShardingType, tier: MemoryTier, rows, cols, clf=0.0) -> Storage:
        """Bytes one shard keeps (formulas in the module docstring)."""
        n, bags = self.volumes(t, sharding, rows)
        buffers = n * (ID_BUFFER_BYTES + WEIGHT_BYTES * t.weighted) + bags * cols * OUT_BYTES * 2
        state = rows * self.state_bytes(cols)
        if sharding is ShardingType.DATA_PARALLEL:
            weights = rows * cols * 4.0
            buffers = buffers + rows * (cols + 1) * 4.0
        else:
            weights = rows * cols * t.elem
        if tier is MemoryTier.HBM:
            return Storage(hbm_weights=weights, hbm_state=state, hbm_buffers=buffers)
        if tier is MemoryTier.HOST:
            return Storage(ddr_weights=weights, ddr_state=state, ddr_buffers=buffers)
        hbm_state = state if self.state_in_hbm else 0.0
        ddr_state = 0.0 if self.state_in_hbm else state
        cache = 0.0
        if tier is MemoryTier.UVM_CACHING:
            k = np.minimum(np.ceil(clf * rows), rows)
            cache = k * (cols * t.elem + CACHE_SLOT_BYTES) + rows * CACHE_MAP_BYTES + n * 4
        return Storage(
            hbm_state=hbm_state, hbm_cache=cache, hbm_buffers=buffers, ddr_weights=weights, ddr_state=ddr_state
        )

    def batch_bytes(self, tables: Sequence[TableConfig]) -> float:
        """Bytes every rank needs for its own batch whatever the plan: its ids (as read and as sent) and the pooled
        rows it receives, and their gradients."""
        B = self.batch
        total = 0.0
        for t in tables:
            idb = ID_BYTES + WEIGHT_BYTES * t.weighted
            f = len(t.feature_names)
            total += B * f * (t.ids_per_bag * idb * 2 + 2 * LENGTH_BYTES) + B * f * t.embedding_dim * OUT_BYTES * 2
        return total

    # ---- load vectors -------------------------------------------------------------------------------------
    def owner_vec(self, wk: ShardWork) -> np.ndarray:
        """[..., NROWS]: what a shard puts on its own rank."""
        topo = self.topo
        W, lws = topo.world_size, topo.local_world_size
        shape = np.broadcast(wk.in_b, wk.out_b, wk.fwd_s, wk.bwd_s).shape
        v = np.zeros((*shape, R.NROWS))
        bi, bx = topo.intra_host_bw, topo.inter_host_bw
        v[..., R.IN_RECV_I] = (lws - 1) * wk.in_b / bi
        v[..., R.IN_RECV_X] = (W - lws) * wk.in_b / bx
        v[..., R.FWD] = wk.fwd_s
        out_i, out_x = (lws - 1) * wk.out_b / bi, (W - lws) * wk.out_b / bx
        v[..., R.OUT_SEND_I] = out_i
        v[..., R.OUT_SEND_X] = out_x
        v[..., R.GRAD_RECV_I] = out_i
        v[..., R.GRAD_RECV_X] = out_x
        v[..., R.BWD] = wk.bwd_s
        v[..., R.ALLREDUCE] = wk.ar_s
        v[..., R.DP_UPDATE] = wk.upd_s
        return v

    def peer_vec(self, wk: ShardWork, same_host: bool) -> np.ndarray:
        """[..., NROWS]: what a model-parallel shard puts on another rank of its host (or of another host)."""
        shape = np.broadcast(wk.in_b, wk.out_b).shape
        v = np.zeros((*shape, R.NROWS))
        bw = self.topo.intra_host_bw if same_host else self.topo.inter_host_bw
        x = 0 if same_host else 1
        v[..., R.IN_SEND_I + x] = wk.in_b / bw
        v[..., R.OUT_RECV_I + x] = wk.out_b / bw
        v[..., R.GRAD_SEND_I + x] = wk.out_b / bw
        return v

    def group_fixed(self, sharding: ShardingType, tier: MemoryTier) -> np.ndarray:
        """[NROWS]: kernel launch costs of one lookup group on a rank (do not modify: cached)."""
        key = ("group", sharding, tier)
        if key not in self._fixed:
            self._fixed[key] = self._group_fixed(sharding, tier)
        return self._fixed[key]

    def scheme_fixed(self, sharding: ShardingType, weighted: bool) -> np.ndarray:
        """[NROWS]: collective latencies of one sharding scheme, on every rank (do not modify: cached)."""
        key = ("scheme", sharding, weighted)
        if key not in self._fixed:
            self._fixed[key] = self._scheme_fixed(sharding, weighted)
        return self._fixed[key]

    def _group_fixed(self, sharding: ShardingType, tier: MemoryTier) -> np.ndarray:
        v = np.zeros(R.NROWS)
        k = self.topo.kernel_s
        v[R.FWD] = k * (3 if tier is MemoryTier.UVM_CACHING else 1)
        v[R.BWD] = 3 * k
        if sharding is ShardingType.DATA_PARALLEL:
            v[R.DP_UPDATE] = 2 * k
        return v

    def _scheme_fixed(self, sharding: ShardingType, weighted: bool) -> np.ndarray:
        v = np.zeros(R.NROWS)
        if self.topo.world_size == 1:
            return v
        lat = self.latency
        if sharding is ShardingType.DATA_PARALLEL:
            v[R.ALLREDUCE] = lat
            return v
        v[R.PHASE_ROWS[0]] = (3 + int(weighted)) * lat + self.topo.host_sync_s
        v[R.PHASE_ROWS[2]] = lat
        v[R.PHASE_ROWS[3]] = lat
        return v
