"""An `IdMap`'s training step as a CUDA graph (idmap.py; the step itself: step.py and the package docstring).

The Triton step is ~50 launches (the remap's kernels and torch cumsums, the LRU order's two passes, one
reset launch per storage and the zero rows' fills) around well under a millisecond of GPU work: the host's launch
work, not the GPU, sets its time. So a training step of a map that qualifies (`graph_refusal`) replays one graph
holding all of it, and the host pays the replay and three copies: the ids into a static buffer, the step's host
values into another (one pinned copy), the rows out.

Fixed shapes: the graph is captured for a capacity of N ids (10% over the step's ids, a multiple of 64: the
padded batches' rule, embshard/spec/geometry.py), the step's n <= N ids at positions 0..n-1 of the static ids and
pads past them (`step.pad_ids`: key INT64_MAX, shard T; never looked up, admitted or counted, rows 0, no reset).
Every count the kernels follow is read on the device: n = bounds[T], the misses (counted by the probe), the
admitted ids from their cumsum, the LRU window's end wb[T] under the fixed bound min(N, usable rows). The static host values: the shards'
first positions and n, the LRU window's bounds, the rows' stream keys (a fresh draw per step where the map's seed is
None). A step over the capacity captures again for its own (the old graphs are dropped).

The LRU order is rebound by every step (`reorder_` writes a new one): the map keeps two order buffers and one graph
per direction (0 -> 1, 1 -> 0), and replays the one that reads the buffer `order` is now (an order from elsewhere,
e.g. a rebuild, is first copied into buffer 0). The device clock (`IdMap.clock_t`) advances inside the graph; the
host clock after the replay.

The first step at a capacity runs the graph's body eagerly on a side stream (it compiles the kernels for these
shapes before any capture), then captures both graphs in a private pool; a failed capture warns once and leaves the
map on the eager step. The output rows are copied out of the static buffer (the lookup's backward keeps them; the
next replay overwrites the buffer).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from embshard.rawids.index import triton_for
from embshard.rawids.reset import Resets
from embshard.runtime.graphs import capture, warm_up
from embshard.spec.geometry import capacity, offsets

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from embshard.rawids.state import MapState

GRAPH_ENV = "EMBSHARD_RAWID_GRAPH"


def graph_choice() -> bool:
    """EMBSHARD_RAWID_GRAPH: 1 (the default: training steps on CUDA replay a CUDA graph where `graph_refusal`
    allows) or 0 (the eager step, to compare with)."""
    choice = os.environ.get(GRAPH_ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{GRAPH_ENV}={choice!r} is invalid: set 1 (the graphed step, the default) or 0 (eager)")
    return choice == "1"


def graph_refusal(m: MapState, ids: torch.Tensor) -> str | None:
    """Why `m`'s training step on `ids` runs eagerly, or None: the graph takes CUDA tensors, the map's step and reset
    on their Triton kernels, LRU eviction only, no admission counting (admit_min_count 1 for every table), weights
    in the table's own type and no capture under way (a map whose own capture failed: its `MapGraph.refused`)."""
    if ids.device.type != "cuda":
        return "not on CUDA"
    if not (triton_for(m.map_kernel, ids.device) and triton_for(m.reset_kernel, ids.device)):
        return "the map's step or reset on torch ops (EMBSHARD_RAWID_KERNELS)"
    if m.lfu:
        return "LFU eviction (its victims: a sort of the rows)"
    if m.sketching:
        return "admission counting (admit_min_count > 1: the sketch's torch ops)"
    if torch.cuda.is_current_stream_capturing():
        return "inside another graph's capture (the eager step is captured with it)"
    return None


def step_capacity(n: int) -> int:
    """The ids a graph is captured for when a step has n: the padded batches' rule (`geometry.capacity`)."""
    return int(capacity(n))


def padded_step(
    m: MapState, ids: torch.Tensor, vals: torch.Tensor, W: int, order_out: torch.Tensor | None, stores: tuple | None
) -> tuple[torch.Tensor, Resets]:
    """One training step of `m` on padded inputs, the graph's body (it runs eagerly too): `ids` `[N]` the step's ids
    at 0..n-1 (the rest anything), `vals` int64 on the device: bounds `[T + 1]` (the shards' first positions, n),
    the LRU window's bounds `[T + 1]`, the stream keys `[T]`; `W` the window's fixed bound. The remap (pads never
    looked up, admitted or counted), the LRU order's update into `order_out` (`m.order` becomes it), the device
    clock's advance, and with `stores` (`m.storages(lookup)`) the reset: the zero rows and the rows given to new ids.
    The host clock is the caller's to advance. Returns (rows `[N]`: the first n the step's, pads 0; the reset list:
    -1 at the pads)."""
    from embshard.rawids.step import pad_ids, train_triton  # here: it imports triton, which a CPU run never needs

    T = m.T
    bounds, wb, keys = vals[: T + 1], vals[T + 1 : 2 * T + 2], vals[2 * T + 2 :]
    ids, shard_of = pad_ids(ids, bounds)
    rows, given, listed = train_triton(m, ids, shard_of, bounds, wb, W, padded=True)
    if m.lru:
        m._reorder(m.clock, m.row_used, order_out)
    m.clock_t.add_(1)
    resets = Resets(given, shard_of, [], listed)
    if stores is not None:
        with torch.no_grad():
            for st in (*stores[0], *stores[1]):
                st.flat.index_fill_(0, st.zero_elems, 0)
            m._reset_listed(stores[0], stores[1], resets, keys)
    return rows, resets


