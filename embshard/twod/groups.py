"""The process groups of a 2D layout: sharding groups (the id and pooled exchanges run inside them) and replica
sets (the ranks holding the same shards, one per group: exact mode's batch and gradient gathers, periodic mode's
averaging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from embshard.spec.tables import ConfigError


@dataclass(frozen=True)
class TwoDGroups:
    """This rank's sharding group and replica set, for groups of `group_size` ranks: group g is ranks
    [g * group_size, (g + 1) * group_size); rank g * group_size + i is rank i of group g."""

    sharding: dist.ProcessGroup
    """This rank's sharding group: its `group_size` ranks, in rank order."""
    replicas: dist.ProcessGroup
    """The ranks of this rank's index within a group, one per group, in group order."""
    group_index: int
    """This rank's group (0 .. num_groups - 1)."""
    num_groups: int
    """Sharding groups, i.e. replicas of the model-parallel tables."""
    group_size: int
    """Ranks per sharding group."""


_GROUPS: dict[tuple, tuple[object, TwoDGroups]] = {}  # (default group's name, G) -> (the default group, its groups)


def twod_groups(group_size: int) -> TwoDGroups:
    """The sharding group and replica set of this rank for sharding groups of `group_size` ranks of the default
    process group. Collective: every process calls it, in the same order (torch's new_group rule); made once per
    (default group, group_size) and reused."""
    world, me = dist.get_world_size(), dist.get_rank()
    G = group_size
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or world % G:
        raise ConfigError(f"sharding_group_size={G!r} does not divide the {world} ranks of the job")
    parent = dist.group.WORLD
    key = (getattr(parent, "group_name", None) or id(parent), G)
    if key not in _GROUPS or _GROUPS[key][0] is not parent:  # a new default group may reuse a name
        backend = dist.get_backend(parent)
        R = world // G
        sharding = replicas = None
        for g in range(R):  # every process creates every group, in this order
            pg = dist.new_group(list(range(g * G, (g + 1) * G)), backend=backend)
            sharding = pg if me // G == g else sharding
        for i in range(G):
            pg = dist.new_group([g * G + i for g in range(R)], backend=backend)
            replicas = pg if me % G == i else replicas
        _GROUPS[key] = (parent, TwoDGroups(sharding, replicas, me // G, R, G))
    return _GROUPS[key][1]
