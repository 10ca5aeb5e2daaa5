"""`ReplicaState`: what a sharded collection does under a 2D plan (`ShardingPlan.sharding_group_size`;
embshard/twod): its sharding group and replica set, exact mode's gathered batch and own output rows, periodic
mode's averaging of the replicas.

A mixin of `ShardedEmbeddingBagCollection` (sharded.py), which calls `_sharding_groups` once while it is built,
`_replica_input` on every local batch, `_own_rows` on every output and `_periodic_sync` at every forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from embshard.runtime.comm import world_and_rank
from embshard.spec.plan import ReplicaSync, ShardingPlan, ShardingType
from embshard.spec.tables import ConfigError, TableConfig
from embshard.twod import ReplicaRows, TwoDGroups, average_replicas, gather_replica_batch, own_rows


class ReplicaState:
    """The 2D methods of a sharded collection (see the module docstring)."""

    plan: ShardingPlan
    schemes: Sequence[Any]
    tables: Sequence[TableConfig]
    twod: TwoDGroups | None = None
    """This rank's sharding group and replica set under a 2D plan with several groups, else None."""
    _rows: ReplicaRows | None = None
    _synced_at = 0

    def _sharding_groups(self, plan: ShardingPlan, group: dist.ProcessGroup | None, options: Any) -> tuple:
        """(the plan one group holds, the group the schemes exchange in, this rank in it, its size, the group the
        data-parallel tables sum their gradients over: None for the schemes' group). Collective under 2D."""
        world, rank = world_and_rank(group)
        if plan.sharding_group_size is None or plan.num_replicas == 1:
            return plan, group, rank, world, None
        from embshard.twod import twod_groups

        if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
            raise ConfigError(
                "a 2D plan (sharding_group_size) makes its sharding groups of the default process group: build the "
                "collection without group= (or on a group of every process in rank order)"
            )
        raw = [t.name for t in self.tables if t.raw_ids]
        if raw:
            raise ConfigError(
                f"raw-id tables {raw} cannot be 2D sharded yet (each group's id maps would admit ids apart): plan "
                "without sharding_group_size"
            )
        periodic = plan.replica_sync is ReplicaSync.PERIODIC
        if periodic and options.prefetch_pipeline:
            raise ConfigError(
                "replica_sync: periodic rewrites the weights between steps, which a UVM cache filled ahead "
                "(LookupOptions.prefetch_pipeline) would hide: turn prefetch_pipeline off or use replica_sync: exact"
            )
        self.twod = twod_groups(plan.sharding_group_size)
        sharding = self.twod.sharding
        dp_group = dist.group.WORLD if periodic else None  # exact: every group already sees the world's batch
        return plan.group_plan(), sharding, dist.get_rank(sharding), plan.group_size, dp_group

    @property
    def replica_index(self) -> int:
        """This rank's sharding group (0 without 2D): group 0's replica is the one checkpoints save."""
        return self.twod.group_index if self.twod is not None else 0

    @property
    def _exact(self) -> bool:
        return self.twod is not None and self.plan.replica_sync is ReplicaSync.EXACT

    def _replica_input(self, lengths_FB: torch.Tensor, values: torch.Tensor, weights, keys: Sequence[str]) -> tuple:
        """Exact 2D: the replica set's batches gathered (`gather_replica_batch`), remembered for `_own_rows`;
        otherwise the local batch as it is."""
        if not self._exact:
            return lengths_FB, values, weights
        lengths_FB, values, weights, self._rows = gather_replica_batch(
            lengths_FB, values, weights, keys, self.twod.replicas
        )
        return lengths_FB, values, weights

    def _own_rows(self, out: dict[str, torch.Tensor], prefetched: Any) -> dict[str, torch.Tensor]:
        """Exact 2D: this rank's rows of the gathered batch's outputs (the backward gathers the replicas'
        gradients), the batch of the `prefetched` handle or else the last one gathered; otherwise `out`."""
        if not self._exact:
            return out
        return own_rows(out, prefetched.rows if prefetched is not None else self._rows)

    def sync_replicas(self) -> None:
        """Periodic 2D: average the model-parallel tables' weights and optimizer state over the replicas now
        (collective over every rank; a checkpoint save calls it first). Nothing otherwise: exact replicas are
        equal, and data-parallel tables are summed over the world every step."""
        if self.twod is None or self.plan.replica_sync is not ReplicaSync.PERIODIC:
            return
        dp = {t.table for t in self.plan.tables if t.sharding_type is ShardingType.DATA_PARALLEL}
        self.drop_caches()  # written back and emptied before the weights are written
        tensors = [w for name, _, w in self.local_shards() if name not in dp]
        tensors += [v for name, _, st in self.local_optimizer_states() if name not in dp for v in st.values()]
        with torch.no_grad():
            average_replicas(tensors, self.twod.replicas)
        self._synced_at = self.step

    def _periodic_sync(self) -> None:
        """At a training forward: average the replicas if `replica_sync_every` steps ran since the last average."""
        if self.twod is None or self.plan.replica_sync is not ReplicaSync.PERIODIC or not torch.is_grad_enabled():
            return
        if self.step > 0 and self.step % self.plan.replica_sync_every == 0 and self._synced_at != self.step:
            self.sync_replicas()

    def replica_difference(self) -> float:
        """The largest difference between replicas of this job's shards (weights and optimizer state), relative to
        the shard's size: a float64 sum and sum of squares of each tensor, compared over each replica set, the
        largest over every rank (collective). 0.0 when the replicas are bitwise equal, and without 2D. (On GPUs,
        FBGEMM's backward may add a row's many gradients in another order on each group: exact replicas can then
        differ in the last bits.)"""
        if self.twod is None:
            return 0.0
        tensors = [w for _, _, w in self.local_shards()]
        tensors += [v for _, _, st in self.local_optimizer_states() for v in st.values()]
        sums = [torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]
        mine = torch.cat(sums).to(self.device) if sums else torch.zeros(0, dtype=torch.float64, device=self.device)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, dist.ReduceOp.MIN, group=self.twod.replicas)
        dist.all_reduce(high, dist.ReduceOp.MAX, group=self.twod.replicas)
        scale = torch.maximum(low.abs(), high.abs()).clamp(min=1e-30)
        worst = ((high - low) / scale).max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        worst = worst.reshape(1).to(self.device)
        dist.all_reduce(worst, dist.ReduceOp.MAX)
        return float(worst.item())

    def replica_report(self) -> str:
        """One line on the 2D layout at the end of a run, periodic replicas averaged first (collective)."""
        self.sync_replicas()
        twod, diff = self.twod, self.replica_difference()
        same = "identical" if diff == 0 else f"differ (largest relative checksum difference {diff:.1e})"
        sync = self.plan.replica_sync.value
        return f"2D: {twod.num_groups} sharding groups of {twod.group_size} ranks, replica_sync {sync}; replicas {same}"
