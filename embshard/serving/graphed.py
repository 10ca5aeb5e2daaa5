"""Scoring through CUDA graphs: the whole scoring call (offsets, the TBE lookup, mean pooling, the dense part and the
id check) captured once per bucket of batch size and id count, then replayed.

A batch of B samples and V ids goes to the bucket (Bb, Vb): Bb the power of two at or above B (up to `max_batch`),
Vb the smallest `Bb * F * 2^k` (k >= 0) at or above V, F the features. The bucket's static inputs are filled in
place: the lengths `[F, Bb]` with the batch's bags first and empty bags after them (pooled to zeros, their scores
sliced off), the ids and per-id weights first in their `[Vb]` buffers (the rest lies past the last bag's end:
never read), the dense features in the first B rows `[Bb, N]` (the others hold whatever an earlier batch left:
every row is scored on its own). Ids on the host go through pinned memory with non-blocking copies; ids already on
the GPU are copied on the device. Nothing in a call waits for the GPU, except the one read of the id check's count
when the ids arrive on the GPU (see `GraphedScorer.run`).

Where no graph is used, `run` returns None and says why in `last_fallback`: a batch over `max_batch` samples,
`max_graphs` buckets already captured, or a capture that failed (then no more are tried: `broken`). On the CPU (`capture=False`) the same padded buffers are scored eagerly, so
the bucketing, padding and slicing run and are tested there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embshard.runtime.graphs import warm_up_and_capture

MAX_BATCH = 16384
"""Default largest batch scored through a graph (bigger ones run eagerly)."""
MAX_GRAPHS = 64
"""Default most buckets captured (each holds its inputs, and its activations in the graphs' shared pool)."""

Body = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(lengths `[F, Bb]`, ids `[Vb]`, per-id weights `[Vb]` or None, dense `[Bb, N]`) -> (logits `[Bb]`, count of ids
outside their tables `[1]`), with no host sync (it is captured)."""


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch` (at least 1)."""
    return 1 << max(0, batch - 1).bit_length()


def id_bucket(ids: int, batch_bucket: int, features: int) -> int:
    """The smallest `batch_bucket * features * 2^k` (k >= 0) at or above `ids`."""
    size = max(1, batch_bucket * features)
    while size < ids:
        size *= 2
    return size


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` ready for a non-blocking copy into a `dtype` tensor on `device`. From the host to a GPU: converted on
    the host (a conversion inside the copy would go through pageable memory, and wait) and pinned. On the device
    already: as it is (the copy converts it in the same kernel)."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.to(dtype).pin_memory()
    return t


class PaddedInputs:
    """The static inputs of one bucket (`Bb` samples, `Vb` ids) on `device`, filled in place (module docstring)."""

    def __init__(self, features: int, num_dense: int, Bb: int, Vb: int, weighted: bool, device: torch.device) -> None:
        self.device, self.Bb, self.Vb = device, Bb, Vb
        self.lengths_FB = torch.zeros(features, Bb, dtype=torch.int64, device=device)
        self.values_V = torch.zeros(Vb, dtype=torch.int64, device=device)
        self.weights_V = torch.ones(Vb, dtype=torch.float32, device=device) if weighted else None
        self.dense_BN = torch.zeros(Bb, num_dense, dtype=torch.float32, device=device)

    def fill(
        self, lengths_FB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None, dense_BN: torch.Tensor
    ) -> None:
        """Copy a batch of at most Bb samples and Vb ids in (no host sync)."""
        B, V = lengths_FB.shape[1], values.numel()
        if B > self.Bb or V > self.Vb:
            raise ValueError(f"a batch of {B} samples and {V} ids does not fit a bucket of {self.Bb} and {self.Vb}")
        self.lengths_FB[:, :B].copy_(_on(lengths_FB, self.device, torch.int64), non_blocking=True)
        if B < self.Bb:
            self.lengths_FB[:, B:].zero_()
        if V:
            self.values_V[:V].copy_(_on(values, self.device, torch.int64), non_blocking=True)
        if self.weights_V is not None and V:
            if weights is None:
                self.weights_V[:V].fill_(1.0)
            else:
                self.weights_V[:V].copy_(_on(weights, self.device, torch.float32), non_blocking=True)
        self.dense_BN[:B].copy_(_on(dense_BN, self.device, torch.float32), non_blocking=True)

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return self.lengths_FB, self.values_V, self.weights_V, self.dense_BN


@dataclass
class _Bucket:
    inputs: PaddedInputs
    graph: torch.cuda.CUDAGraph | None
    outputs: tuple[torch.Tensor, torch.Tensor] | None


class GraphedScorer:
    """`run(lengths_FB, values, weights, dense_BN, finish, count_bad)` -> (finish(logits `[B]`), ids outside their
    tables) through the batch's bucket: captured on first use (`capture=True`, a CUDA device), replayed afterwards;
    or None with the reason in `last_fallback`. `finish` turns the bucket's static logits (overwritten by the next
    call) into the caller's own tensor (e.g. `torch.sigmoid`, `torch.clone`). `count_bad`: read the graph's count
    of ids outside their tables (the one host sync of a call; otherwise 0 is returned unread: the caller checked
    the ids on the host). Calls from several threads take turns."""

    def __init__(
        self,
        body: Body,
        features: int,
        num_dense: int,
        weighted: bool,
        device: torch.device,
        max_batch: int = MAX_BATCH,
        max_graphs: int = MAX_GRAPHS,
        capture: bool = True,
    ) -> None:
        if max_batch < 1 or max_graphs < 1:
            raise ValueError(f"max_batch {max_batch} and max_graphs {max_graphs} must be at least 1")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.body, self.features, self.num_dense, self.weighted = body, features, num_dense, weighted
        self.device, self.max_batch, self.max_graphs, self.capture = device, max_batch, max_graphs, capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.last_fallback: str | None = None
        self.broken: str | None = None
        self.replays = 0
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if capture else None
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def describe(self) -> str:
        if self.broken:
            return f"eager: {self.broken}"
        what = "CUDA graphs" if self.capture else "padded buckets (no graph: CPU)"
        return (f"{what} per bucket of batch size (powers of two up to {self.max_batch} samples) and id count; "
                f"{len(self.buckets)} of at most {self.max_graphs} made")  # fmt: skip

    def run(
        self,
        lengths_FB: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        dense_BN: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor] = torch.clone,
        count_bad: bool = False,
    ) -> tuple[torch.Tensor, int] | None:
        F, B = lengths_FB.shape
        if F != self.features:
            raise ValueError(f"lengths of {F} features, the scorer has {self.features}")
        if self.broken:
            self.last_fallback = self.broken
            return None
        if B > self.max_batch:
            self.last_fallback = f"a batch of {B} samples is over the graphs' largest ({self.max_batch})"
            return None
        Bb = batch_bucket(B)
        key = (Bb, id_bucket(values.numel(), Bb, F))
        with self._lock:
            bucket = self.buckets.get(key)
            if bucket is None:
                if len(self.buckets) >= self.max_graphs:
                    self.last_fallback = f"{self.max_graphs} buckets are made already (max_graphs); {key} is not"
                    return None
                try:
                    bucket = self.buckets[key] = self._make(*key)
                except RuntimeError as e:  # an operation CUDA cannot capture: every call runs eagerly from now on
                    self.broken = self.last_fallback = f"the capture of bucket {key} failed ({e})"
                    return None
            bucket.inputs.fill(lengths_FB, values, weights, dense_BN)
            if bucket.graph is not None:
                bucket.graph.replay()
                logits_Bb, bad_1 = bucket.outputs
            else:
                logits_Bb, bad_1 = self.body(*bucket.inputs.args())
            self.replays += 1
            self.last_fallback = None
            out = finish(logits_Bb[:B])
            return out, int(bad_1) if count_bad else 0

    def _make(self, Bb: int, Vb: int) -> _Bucket:
        inputs = PaddedInputs(self.features, self.num_dense, Bb, Vb, self.weighted, self.device)
        if not self.capture:
            return _Bucket(inputs, None, None)
        _, graph, outputs = warm_up_and_capture(
            lambda: self.body(*inputs.args()), self.device, stream=self._stream, pool=self._pool
        )
        return _Bucket(inputs, graph, outputs)
