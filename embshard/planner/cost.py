"""The time model of one shard: bytes it moves per step and seconds it takes (what it stores: memory.py, whose
`MemoryModel` CostModel extends).

Notation (per step): B local batch per rank, W ranks, G = W // local ranks per host hosts, and for the table:
R rows, D columns, F features reading it, L ids per bag (hint), w = 1 if weighted, e weight bytes (4 fp32, 2 fp16),
a the Zipf skew hint (0 = uniform ids). A shard holds r rows x c columns. Ids are assumed spread uniformly over
the row blocks (hashed ids).

  ids it looks up      n = W*B*F*L * r/R (row-wise kinds) | W*B*F*L (table-/column-wise) | B*F*L (data-parallel)
  bags it pools        b = W*B*F (model-parallel) | B*F (data-parallel)
  rows it touches      u = r * (1 - exp(-n / r)) for uniform ids; under Zipf(a) the integral over the rows of
                       1 - exp(-n p(x)), p(x) = x^-a / H(r, a) (`distinct_rows`)
  id bytes             i = 8 + 4w                                      (int64 id, fp32 per-sample weight)
  row bytes            rb = c*e (data-parallel: c*4); optimizer state bytes per row
                       sb = FusedOptimizerConfig.state_bytes_per_row(c)
  gather(x, g)         = ceil(x / g) * g, + g/2 when x is not a multiple of g (random row access: whole sectors;
                         g = 32 B in HBM, 64 B over the host link and in host memory)
  row reads            v = u + (n - u) * (1 - min(1, l2_bytes / (u * rb))): lookups that miss the GPU's L2. The
                       TBE kernels read one table after another, so a repeated row is an L2 hit while the distinct
                       rows of the shard fit in L2 (hetero124's 10k-row tables: v = u, each row read once; uniform26's
                       1M x 128 tables: v ~ n); on CPUs v = n

Communication, per step (model-parallel shards; data-parallel ones have none):
  in_b  = B*F*(L * r/R * i + 4)       bytes every other rank sends the shard's rank (ids, weights, lengths)
  out_b = B*F*c*4                      bytes the shard's rank sends every other rank (fp32 pooled rows), and
                                       receives back as gradients in backward
  Sequence tables (pooling none) return a row per id, not per bag: b counts ids, out_b = n/W*c*4 (ids x D x
  bytes: every id of the table's features for table-wise, the shard's share for row-wise), and the regroup's
  P = B*F*L*D*4 (memory.py prices the step's unpooled rows the same way). With settings.sequence_dedup each rank
  sends a shard its unique ids only: n/W becomes distinct_rows(n/W, r, a) in in_b and out_b.
  Rank time on a link = bytes / (intra_host_bw or inter_host_bw), sends and receives counted apart.
  Table-row-wise under the hierarchical exchange (plan.table_row_wise_exchange): the partials are first reduced
  inside the host, then each sample's row crosses hosts once (exchange.py: its rows, phases and latencies).

Compute, per step, on the shard's rank: a fixed time per id (and per touched row in backward) from the Topology
plus the bytes moved over the bandwidth of where they live (bw = hbm_bw; ddr_bw on CPUs), so the time per id
depends on the row width through the bytes (and through fwd_byte_s / bwd_byte_s, which CPUs need):
  fwd = n*(fwd_id_s + rb*fwd_byte_s) + [n*i + b*c*4 + v*gather(rb, 32)] / bw                  (hbm)
  bwd = n*(bwd_id_s + rb*bwd_byte_s) + u*bwd_row_s + [n*(96 + 4c) + b*c*4 + u*2*(gather(rb, 32) + sb)] / bw
        (96 B/id: linearising and radix-sorting the ids; 4c: a gradient row per id; the fused optimizer reads and
        writes each touched row and its state). Fitted on 2 H200 (docs/planner.md): narrow rows of tiny tables
        cost about fwd_id_s per id (18 ps), 128-wide rows from HBM are bandwidth-bound (~150 ps per id); the
        fused backward is bound by a chain of dependent loads per touched row (bwd_row_s, 0.3 ns).
  routing (model-parallel shards, forward phase): n*routed_id_s + b*bag_s (the receiver's permute: one
        segment-wise pass over the bags it receives).
  uvm:          row reads cross the host link: t_link = uvm_row_s + gather(rb, 64)/uvm_bw + p*uvm_page_s per row,
                p = max(0, 1 - 2 GiB / (R*D*e)) the share of accesses beyond the reach of the GPU's translation of
                host memory (whole tables: splitting one does not shrink the host memory a step touches; fitted to
                the overflow workload, docs/planner.md). Forward reads the v rows that miss L2, backward reads,
                updates and writes back the u touched rows, one dependent chain a row (uvm_bwd_row_s beyond the
                read; on 2 x H100 the backward took 18 ns a row against the forward's 12 ns, docs/planner.md):
                fwd = n*(fwd_id_s + rb*fwd_byte_s) + [n*i + b*c*4]/bw + v*t_link,
                bwd = (per-id and per-row times as hbm) + [n*(96 + 4c) + b*c*4]/bw + u*(t_link + uvm_bwd_row_s)
                      + u*2*sb/bw
                (row-wise state stays in HBM, as FBGEMM keeps it; per-element state goes over the link, /uvm_bw).
  uvm_caching:  hit rate h = H(k, a) / H(r, a) for a cache of k = ceil(clf*r) rows under Zipf(a) access, with
                H(n, a) = integral of x^-a from 0.5 to n + 0.5 (a = 0: h = clf); m = missed distinct rows
                = (r - k)(1 - exp(-n(1-h)/(r - k))). The prefetch (forward phase) sorts the ids and probes the
                cache (n*bwd_id_s + n*(96 + 16)/bw) and inserts each miss: it reads the row over the link and
                writes the evicted row back, 1.35 * t_link per miss (CACHE_MISS_LINKS, fitted to the tier
                benchmark), and writes it into the cache (m*rb/bw). Lookups and the backward then run as hbm on
                the cached rows (state as uvm).
  host (CPU):   as hbm with ddr_bw, 64 B sectors and no L2.
  data-parallel (fp32 replicas, local batch only):
                fwd as hbm; bwd = (per-id and per-row times as hbm) + [n*(96 + 4c) + b*c*4 + r*c*4] / bw
                (FBGEMM's dense backward: sorted ids, one dense gradient row per row); all-reduce of the flat
                gradient with counts, r*(c+1)*4 bytes: 2(W-1)/W * bytes / link_bw (intra_host_bw on one host,
                else inter_host_bw); update: [8*r*(c+1)*4 + r*2*(rb + sb)] / bw (norm, mask and update passes
                over the gradient, DP_UPDATE_PASSES fitted to 175 us for 1M x 16 rows; every row's masked update).

  column-wise under rowwise_adagrad with the exact update (settings.column_wise_exact, the runtime's default):
                bwd += 3*n*c*4 / bw + 14*kernel_s + one collective latency (EXACT_COLUMN_*: gradient rows gathered
                per id and added per touched row, the row norms swapped, the rows updated).

Per rank, whatever the plan (`batch_loads`, with B*F bags and B*F*L ids of its own, P = B*F*D*4 pooled bytes):
the sender's permute of its ids by destination and the id check, 2 * max(bags*bag_s, 2*ids*i/bw) (forward
phase), and the regroup of the pooled rows into the output and its gradient, max(bags*bag_s, 2P/bw) + 2P/bw
in the forward and again in the backward phase (on GPUs the Triton regroup's time, kernel_cost.py, + 2P/bw);
and bags*batch_bag_s (first phase): the per-segment cost, beyond bytes, of all the kernels that walk the step's
bags (lookups forward and backward, lengths and offsets of the exchange, permutes, id check, regroup), which
the per-id and per-byte terms miss. In the eager steps it was fitted on it stands for the host's work per feature
and bag, so a step replayed as one CUDA graph (settings.whole_step_graph) is not charged it, and a preset that
prices the host's floor of the eager step (predict.host_times: host_step_s, host_group_s, host_dp_group_s; the
H100's) has it at 0. The H200's, 1.40 ns a bag, is fitted to its device-count steps
(tests/planner/data/measured_steps.json; `bench/planner_predict.py --measured --fit`): hetero124's 124 features,
1.0 M bags a rank, pay 1.4 ms of it.

Shards whose TablePlan.kernel is 'small' (embshard's small-table kernel, GPUs): kernel_cost.py's forward,
backward, hot-row chain (ShardWork.hot_s, paid once per lookup group: its longest), step memory and launches.

Fixed costs (seconds): every step, on every rank, whatever the plan: step_overhead_s (the host's own work the
GPU waits for beyond host_sync_s: a correction `bench/planner_predict.py --refit` fits per GPU model, 0 in the
presets, whose fixed host cost is host_sync_s; first phase, with the own batch's loads); per lookup-kernel group (sharding type x tier x dtype x
weighted) on a rank: kernel_s forward (+8 with the UVM-caching prefetch), 12*kernel_s backward (linearise, sort
passes, run-length encoding, the optimizer kernels); per sharding scheme in the plan: input all-to-all 3
collectives (+1 for weights), output and gradient 1 collective each; once per step when any table is
model-parallel and the step's batch counts are gathered on the GPUs (settings.batch_counts device: the forward's
`gather_batch_counts`, one device sync; `step_fixed`): host_sync_s, the input exchange's host synchronisation and
the launch-bound stretch around it while the GPU idles (a host cost, the same on every GPU model: 0.63 ms fitted
with batch_bag_s to the measured steps of both GPU models, all with device counts; 1.0 ms before, from the idle
time of profiled 2 x H200 steps); nothing with host counts (batch_counts host, the default and the training
pipeline's: each batch counted on the CPU and the rows gathered over a CPU group, no device sync; the 2 x H100
uniform26 step measured both ways, medians of 6 rounds: 4.34 ms host, 5.38 ms device);
data-parallel: one all-reduce latency and 4*kernel_s of update, plus settings.dp_kernels_per_table kernels per
table.

Raw-id tables (ids: raw, embshard/rawids; their maps' memory: memory.py). Their step, in the forward phase, remaps the shard's n ids (`raw_terms`):
n*RAW_ID_BYTES / bw (the time per id as bytes at the copy bandwidth, so it scales with the GPU as the per-id
constants do) plus writing one row and its state per id (the reset list: rows given to new ids, padded; over the
host link for uvm) and r*RAW_ROW_BYTES / bw (LRU: the O(rows) passes over the order; LFU sorts the rows: 4x that).
Raw-id shards form lookup groups of their own (the runtime's LocalShard.group_key), and a group's remap launches
RAW_KERNELS kernels once for all its shards on a rank: RAW_KERNELS*kernel_s per group (`group_fixed`), not per
shard. RAW_KERNELS (60) is counted (170 launches a raw step against 110 static, 1 x H100, 13 tables, the map's
fused step); RAW_ID_BYTES (3101) is FITTED to the measured raw-id step of uniform26 on 2 x NVIDIA H100 80GB HBM3
with NVLink, 2026-11-26 (`python -m torch.distributed.run --standalone --nproc-per-node=2 bench/embshard_dmp.py
--workload uniform26 --ids both --id-space 1 --batches 8 --rounds 3 --steps 20`, counts from the host: 7.71 ms a
step, 13 table-wise raw-id tables a rank; the case in tests/planner/data/measured_steps.json,
`bench/planner_predict.py --measured --fit` refits it); RAW_ROW_BYTES and the reset's bytes are estimates (the
reset's 0.39 ms matches the profiled 0.41 ms of the earlier map). The same constants put a 1-GPU raw step 3.29 ms
above a static one where one process measured 2.62 ms (docs/planner.md).

Storage per shard and the memory of one step: memory.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embshard.planner import exchange as twrw
from embshard.planner import kernel_cost, loads
from embshard.planner.access import distinct_rows, gather, zipf_hit_rate
from embshard.planner.kernel_model import SECTOR as HBM_SECTOR
from embshard.planner.kernel_model import SORT_BYTES_PER_ID
from embshard.planner.memory import ID_BYTES, LENGTH_BYTES, WEIGHT_BYTES, MemoryModel, TableStats
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import GIB, Topology
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.plan import Exchange, LookupKernel, MemoryTier, ShardingType
from embshard.spec.tables import TableConfig

CACHE_PROBE_BYTES = 16
LINK_SECTOR = 64
# Fitted constants of the time model (docs/planner.md "Constants").
CACHE_MISS_LINKS = 1.35
"""A UVM-cache miss costs this many row reads over the link (the read, and the evicted row written back)."""
UVM_REACH_BYTES = 2 * GIB
"""Shards of host memory larger than this miss the GPU's address translation on a growing share of accesses."""
ROUTE_PASSES = 1
"""Segment-wise passes over the bags a model-parallel shard receives: the receiver's permute."""
BATCH_ID_PASSES = 2
"""Segment-wise passes over a rank's own bags: the sender's permute by destination and the id check."""
DP_UPDATE_PASSES = 8
"""Passes of the data-parallel update over the flat gradient, in bytes (norm, mask, update; fitted: 175 us for
1M rows x 16 on an H200, its row-norm kernel runs well below the copy bandwidth)."""
# Exact column-wise row-wise Adagrad (sharding/column_wise.py): its backward instead of the fused one gathers a
# gradient row per id, adds them per touched row and updates those rows (passes over n*c*4 bytes), in about this
# many kernels, with one host sync (the touched-row count) and one small all-to-all per step.
EXACT_COLUMN_PASSES = 3
EXACT_COLUMN_KERNELS = 14
# Raw-id tables' id -> row map (embshard/rawids): fitted, counted and estimated as the module docstring says.
RAW_ID_BYTES = 3101
"""Time per id of the remap as bytes at the copy bandwidth (hbm_bw; 1.11 ns an id on an H100): fitted, not the
bytes the ops move (~1 KB an id: sorts, the unique ids' arrays, two buckets of 16 slots read); the rest is the
latency of its dependent gathers and scatters and, in a multi-GPU step, the launch-bound stretch it adds."""
RAW_ROW_BYTES = 96
"""Bytes moved per row of the shard per step by LRU's order update (LFU: RAW_LFU_FACTOR times that: a sort)."""
RAW_LFU_FACTOR = 4
RAW_KERNELS = 60
"""Kernel launches of one remap, paid once per lookup group of raw-id tables on a rank (its shards share them):
170 launches a raw step against 110 static, counted on an H100 with the map's fused step (13 tables,
bench/raw_ids_profile.py, bench/results/2026-11-26-h100-1gpu-run3)."""
FWD_KERNELS, CACHE_KERNELS, BWD_KERNELS, DP_UPDATE_KERNELS = 1, 8, 12, 4


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
    hot_s: np.ndarray | float = 0.0
    """Small-table kernel: the hottest row's chain of atomic adds (s), paid once per lookup group: its longest."""
    route_s: np.ndarray | float = 0.0
    """Part of fwd_s that does not depend on the kernel: the receiver's permute of the ids (s)."""