def step_values(m: MapState, counts: Sequence[int], keys: Sequence[int]) -> list[int]:
    """A padded step's host values (`padded_step`'s `vals`): the shards' first positions and n, the LRU window's
    bounds (per shard min(its ids, its usable rows)), the stream keys."""
    n = sum(counts)
    window = [min(c, u) for c, u in zip(counts, m.usable_host)]
    return offsets(counts) + [n] + offsets(window) + [sum(window)] + list(keys)


class MapGraph:
    """The graphed training steps of one `IdMap` (the module docstring): two graphs (one per order buffer) for the
    capacity `N`, their static inputs and outputs."""

    def __init__(self, m: MapState) -> None:
        self.m = m
        self.refused: str | None = None  # set when a capture failed: the map stays on the eager step
        self.N = 0
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.outs: list[torch.Tensor] = []
        self.orders: list[torch.Tensor] = []
        self.captures = 0
        self._stream: torch.cuda.Stream | None = None
        self._lookup: int | None = None
        self._keys: list[int] | None = None

    def step(self, ids: torch.Tensor, counts: Sequence[int], lookup: nn.Module) -> torch.Tensor | None:
        """The training step of `ids` (`counts[s]` of shard s) through the graph: local rows `[n]`; None where the
        step must run eagerly (weights whose reset the kernels do not write)."""
        m, n = self.m, ids.numel()
        counts = [int(c) for c in counts]
        if sum(counts) != n or len(counts) != m.T:
            raise ValueError(f"IdMap.forward: counts {counts} do not add up to the {n} ids of {m.T} shards")
        stores = m.storages(lookup)
        if any(st.round_fp16 for st in stores[0]):
            self.refused = "fp16 tables in wider storage (their reset rounds on torch ops)"
            return None
        if self.graphs is not None and (n > self.N or self._lookup != id(lookup)):
            self.graphs, self.outs = None, []  # a new capacity or lookup: capture again
        fresh = self.graphs is None
        dev = ids.device
        if fresh:
            self.N, self._lookup = step_capacity(n), id(lookup)
            self._ids = torch.empty(self.N, dtype=torch.int64, device=dev)
            self._vals = torch.empty(3 * m.T + 2, dtype=torch.int64, device=dev)
            if not self.orders:
                self.orders = [torch.empty_like(m.order) for _ in range(2)]
        if m.seed is None:  # a fresh stream per step
            keys = m.stream_keys(None)
        else:
            if self._keys is None:
                self._keys = m.stream_keys(m.seed)
            keys = self._keys
        host = torch.tensor(step_values(m, counts, keys), dtype=torch.int64)
        self._vals.copy_(host.pin_memory() if dev.type == "cuda" else host, non_blocking=True)
        self._ids[:n].copy_(ids)
        p = 1 if m.order is self.orders[1] else 0
        if m.order is not self.orders[p]:  # an order from elsewhere (the eager step, a rebuild)
            self.orders[0].copy_(m.order)
        if fresh:
            rows = self._warm_up_and_capture(stores, p, n)
        else:
            self.graphs[p].replay()
            rows = self.outs[p][:n].clone()
        m.order = self.orders[1 - p]
        m.clock += 1
        return rows

    def _body(self, stores: tuple, p: int) -> torch.Tensor:
        m = self.m
        m.order = self.orders[p]
        W = min(self.N, m.Ord)
        return padded_step(m, self._ids, self._vals, W, self.orders[1 - p], stores)[0]

    def _warm_up_and_capture(self, stores: tuple, p: int, n: int) -> torch.Tensor:
        """This step eagerly on the capture stream (the kernels compile for the capacity's shapes), then the capture
        of both directions' graphs (which computes nothing). Returns this step's rows."""
        bodies = [functools.partial(self._body, stores, q) for q in (0, 1)]
        rows = self._eagerly(lambda: bodies[p]()[:n].clone())
        try:
            self.graphs, self.outs = self._capture(bodies)
        except Exception as e:  # the eager step from now on; this step's work is done
            self.refused = f"capturing its step failed ({type(e).__name__}: {e})"
            warnings.warn(
                f"raw-id map of tables {[s.table.name for s in self.m.shards]}: {self.refused}; its training steps "
                f"run eagerly (set {GRAPH_ENV}=0 to skip the capture)",
                RuntimeWarning,
                stacklevel=4,
            )
            return rows
        self.captures += 1
        return rows

    def _eagerly(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """fn() on the capture stream, ordered after and before the current stream's work."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._ids.device)
        return warm_up(fn, self._ids.device, stream=self._stream, record_output=True)

    def _capture(
        self, bodies: list[Callable[[], torch.Tensor]]
    ) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
        """The graphs of `bodies` (one private pool: they never run at once, and each output is copied out right
        after its replay) and their outputs."""
        pool = torch.cuda.graph_pool_handle()
        graphs, outs = [], []
        for body in bodies:
            graph, out = capture(body, stream=self._stream, pool=pool)
            graphs.append(graph)
            outs.append(out)
        return graphs, outs
