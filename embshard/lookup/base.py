"""Mixins of the lookup contract (lookup/__init__.py).

`NoCache`: the cache methods of a lookup without a UVM cache (host, data-parallel and small-table lookups).
`CountedSteps`: `optimizer_step` of a lookup that counts its optimizer's steps itself, in `self._step`.
`EveryIdWeighted`: the flag that makes a lookup pool every id with the batch's weights (a padded batch).
`set_shards`: the shards, lookup features and their widths every lookup keeps.
`ShardLookup`: the constructor the lookups over one group of compatible shards share (TBE, host, small-table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions

if TYPE_CHECKING:
    from embshard.lookup.shards import LocalShard


class NoCache:
    """No-op cache methods for lookups that have no HBM cache of UVM rows."""

    def prefetch(self, indices, offsets, forward_stream=None) -> None:
        """No cache: nothing to load ahead."""

    def drop_cache(self) -> None:
        """No cache: nothing to drop."""

    def cache_stats(self) -> dict[str, dict]:
        """No cache: no statistics."""
        return {}

    def reset_cache_stats(self) -> None:
        """No cache: nothing to reset."""


class EveryIdWeighted:
    """`every_id_weighted`: the lookup pools every id with the per-id weights it is given, also for tables without
    weights (a padded batch: its filler ids weigh 0, so they add nothing to a bag and get no gradient;
    embshard/collection/padding.py). Set by the scheme the lookup serves (`Scheme.weigh_every_id`), for the steps
    of a graph that pads its batches; False otherwise. A backward weighs the ids as its forward did."""

    every_id_weighted: bool = False


class CountedSteps:
    """`optimizer_step` read and written as `self._step`, the count a lookup's own update rule advances."""

    _step: int

    @property
    def optimizer_step(self) -> int:
        """Steps the optimizer has taken (Adam's bias-correction count)."""
        return self._step

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        self._step = step


def set_shards(lookup: object, shards: Sequence[LocalShard]) -> None:
    """Give `lookup` its group of shards: `shards` (in order), `features` (the lookup keys, shard after shard) and
    `dims` (each key's width)."""
    lookup.shards = list(shards)
    lookup.features = [f for s in shards for f in s.features]
    lookup.dims = [s.shard.num_cols for s in shards for _ in s.features]


class ShardLookup(EveryIdWeighted, nn.Module):
    """A lookup over one group of compatible shards (one optimizer, one set of lookup options).

    The constructor keeps what every such lookup keeps (`set_shards`, `weighted`: whether the group's tables take
    per-sample weights, `optimizer`, `options`), then lets the lookup build its weights and optimizer state on
    `device` in `_build`. `seed` None draws the initial rows on the device, not reproducibly (`init_rows`)."""

    def __init__(
        self,
        shards: Sequence[LocalShard],
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        seed: int | None = 0,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        set_shards(self, shards)
        self.weighted = shards[0].table.weighted
        self.optimizer = optimizer
        self.options = options or LookupOptions()
        self._build(device, seed)

    def _build(self, device: torch.device, seed: int | None) -> None:
        """The lookup's weights (initial rows drawn from `seed`) and optimizer state, on `device`."""
        raise NotImplementedError(f"{type(self).__name__} does not build its weights")
