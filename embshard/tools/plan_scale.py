"""`embshard plan` at scale: the sharding group size (2D sharding), the dense model's compute and all-reduce, and the
predicted step time and samples per second per GPU (embshard/planner/twod.py, dense.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from embshard.planner.twod import SYNC_MODES, group_sizes
from embshard.spec.tables import ConfigError
from embshard.training.group_plan import dense_spec

__all__ = ["add_args", "check_args", "dense_spec", "search_for"]


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of the group-size search."""
    p.add_argument(
        "--group-size",
        type=int,
        help="2D sharding: plan only this sharding group size (a divisor of the world size, a multiple of the ranks "
        "per host; the world size: no 2D); default: the planner picks",
    )
    p.add_argument(
        "--replica-sync",
        choices=list(SYNC_MODES),
        help="2D sharding: how the groups' replicas stay equal: exact (the touched rows' gradients every step) or "
        "periodic (weights and state every --replica-sync-every steps); default: a training config's "
        "sharding.replica_sync, else exact",
    )
    p.add_argument(
        "--replica-sync-every",
        type=int,
        help="periodic replica sync: steps between syncs (default: a training config's sharding.replica_sync_every, "
        "else 100)",
    )


def check_args(args: argparse.Namespace) -> None:
    """The group-size flags' values (ConfigError naming the flag, the value and the fix)."""
    if args.replica_sync_every is not None and args.replica_sync_every < 1:
        raise ConfigError(
            f"--replica-sync-every {args.replica_sync_every} is invalid: the steps between two periodic syncs, >= 1"
        )
    W = args.world_size
    L = args.local_world_size or min(W, 8)
    g = args.group_size
    if g is not None and (g < 1 or W % g or (g % L and g != W)):
        raise ConfigError(
            f"--group-size {g} is invalid with --world-size {W} and {L} ranks per host: give a divisor of the world "
            f"size that is a multiple of the ranks per host, e.g. --group-size {L}, or leave it out (the planner picks)"
        )


def apply_config(args: argparse.Namespace, cfg: Any) -> None:
    """The group-size flags left out, taken from a training config's (a TrainConfig's, None for planner inputs)
    `sharding:` section: replica_sync and replica_sync_every, and group_size where it is a number of ranks the search
    can price (auto and null: every group size is priced, as `embshard train` does for auto); else the defaults
    (exact, every 100 steps)."""
    twod = cfg.sharding if cfg is not None else None
    if args.replica_sync is None:
        args.replica_sync = twod.replica_sync if twod is not None else "exact"
    if args.replica_sync_every is None:
        args.replica_sync_every = twod.replica_sync_every if twod is not None else 100
    g = twod.group_size if twod is not None else None
    if args.group_size is None and isinstance(g, int):
        W = args.world_size
        L = args.local_world_size or min(W, 8)
        if g in group_sizes(W, L):
            args.group_size = g
        else:
            print(
                f"note: sharding.group_size={g} is not a group size the search prices on {W} ranks of {L} per host "
                f"(one of {group_sizes(W, L)}): pricing every group size",
                file=sys.stderr,
            )


def search_for(search_plan: Callable, inp: Any, dense: Any = None) -> Callable:
    """The search plan_at_scale runs per candidate group: the training job's (policy.search_plan, its graph choice
    priced with the dense model `dense`, a DenseSpec or None), on `inp`."""

    def search(tables, topo, batch_size, optimizer, constraints, settings):
        return search_plan(tables, topo, batch_size, optimizer, constraints, settings, print, dense)

    return search
