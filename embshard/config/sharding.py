"""The `sharding:` section: 2D sharding, sharding groups that are data-parallel replicas of each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.spec.tables import FieldError

REPLICA_SYNCS = ("exact", "periodic")


@dataclass(frozen=True)
class ShardingConfig:
    """2D sharding (docs/architecture.md, 2D sharding): the ranks form sharding groups of `group_size` ranks (e.g.
    the GPUs of one host), each group holds one copy of the model-parallel tables, planned for `group_size` ranks,
    and the groups are data-parallel replicas of each other."""

    group_size: int | Literal["auto"] | None = None
    """Ranks per sharding group: a divisor of the world size, a multiple or a divisor of the ranks per host (null: no
    2D, every rank in one group). planner.plan_file, if set, is then one group's plan. auto: the planner picks the
    group size with the fastest predicted step (planner/twod.py plan_at_scale, priced with replica_sync and
    replica_sync_every; a multiple of the ranks per host, or no 2D) and plans the group; the job prints the per-size
    table."""
    replica_sync: str = "exact"
    """How the groups' replicas stay together: exact (every step the update of the whole world's batch, as without
    2D) or periodic (each group trains on its own ranks' batches; weights and optimizer state are averaged over the
    groups every replica_sync_every steps)."""
    replica_sync_every: int = 1
    """replica_sync periodic: steps between two averagings (>= 1)."""

    def __post_init__(self) -> None:
        g = self.group_size
        if g is not None and g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise FieldError(
                "group_size",
                g,
                "it must be a number of ranks >= 1 dividing the world size, auto (the planner picks) or null (no 2D)",
            )
        if self.replica_sync not in REPLICA_SYNCS:
            raise FieldError("replica_sync", self.replica_sync, f"choose one of {list(REPLICA_SYNCS)}")
        n = self.replica_sync_every
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FieldError("replica_sync_every", n, "it must be an integer >= 1")
