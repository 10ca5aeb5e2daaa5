"""The two output exchanges of table-row-wise tables, priced level by level (the runtime: sharding/table_row_wise.py,
sharding/hierarchical.py).

Notation as cost.py's: H hosts of L ranks, B samples per rank, bi = intra_host_bw, bx = inter_host_bw; a
table-row-wise table on host h has k row blocks (on k distinct ranks of h), F features and D columns, and
P = B*F*D*4 bytes is one rank's samples' pooled rows of it (fp32).

  flat          each block's rank sends every other rank its partials of that rank's samples: (L-1) P over
                the host's links, (H-1) L P to the other hosts; each rank of another host receives k P (cost.py's
                owner / peer vectors, phases "output all-to-all" and "gradient all-to-all").
  hierarchical  "output intra-host reduce": each block's rank sends every other rank of its host the partials of
                that rank's sample set S_j (the samples of its peers on every host, H B samples): (L-1) H P, and
                every rank of h receives H P from each block rank but itself. "output all-to-all": each of the L
                ranks of h sends its peers on the other hosts their samples' summed rows, (H-1) P, and each rank
                of another host receives P. Backward mirrors both ("gradient all-to-all", then "gradient
                intra-host gather"). Fixed costs: one collective within a host (collective_latency_s) in each
                intra-host phase, one across hosts in each exchange between hosts.

So hierarchical moves L times fewer bytes between hosts and H times more inside them. Per unit P, for a table
with L blocks, it wins when (L-1) H / bi + (H-1) / bx < max((H-1) L / bx, (L-1) / bi): on 2 hosts of 8 H100
(290 / 45 GB/s) 0.070 against 0.178 ns per byte; on the cpu preset with 2 hosts of 2 (2 / 1 GB/s) it ties (and
its extra collective loses). With `table_row_wise_exchange: auto` (the default) the search prices table-row-wise
with the exchange that wins per unit on the topology, then the planner predicts the final placement under both
and keeps the faster (planner/search.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embshard.planner import loads
from embshard.planner.topology import Topology
from embshard.spec.plan import Exchange, ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig

AUTO = "auto"


def applies(topo: Topology) -> bool:
    """Whether the two exchanges differ on this topology (several hosts, several ranks per host)."""
    return topo.num_hosts > 1 and topo.local_world_size > 1


def unit_times(topo: Topology) -> dict[Exchange, float]:
    """Seconds per byte of P (one rank's pooled rows of one table with L blocks), forward and backward, of each
    exchange, latencies aside (module docstring)."""
    H, L, bi, bx = topo.num_hosts, topo.local_world_size, topo.intra_host_bw, topo.inter_host_bw
    flat = max((H - 1) * L / bx, (L - 1) / bi)
    hier = (L - 1) * H / bi + (H - 1) / bx
    return {Exchange.FLAT: 2 * flat, Exchange.HIERARCHICAL: 2 * hier}


def resolve(setting: str | Exchange, topo: Topology) -> Exchange:
    """The exchange the search prices table-row-wise with: the setting, or for auto the one that wins per unit on
    `topo` (flat on a tie, and wherever the two are the same exchange)."""
    if str(getattr(setting, "value", setting)) != AUTO:
        return Exchange(setting)
    if not applies(topo):
        return Exchange.FLAT
    t = unit_times(topo)
    return Exchange.HIERARCHICAL if t[Exchange.HIERARCHICAL] < t[Exchange.FLAT] * (1 - 1e-9) else Exchange.FLAT


def hierarchical_vecs(
    topo: Topology, flat: tuple[np.ndarray, np.ndarray, np.ndarray], out_b, blocks
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[..., NROWS] loads of a table-row-wise block under the hierarchical exchange on its rank (owner), on each other
    rank of its host (same) and on each rank of the other hosts (other), from the flat exchange's vectors `flat`
    (cost.py's owner / peer vectors; their input rows are kept), the block's pooled bytes per rank `out_b` (P) and
    its table's block count k (`blocks`). Terms every rank of the host pays once per table (its peers' rows) are
    split evenly over the k blocks: a rank with a block gets its own share and the k-1 others' through `same`, a
    rank without one k shares."""
    H, L, bi, bx = topo.num_hosts, topo.local_world_size, topo.intra_host_bw, topo.inter_host_bw
    owner, same, other = (v.copy() for v in flat)
    out_rows = [loads.OUT_SEND_I, loads.OUT_SEND_X, loads.OUT_RECV_I, loads.OUT_RECV_X]
    grad_rows = [loads.GRAD_SEND_I, loads.GRAD_SEND_X, loads.GRAD_RECV_I, loads.GRAD_RECV_X]
    for v in (owner, same, other):
        v[..., out_rows + grad_rows] = 0.0
    P, k = np.asarray(out_b, dtype=float), np.maximum(np.asarray(blocks, dtype=float), 1.0)
    set_bytes = H * P / bi  # a sample set S_j's partials over the host's links
    peers = (H - 1) * P / (k * bx)  # the share of one block in a host rank's rows to its peers
    owner[..., loads.OUT_RS_SEND] = (L - 1) * set_bytes
    owner[..., loads.GRAD_AG_RECV] = (L - 1) * set_bytes
    same[..., loads.OUT_RS_RECV] = set_bytes
    same[..., loads.GRAD_AG_SEND] = set_bytes
    for v in (owner, same):
        v[..., loads.OUT_SEND_X] = peers
        v[..., loads.GRAD_RECV_X] = peers
    other[..., loads.OUT_RECV_X] = P / (k * bx)
    other[..., loads.GRAD_SEND_X] = P / (k * bx)
    return owner, same, other


def scheme_latencies(topo: Topology) -> np.ndarray:
    """[NROWS]: the hierarchical exchange's collectives: one inside the host before and after the exchange between
    hosts (the input exchange's are cost.py's)."""
    v = np.zeros(loads.NROWS)
    v[loads.PHASE_ROWS[loads.OUT_REDUCE]] = topo.collective_latency_s
    v[loads.PHASE_ROWS[loads.OUTPUT]] = topo.inter_collective_latency_s
    v[loads.PHASE_ROWS[loads.GRADIENT]] = topo.inter_collective_latency_s
    v[loads.PHASE_ROWS[loads.GRAD_GATHER]] = topo.collective_latency_s
    return v


def exchange_bytes(
    plan: ShardingPlan, tables: Sequence[TableConfig], batch_sizes: Sequence[int], elem_bytes: int = 4
) -> dict[Exchange, dict[str, float]]:
    """Bytes the table-row-wise tables' output exchange moves per step under each exchange, forward (the gradients
    move as many backward), summed over the ranks: {"intra_host": ..., "cross_host": ...}. `batch_sizes`: every
    rank's local batch; `elem_bytes`: of the pooled rows (4 fp32, 2 fp16/bf16)."""
    W, L = plan.world_size, plan.local_world_size
    H = W // L
    B = np.asarray(batch_sizes, dtype=float)
    host_of = np.arange(W) // L
    S = np.array([B[j::L].sum() for j in range(L)])  # sample set sizes |S_j|
    flat, hier = [0.0, 0.0], [0.0, 0.0]
    for t in tables:
        tp = plan[t.name]
        if tp.sharding_type is not ShardingType.TABLE_ROW_WISE:
            continue
        row = len(t.feature_names) * t.embedding_dim * elem_bytes
        h = tp.shards[0].rank // L
        mine, rest = B[host_of == h], B[host_of != h]
        for s in tp.shards:
            flat[0] += (mine.sum() - B[s.rank]) * row
            flat[1] += rest.sum() * row
            hier[0] += (S.sum() - S[s.rank % L]) * row
        hier[1] += rest.sum() * row if H > 1 else 0.0
    if H == 1 or L == 1:  # the runtime runs the flat exchange there
        hier = list(flat)
    names = ("intra_host", "cross_host")
    return {Exchange.FLAT: dict(zip(names, flat)), Exchange.HIERARCHICAL: dict(zip(names, hier))}
