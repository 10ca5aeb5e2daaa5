"""The batch every loader yields for one rank: dense features, sparse features (a torchrec KeyedJaggedTensor),
labels, and for training batches of file sources the data position after the batch (for exact resume).

Batches come out of the loaders on the CPU (pinned when the source pins them); `pin_memory()` and
`to(device, non_blocking=True)` let a pipelined training loop copy the next batch while the current one trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One rank's batch: dense `[B, num_dense]` float32, sparse KeyedJaggedTensor (keys in table order, lengths
    `[F * B]` int32, ids int64), labels `[B]` float32, `position` (the source position after this batch, a small
    dict for checkpoints; None for evaluation and synthetic batches) and `times` (sequence sources: each id of the
    sequence feature's time, int64 seconds in the ids' order; else None)."""

    dense: torch.Tensor
    sparse: object  # torchrec KeyedJaggedTensor
    labels: torch.Tensor
    position: dict | None = None
    times: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device` (non_blocking: asynchronous from pinned memory)."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position,
            None if self.times is None else self.times.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory (needs CUDA; a copy)."""
        times = None if self.times is None else self.times.pin_memory()
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(), self.position, times)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the batch's device tensors as used on `stream` (when it was copied on another stream)."""
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)
        if self.times is not None:
            self.times.record_stream(stream)
