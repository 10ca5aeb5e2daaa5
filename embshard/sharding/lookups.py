"""`build_lookups`: a rank's shards grouped by `LocalShard.group_key`, one lookup module per group: FBGEMM's TBE,
the host lookup (CPU Adam / weight decay) or embshard's small-table kernel (TablePlan.kernel 'small')."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard.kernels.small_tables import SmallTableLookup
from embshard.lookup.host import HostLookup
from embshard.lookup.shards import LocalShard, group_shards
from embshard.lookup.tbe import TBELookup
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import LookupOptions
from embshard.spec.plan import LookupKernel


def build_lookups(
    shards: Sequence[LocalShard],
    optimizer: FusedOptimizerConfig,
    device: torch.device,
    seed: int,
    options: LookupOptions | None = None,
) -> list[nn.Module]:
    """Group shards by settings, one lookup module per group (first-seen group order, shard order kept)."""
    use_host = device.type == "cpu" and (optimizer.kind is OptimizerKind.ADAM or optimizer.weight_decay > 0)
    out = []
    for g in group_shards(shards):
        if g[0].kernel is LookupKernel.SMALL:
            out.append(SmallTableLookup(g, optimizer, device, seed, options))
        else:
            out.append((HostLookup if use_host else TBELookup)(g, optimizer, device, seed, options))
    return out
