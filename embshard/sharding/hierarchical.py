"""The hierarchical output exchange of table-row-wise sharding: partial sums reduced inside each host, then one
all-to-all between hosts.

Ranks are h * L + j: local rank j of host h, H hosts of L ranks (the plan's local_world_size). A table-row-wise
table's row blocks sit on the ranks of one host, and each of them pools partial sums for the global batch. The flat
exchange (row_blocks.py) sends every block's partials to every sample's rank, so a sample's pooled row of such a
table crosses the slow links between hosts once per block (up to L times). Here, for one step, on every rank:

1. input dist: as the flat scheme's, except that the receiver lays the global batch out by (local rank j, host g)
   rather than by source rank (`source_order`): the samples S_j of ranks g * L + j, g = 0..H-1, are contiguous.
2. intra-host reduce-scatter, on the host's sub-group: an all-to-all sends local rank j, from every rank of the
   host, that rank's partials of S_j; j adds them up per feature (in rank order: deterministic, and the same
   additions as the flat exchange's) into the pooled rows of all its host's tables for S_j, `[|S_j|, D_h]`.
3. cross-host all-to-all, on the peer sub-group of the ranks with local index j (one per host): rank h * L + j
   sends each peer g * L + j the rows of that rank's own samples. Each rank receives one `[B_local, D_g]` block
   from every host g that has table-row-wise tables: each sample's row crosses hosts once.
Backward is the reverse: the gradients' all-to-all between peers, then the intra-host all-to-all that hands every
block's rank the gradient of its partials (the sum's backward copies the gradient: an all-gather inside the host).
Every rank issues both all-to-alls every step, whatever it holds and whatever its batch (zero-sized parts).

Bytes per step, per table of host h, with P = B_local x D x 4 (equal batches): flat, each block's rank sends
(L - 1) P inside the host and (H - 1) L P to other hosts; hierarchical, each block's rank sends (L - 1) H P inside
the host and each rank of host h sends (H - 1) P to other hosts: L times fewer bytes over the links between hosts,
H times more over the local ones, and one collective more. The planner prices both (planner/cost.py) and writes
its choice into the plan (`ShardingPlan.table_row_wise_exchange`). With one host or one rank per host the two are
the same exchange, and the flat one runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from embshard.runtime.comm import start_all_to_all
from embshard.runtime.distributed import host_groups
from embshard.sharding.base import OutputLayout, ShardingContext
from embshard.sharding.exchange import LocalIds, PooledExchangeHandle, SparseExchangeHandle, start_sparse_exchange
from embshard.sharding.row_blocks import RowBlockSharding
from embshard.spec.plan import TablePlan
from embshard.spec.tables import TableConfig


class HierarchicalRowBlockSharding(RowBlockSharding):
    """Row blocks within one host per table (table-row-wise), with the hierarchical output exchange. `entries`:
    (table index, table, plan) of the scheme's tables in collection order; `local_world_size`: ranks per host."""

    def __init__(
        self,
        entries: Sequence[tuple[int, TableConfig, TablePlan]],
        ctx: ShardingContext,
        local_world_size: int,
        name: str = "table_row_wise",
    ) -> None:
        super().__init__(entries, ctx, name)
        L = local_world_size
        H = self.world_size // L
        self.local_world_size, self.num_hosts = L, H
        # Output: one block per host with table-row-wise tables, its tables' features in collection order.
        host_keys: list[list[str]] = [[] for _ in range(H)]
        dims: dict[str, int] = {}
        for _, cfg, tp in entries:
            host_keys[tp.shards[0].rank // L] += cfg.feature_names
            dims.update(dict.fromkeys(cfg.feature_names, cfg.embedding_dim))
        host_dims = [[dims[k] for k in keys] for keys in host_keys]
        self.host_widths = [sum(d) for d in host_dims]
        self.layout = OutputLayout(
            keys=[k for keys in host_keys for k in keys],
            key_dims=[d for ds in host_dims for d in ds],
            out_keys=[keys for keys in host_keys if keys],
            out_dims=[ds for ds in host_dims if ds],
        )
        # Each rank's pooled columns (its route keys) in its host's output columns.
        self._host_cols = []
        for d in range(self.world_size):
            keys = host_keys[d // L]
            starts = dict(zip(keys, accumulate([dims[k] for k in keys], initial=0)))
            cols = [c for k in self.route_keys[d] for c in range(starts[k], starts[k] + dims[k])]
            self._host_cols.append(torch.tensor(cols, dtype=torch.int64, device=ctx.device))
        # The lookup's rows: the global batch by (local rank j, host g), so that each S_j is contiguous.
        self._source_order = [g * L + j for j in range(L) for g in range(H)]
        self._groups = host_groups(ctx.group, L)

    def start_input_dist(self, ids: LocalIds, batch_sizes: list[int]) -> SparseExchangeHandle:
        """Send each rank the ids of its blocks; it receives them with the samples ordered by (local rank, host)."""
        label = f"{self.name} ids"
        return start_sparse_exchange(
            ids, self.n_features, batch_sizes, self.group, self.rank, label, source_order=self._source_order
        )

    def start_output_dist(self, pooled: torch.Tensor, batch_sizes: list[int]) -> PooledExchangeHandle:
        """Reduce the host's partial sums onto the local ranks (all-to-all + sum inside the host), then send each
        sample's rows to its rank (all-to-all between peers); `.wait()` gives one block per host with tables."""
        L, H, B = self.local_world_size, self.num_hosts, batch_sizes
        host, j = divmod(self.rank, L)
        n = [sum(B[g * L + i] for g in range(H)) for i in range(L)]  # |S_i|: rows of each local rank's samples
        local = range(host * L, (host + 1) * L)
        dims = self.dims_per_rank
        parts = [n[j] * dims[r] for r in local]
        intra = start_all_to_all(
            pooled.reshape(-1),
            [m * dims[self.rank] for m in n],
            parts,
            self._groups.intra,
            f"{self.name} pooled intra-host all-to-all",
        )
        width = self.host_widths[host]
        summed = pooled.new_zeros(n[j], width, dtype=torch.float32)  # sum in fp32, as the flat exchange does
        for part, r in zip(intra.wait().split(parts), local):  # every part, empty ones too: the same graph
            summed = summed.index_add(1, self._host_cols[r], part.view(n[j], dims[r]).float())
        reduced = summed.to(pooled.dtype)  # rows of S_j: rank j's samples, then rank L + j's, ...
        cross = start_all_to_all(
            reduced.reshape(-1),
            [B[g * L + j] * width for g in range(H)],
            [B[self.rank] * w for w in self.host_widths],
            self._groups.peers,
            f"{self.name} pooled cross-host all-to-all",
        )
        return PooledExchangeHandle(cross, B[self.rank], self.host_widths)
