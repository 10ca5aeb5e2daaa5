"""The sharded collection's own state that a training loop steers: its step count and whether its batches weigh
every id (a padded batch). `ShardedEmbeddingBagCollection` holds it (a mixin over its `schemes`); each piece has one
writer, through the methods here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


class StepCount:
    """A collection's step count (`step`, `set_step`, `advance_step`)."""

    _step: int = 0

    @property
    def step(self) -> int:
        """Training forwards so far (with grad enabled), which every rank must agree on (errors name it). Written
        here alone: each training forward adds one; a loop labels its batches with `set_step` (a resumed run, a
        pipeline running batches ahead), a step trained without the forward (a graph's replay) `advance_step`."""
        return self._step

    def set_step(self, step: int) -> None:
        """Set the step count to `step` (the step the next training forward runs: `step` + 1 after it)."""
        if int(step) != step or step < 0:
            raise ValueError(f"{type(self).__name__}.set_step({step!r}): the step must be a whole number >= 0")
        self._step = int(step)

    def advance_step(self) -> None:
        """Count one training step run without the forward (as the forward counts its own)."""
        self._step += 1


class StepState(StepCount):
    """The step count (StepCount) and the padded batches' flag (`weighing_every_id`) of a collection made of
    `schemes`."""

    schemes: nn.ModuleList

    @contextmanager
    def weighing_every_id(self) -> Iterator[None]:
        """While active, every scheme sends and every lookup pools with the batch's per-id weights, also for tables
        without weights (ids of a batch without weights weigh 1): a padded batch's fillers weigh 0, so they add
        nothing to a bag and get no gradient (embshard/collection/padding.py; the graphs that pad their batches)."""
        before = self.every_id_weighted
        for scheme in self.schemes:
            scheme.weigh_every_id(True)
        try:
            yield
        finally:
            for scheme in self.schemes:
                scheme.weigh_every_id(before)

    @property
    def every_id_weighted(self) -> bool:
        """Whether `weighing_every_id` is active."""
        return any(scheme.every_id_weighted for scheme in self.schemes)