class CostModel(MemoryModel):
    """Per-shard work and storage (MemoryModel: memory.py) for one topology, batch size and optimizer."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        optimizer: FusedOptimizerConfig,
        settings: PlannerSettings | None = None,
        exchange: Exchange | str | None = None,
    ) -> None:
        self.topo = topology
        self.batch = batch_size
        self.optimizer = optimizer
        self.settings = settings or PlannerSettings()
        self.out_bytes = float(self.settings.pooled_bytes or 4)
        """Bytes per pooled element: the lookups' output, its exchange, regroup and gradient (lookup.output_dtype)."""
        self.exchange = twrw.resolve(exchange or self.settings.table_row_wise_exchange, topology)
        """The output exchange table-row-wise tables are priced with (exchange.py)."""
        self.hierarchical = self.exchange is Exchange.HIERARCHICAL and twrw.applies(topology)
        s0 = optimizer.state_bytes_per_row(0)
        self.state_fixed = float(s0)
        self.state_per_col = float(optimizer.state_bytes_per_row(1) - s0)
        # FBGEMM keeps one-value-per-row state in HBM even for UVM tables.
        self.state_in_hbm = self.state_per_col == 0
        gpu = topology.is_gpu
        self.mem_bw = topology.hbm_bw if gpu else topology.ddr_bw
        self.sector = HBM_SECTOR if gpu else LINK_SECTOR
        self.l2 = float(topology.l2_bytes) if gpu else 0.0
        self.ar_bw = topology.intra_host_bw if topology.num_hosts == 1 else topology.inter_host_bw
        self.latency = topology.collective_latency_s if topology.num_hosts == 1 else topology.inter_collective_latency_s
        self._fixed: dict[tuple, np.ndarray] = {}
        self.exact_column = self.settings.column_wise_exact and optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD
        self.device_counts = self.settings.batch_counts == "device"
        """The step's batch counts are gathered on the GPUs (one device sync a step: host_sync_s), not counted on
        the host by the training pipeline (settings.batch_counts; unset: host)."""

    def row_reads(self, n, u, row_bytes):
        """Row reads that miss the GPU's L2 among n lookups of u distinct rows: a repeated row is an L2 hit while
        the distinct rows the kernel reads in this step fit in L2 (the TBE kernels read one table after
        another): u + (n - u) * (1 - min(1, l2_bytes / (u * rb))). On CPUs every lookup reads memory."""
        fit = np.clip(self.l2 / np.maximum(u * row_bytes, 1.0), 0.0, 1.0)
        return u + (n - u) * (1.0 - fit)

    def link_row_s(self, table_bytes, row_bytes):
        """Seconds per row read over the host link: uvm_row_s + gather(rb, 64) / uvm_bw, plus uvm_page_s times
        the share of accesses beyond the reach of the GPU's translation of host memory, 1 - 2 GiB / table bytes
        (the whole table's: splitting a table into shards does not shrink the host memory a step touches)."""
        topo = self.topo
        miss = np.clip(1.0 - UVM_REACH_BYTES / np.maximum(table_bytes, 1.0), 0.0, 1.0)
        return topo.uvm_row_s + gather(row_bytes, LINK_SECTOR) / topo.uvm_bw + miss * topo.uvm_page_s

    # ---- time ---------------------------------------------------------------------------------------------
    def work(
        self, t: TableStats, sharding: ShardingType, tier: MemoryTier, rows, cols, clf=0.0, alpha=0.0, kernel=None
    ):
        """ShardWork of one shard (formulas in the module docstring; kernel 'small': kernel_cost.py)."""
        small = kernel is LookupKernel.SMALL and self.topo.is_gpu
        topo, B, bw = self.topo, self.batch, self.mem_bw
        n, bags = self.volumes(t, sharding, rows)
        idb = ID_BYTES + WEIGHT_BYTES * t.weighted
        sb = self.state_bytes(cols)
        u = distinct_rows(n, rows, alpha)
        rb = cols * 4.0 if sharding is ShardingType.DATA_PARALLEL else cols * t.elem
        per_id_f = n * (topo.fwd_id_s + rb * topo.fwd_byte_s)
        per_id_b = n * (topo.bwd_id_s + rb * topo.bwd_byte_s) + u * topo.bwd_row_s
        pooled = bags * cols * self.out_bytes
        if sharding is ShardingType.DATA_PARALLEL:
            W = topo.world_size
            flat = rows * (cols + 1) * 4.0
            fwd = per_id_f + (n * idb + pooled + self.row_reads(n, u, rb) * gather(rb, self.sector)) / bw
            bwd = per_id_b + (n * (SORT_BYTES_PER_ID + cols * self.out_bytes) + pooled + rows * rb) / bw
            ar = 2 * (W - 1) / W * flat / self.ar_bw
            upd = (DP_UPDATE_PASSES * flat + rows * 2 * (rb + sb)) / bw
            extra = self.settings.dp_kernels_per_table * topo.kernel_s / 2
            if small:
                fwd, bwd, hot = kernel_cost.small_times(self, t, sharding, rows, cols, n, bags, u, alpha)
            return ShardWork(0.0, 0.0, fwd + extra, bwd + extra, ar, upd, hot if small else 0.0)
        sent = n / topo.world_size  # ids each rank sends the shard
        if self.settings.sequence_dedup:  # sequence tables send each rank's unique ids of the shard once
            sent = np.where(t.seq > 0, distinct_rows(sent, rows, alpha), sent)
        in_b = B * t.features * (sent / (B * t.features) * idb + LENGTH_BYTES)
        # to each rank: its samples' pooled rows, or (sequence tables) a row per id it sent
        out_b = np.where(t.seq > 0, sent, B * t.features) * cols * self.out_bytes
        fwd_lin = n * idb + pooled
        bwd_lin = n * (SORT_BYTES_PER_ID + cols * self.out_bytes) + pooled
        route = n * topo.routed_id_s + ROUTE_PASSES * bags * topo.bag_s
        reads = self.row_reads(n, u, rb)
        if tier in (MemoryTier.HBM, MemoryTier.HOST):
            g = gather(rb, self.sector)
            fwd = per_id_f + (fwd_lin + reads * g) / bw
            bwd = per_id_b + (bwd_lin + u * 2 * (g + sb)) / bw
        else:
            link = self.link_row_s(t.rows * t.dim * t.elem, rb)
            state = u * 2 * sb / (bw if self.state_in_hbm else topo.uvm_bw)
            if tier is MemoryTier.UVM:
                fwd = per_id_f + fwd_lin / bw + reads * link
                bwd = per_id_b + bwd_lin / bw + u * (link + topo.uvm_bwd_row_s) + state
            else:  # UVM caching: lookups hit the cache (HBM) after the prefetch loaded the misses
                k = np.minimum(np.ceil(clf * rows), rows)
                h = zipf_hit_rate(k, rows, alpha)
                cold = np.maximum(rows - k, 1.0)
                m = np.where(rows > k, cold * -np.expm1(-n * (1 - h) / cold), 0.0)
                g = gather(rb, HBM_SECTOR)
                prefetch = n * topo.bwd_id_s + (n * (SORT_BYTES_PER_ID + CACHE_PROBE_BYTES) + m * rb) / bw
                fwd = per_id_f + prefetch + (fwd_lin + reads * g) / bw + m * CACHE_MISS_LINKS * link
                bwd = per_id_b + (bwd_lin + u * 2 * g) / bw + state
        exact, hot = sharding is ShardingType.COLUMN_WISE and self.exact_column, 0.0
        if small:  # the exact column-wise backward replaces either kernel's
            fwd, bwd, hot = kernel_cost.small_times(self, t, sharding, rows, cols, n, bags, u, alpha, exact, bwd)
        if exact:
            bwd = bwd + EXACT_COLUMN_PASSES * n * cols * self.out_bytes / bw + EXACT_COLUMN_KERNELS * topo.kernel_s
            bwd = bwd + self.latency
        fwd = fwd + self.raw_remap_s(t, tier, n, rows, rb, sb)
        return ShardWork(in_b, out_b, fwd + route, bwd, hot_s=hot, route_s=route)

    def raw_remap_s(self, t: TableStats, tier: MemoryTier, n, rows, rb, sb):
        """Seconds of a raw-id shard's remap per step (0 for other tables; module docstring)."""
        if not np.any(t.raw):
            return 0.0
        return t.raw * sum(self.raw_terms(t, tier, n, rows, rb, sb).values())

    def raw_terms(self, t: TableStats, tier: MemoryTier, n, rows, rb, sb) -> dict[str, np.ndarray | float]:
        """A raw-id shard's remap seconds by term (as if every table were raw; the launches, RAW_KERNELS *
        kernel_s, are its lookup group's: `group_fixed`): 'ids' n * RAW_ID_BYTES / bw, 'rows' the LRU order's
        (LFU's sort) passes, 'reset' a row and its state written per id (over the host link for uvm)."""
        bw = self.mem_bw
        reset_bw = self.topo.uvm_bw if tier is MemoryTier.UVM else bw
        row_passes = rows * RAW_ROW_BYTES * (1 + (RAW_LFU_FACTOR - 1) * t.lfu)
        return {"ids": n * RAW_ID_BYTES / bw, "rows": row_passes / bw, "reset": n * (rb + sb) / reset_bw}

    def batch_loads(self, tables: Sequence[TableConfig]) -> np.ndarray:
        """[NROWS]: what every rank does for its own batch whatever the plan: the sender's permute of its ids by
        destination (forward phase) and the regroup of the pooled rows into the output, forward and backward,
        with a plain copy each way, the per-bag cost of its bags (Topology.batch_bag_s) and the step's fixed cost
        (Topology.step_overhead_s), both in the first phase (module docstring)."""
        v = np.zeros(loads.NROWS)
        if not tables:
            v[loads.PHASE_ROWS[0]] += self.topo.step_overhead_s
            return v
        B, bw, bag = self.batch, self.mem_bw, self.topo.bag_s
        bags = B * sum(len(t.feature_names) for t in tables)
        ids = B * sum(len(t.feature_names) * t.ids_per_bag * (ID_BYTES + WEIGHT_BYTES * t.weighted) for t in tables)
        pooled = B * sum(len(t.feature_names) * _rows_per_bag(t) * t.embedding_dim * self.out_bytes for t in tables)
        permute = BATCH_ID_PASSES * max(bags * bag, 2 * ids / bw)
        regroup = max(bags * bag, 2 * pooled / bw) + 2 * pooled / bw
        v[loads.FWD] = permute + regroup
        v[loads.BWD] = regroup
        if self.topo.is_gpu:  # the Triton regroup (kernel_cost.py), then the same plain copy
            fwd, bwd = kernel_cost.regroup_s(self, B, pooled / (B * self.out_bytes))
            v[loads.FWD] = permute + fwd + 2 * pooled / bw
            v[loads.BWD] = bwd + 2 * pooled / bw
        # whatever the plan; a step replayed as one CUDA graph (settings.whole_step_graph, a plan it holds) does
        # without the per-bag term: fitted on eager steps, it stands for work their host does per feature and bag
        bag_term = 0.0 if self.settings.whole_step_graph is True else bags * self.topo.batch_bag_s
        v[loads.PHASE_ROWS[0]] += self.topo.step_overhead_s + bag_term
        return v

    # ---- load vectors -------------------------------------------------------------------------------------
    def owner_vec(self, wk: ShardWork) -> np.ndarray:
        """[..., NROWS]: what a shard puts on its own rank."""
        topo = self.topo
        W, lws = topo.world_size, topo.local_world_size
        shape = np.broadcast(wk.in_b, wk.out_b, wk.fwd_s, wk.bwd_s).shape
        v = np.zeros((*shape, loads.NROWS))
        bi, bx = topo.intra_host_bw, topo.inter_host_bw
        v[..., loads.IN_RECV_I] = (lws - 1) * wk.in_b / bi
        v[..., loads.IN_RECV_X] = (W - lws) * wk.in_b / bx
        v[..., loads.FWD] = wk.fwd_s
        out_i, out_x = (lws - 1) * wk.out_b / bi, (W - lws) * wk.out_b / bx
        v[..., loads.OUT_SEND_I] = out_i
        v[..., loads.OUT_SEND_X] = out_x
        v[..., loads.GRAD_RECV_I] = out_i
        v[..., loads.GRAD_RECV_X] = out_x
        v[..., loads.BWD] = wk.bwd_s
        v[..., loads.ALLREDUCE] = wk.ar_s
        v[..., loads.DP_UPDATE] = wk.upd_s
        return v

    def peer_vec(self, wk: ShardWork, same_host: bool) -> np.ndarray:
        """[..., NROWS]: what a model-parallel shard puts on another rank of its host (or of another host)."""
        shape = np.broadcast(wk.in_b, wk.out_b).shape
        v = np.zeros((*shape, loads.NROWS))
        bw = self.topo.intra_host_bw if same_host else self.topo.inter_host_bw
        x = 0 if same_host else 1
        v[..., loads.IN_SEND_I + x] = wk.in_b / bw
        v[..., loads.OUT_RECV_I + x] = wk.out_b / bw
        v[..., loads.GRAD_SEND_I + x] = wk.out_b / bw
        return v

    def block_vecs(self, wk: ShardWork, sharding: ShardingType, blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[..., NROWS] each of (owner, same, other): what a block puts on its rank, on each other rank of its
        host and on each rank of the other hosts (`blocks`: its table's block count; table-row-wise under the
        hierarchical exchange: exchange.py)."""
        flat = self.owner_vec(wk), self.peer_vec(wk, True), self.peer_vec(wk, False)
        if sharding is ShardingType.TABLE_ROW_WISE and self.hierarchical:
            return twrw.hierarchical_vecs(self.topo, flat, wk.out_b, blocks)
        return flat

    def group_fixed(
        self, sharding: ShardingType, tier: MemoryTier, kernel=LookupKernel.FBGEMM, raw: bool = False
    ) -> np.ndarray:
        """[NROWS]: kernel launch costs of one lookup group on a rank (do not modify: cached). Raw-id tables form
        groups of their own (the runtime's LocalShard.group_key), whose remap adds RAW_KERNELS launches forward."""
        key = ("group", sharding, tier, kernel, raw)
        if key not in self._fixed:
            self._fixed[key] = self._group_fixed(sharding, tier, kernel, raw)
        return self._fixed[key]

    def scheme_fixed(self, sharding: ShardingType, weighted: bool) -> np.ndarray:
        """[NROWS]: collective latencies of one sharding scheme, on every rank (do not modify: cached)."""
        key = ("scheme", sharding, weighted)
        if key not in self._fixed:
            self._fixed[key] = self._scheme_fixed(sharding, weighted)
        return self._fixed[key]

    def step_fixed(self) -> np.ndarray:
        """[NROWS]: paid once per step when any table is model-parallel, on every rank, with device batch counts:
        the input exchange's host sync (one for all schemes) and the launch-bound stretch around it; 0 with host
        counts (the training pipeline's: no device sync) (do not modify: cached)."""
        key = ("step",)
        if key not in self._fixed:
            v = np.zeros(loads.NROWS)
            if self.topo.world_size > 1 and self.device_counts:
                v[loads.PHASE_ROWS[loads.INPUT]] = self.topo.host_sync_s
            self._fixed[key] = v
        return self._fixed[key]

    def _group_fixed(self, sharding: ShardingType, tier: MemoryTier, kernel: LookupKernel, raw: bool) -> np.ndarray:
        v = np.zeros(loads.NROWS)
        k = self.topo.kernel_s
        v[loads.FWD] = k * (FWD_KERNELS + (CACHE_KERNELS if tier is MemoryTier.UVM_CACHING else 0))
        v[loads.BWD] = BWD_KERNELS * k
        if kernel is LookupKernel.SMALL and self.topo.is_gpu:
            v[loads.FWD], v[loads.BWD] = kernel_cost.SMALL_FWD_KERNELS * k, kernel_cost.SMALL_BWD_KERNELS * k
        if raw:  # the remap of the group's ids, once for all its shards
            v[loads.FWD] += RAW_KERNELS * k
        if sharding is ShardingType.DATA_PARALLEL:
            v[loads.DP_UPDATE] = DP_UPDATE_KERNELS * k
        return v

    def _scheme_fixed(self, sharding: ShardingType, weighted: bool) -> np.ndarray:
        v = np.zeros(loads.NROWS)
        if self.topo.world_size == 1:
            return v
        lat = self.latency
        if sharding is ShardingType.DATA_PARALLEL:
            v[loads.ALLREDUCE] = lat
            return v
        v[loads.PHASE_ROWS[loads.INPUT]] = (3 + int(weighted)) * lat
        if sharding is ShardingType.TABLE_ROW_WISE and self.hierarchical:
            return v + twrw.scheme_latencies(self.topo)
        v[loads.PHASE_ROWS[loads.OUTPUT]] = lat
        v[loads.PHASE_ROWS[loads.GRADIENT]] = lat
        return v


def _rows_per_bag(t: TableConfig) -> float:
    """Output rows per bag of a table: 1 pooled, its ids per bag for a sequence table (one row per id)."""
    return t.ids_per_bag if t.sequence else 1.0
