"""CUDA graph capture: a step's warm-up on a side stream, then its capture into a `torch.cuda.CUDAGraph`.

A step captured as a CUDA graph must first run outside the capture: its lazy initialisations (cuBLAS workspaces,
kernels compiled for the step's shapes, constants made once per device, the allocator's blocks of the stream) must
not happen under capture. Both happen on a side stream ordered after the caller's earlier work and before its later
work, so the caller's stream never waits on a capture:

    warm_up(fn, device)           fn() on the side stream (`iterations` times), the caller's stream waiting for it
    capture(body)                 body() captured into a new graph (in `pool` if given), thread-local capture mode
    warm_up_and_capture(...)      both, one after the other, the capture inside the caller's `around()` context
                                  (what the capture needs set; what a failed capture restores, or raises instead)

`stream`: the side stream, kept by the caller from one capture to the next (the warm-up and the capture then run on
the same stream), or None: a fresh stream for the warm-up and torch's own capture stream for the capture.
The capture mode is thread-local: the host threads beside the capturing one (a pipeline's batch preparation pins
memory, NCCL's watchdog queries events) may make calls that a global capture would fail on.

A failed capture raises what the body or torch raised, and leaves no graph: what a failure must restore (counters
the body advanced, work it left queued) is the caller's, around `capture`. Torch only: nothing here knows what the
step computes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import torch

__all__ = ["capture", "warm_up", "warm_up_and_capture"]

T = TypeVar("T")
U = TypeVar("U")


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of an output: a tensor, or a tuple or list of them (other items skipped)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def warm_up(
    fn: Callable[[], T],
    device: torch.device,
    *,
    stream: torch.cuda.Stream | None = None,
    iterations: int = 1,
    record_output: bool = False,
) -> T:
    """`fn()` run `iterations` times on `stream` (None: a fresh side stream), after the current stream's queued work
    and before its later work; returns the last run's output. `record_output`: the output's tensors (a tensor, or a
    tuple or list of them), made on the side stream, are recorded on the current stream, which reads them (their
    memory is not reused before the current stream's queued work is done)."""
    if iterations < 1:
        raise ValueError(f"warm_up: iterations must be at least 1, got {iterations}")
    current = torch.cuda.current_stream(device)
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(iterations):
            out = fn()
    current.wait_stream(side)
    if record_output:
        for t in _tensors(out):
            t.record_stream(current)
    return out


def capture(
    body: Callable[[], T],
    *,
    stream: torch.cuda.Stream | None = None,
    pool: tuple | None = None,
) -> tuple[torch.cuda.CUDAGraph, T]:
    """`body()` captured into a new CUDA graph on `stream` (None: torch's capture stream), its memory from `pool`
    (a `torch.cuda.graph_pool_handle()` or another graph's `pool()`; None: a pool of its own). Returns the graph and
    the body's output: static tensors that each replay overwrites. The capture computes nothing."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = body()
    return graph, out


def warm_up_and_capture(
    body: Callable[[], T],
    device: torch.device,
    *,
    warm: Callable[[], U] | None = None,
    stream: torch.cuda.Stream | None = None,
    pool: tuple | None = None,
    iterations: int = 1,
    record_output: bool = False,
    around: Callable[[], AbstractContextManager] | None = None,
) -> tuple[U | T, torch.cuda.CUDAGraph, T]:
    """`warm_up(warm or body, ...)`, then `capture(body, ...)` on the same `stream` inside `around()` if given (a
    context of the capture alone: what the capture needs set, and what a failed capture restores or raises instead;
    a failed warm-up is not its business). Returns (the warm-up's output, the graph, the capture's output)."""
    out = warm_up(warm or body, device, stream=stream, iterations=iterations, record_output=record_output)
    with around() if around is not None else nullcontext():
        graph, captured = capture(body, stream=stream, pool=pool)
    return out, graph, captured
