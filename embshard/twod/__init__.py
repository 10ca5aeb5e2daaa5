"""2D sharding: the ranks form sharding groups (contiguous ranges of `ShardingPlan.sharding_group_size` ranks, e.g.
the GPUs of one host); each group holds one sharded copy of the model-parallel tables, and the groups are
data-parallel replicas of each other (TorchRec's `DMPCollection`).

- `groups`: the process groups: this rank's sharding group, and its replica set (the ranks of its index within a
  group, one per group).
- `batch`: exact mode's exchange: every replica set gathers its ranks' batches, so every group looks up the whole
  world's batch, and in backward the replicas' output gradients are gathered back (`gather_replica_batch`,
  `own_rows`).
- `sync`: periodic mode's averaging of weights and optimizer state over the replicas (`average_replicas`).
"""

from embshard.twod.batch import ReplicaRows, gather_replica_batch, own_rows
from embshard.twod.groups import TwoDGroups, twod_groups
from embshard.twod.sync import average_replicas

__all__ = ["ReplicaRows", "TwoDGroups", "average_replicas", "gather_replica_batch", "own_rows", "twod_groups"]
