"""`embshard plan` at scale: the sharding group size (2D sharding), the dense model's compute and all-reduce, and the
predicted step time and samples per second per GPU (embshard/planner/twod.py, dense.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from embshard.planner.dense import DenseSpec, dlrm_dense
from embshard.planner.twod import SYNC_MODES
from embshard.spec.tables import ConfigError


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
        default="exact",
        help="2D sharding: how the groups' replicas stay equal: exact (the touched rows' gradients every step) or "
        "periodic (weights and state every --replica-sync-every steps)",
    )
    p.add_argument("--replica-sync-every", type=int, default=100, help="periodic replica sync: steps between syncs")


def check_args(args: argparse.Namespace) -> None:
    """The group-size flags' values (ConfigError naming the flag, the value and the fix)."""
    if args.replica_sync_every < 1:
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


def dense_spec(cfg: Any) -> DenseSpec | None:
    """The dense part of a training config's (a TrainConfig's) DLRM or DLRM-DCNv2 model; None for planner inputs
    (cfg None) and other kinds: the prediction is then the embedding step alone."""
    if cfg is None:
        return None
    m = cfg.model
    if m.kind not in ("dlrm", "dlrm_dcnv2") or m.dlrm is None:
        return None
    syn = cfg.data.synthetic
    num_dense = syn.num_dense if syn is not None else 13
    dims = {t.embedding_dim for t in m.tables}
    dim = max(dims)
    features = sum(len(t.feature_names) for t in m.tables)
    dcn = m.dcn if m.kind == "dlrm_dcnv2" else None
    layers, rank = (dcn.num_layers, dcn.low_rank) if dcn is not None else (0, 0)
    precision = "bf16" if cfg.training.precision == "bf16" else "fp32"
    return dlrm_dense(num_dense, dim, features, m.dlrm.bottom_mlp, m.dlrm.top_mlp, layers, rank, precision)


def search_for(search_plan: Callable, inp: Any) -> Callable:
    """The search plan_at_scale runs per candidate group: the training job's (policy.search_plan), on `inp`."""

    def search(tables, topo, batch_size, optimizer, constraints, settings):
        return search_plan(tables, topo, batch_size, optimizer, constraints, settings, print)

    return search
