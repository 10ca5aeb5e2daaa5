"""The `runtime:` section: how the training job's processes guard against hangs and bad numbers."""

from __future__ import annotations

from dataclasses import dataclass

from embshard.spec.tables import FieldError


@dataclass(frozen=True)
class RuntimeConfig:
    """Watchdog and numeric guard of the training job."""

    collective_timeout_s: float = 600.0
    """Seconds (s) a collective may take before the waiting rank raises an error naming the step and the exchange,
    instead of hanging; the process group's own timeout is this plus 60 s."""
    nan_check: bool = False
    """Stop before the update when the loss or a pooled embedding is NaN or Inf, naming the step, table and feature
    (costs one host sync per step)."""

    def __post_init__(self) -> None:
        if not self.collective_timeout_s > 0:
            raise FieldError(
                "collective_timeout_s", self.collective_timeout_s, "it must be a positive number of seconds"
            )
