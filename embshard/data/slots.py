"""Batches from worker processes to the training process through reused blocks of shared memory ("slots").

Per worker a few slots, each a block of shared memory that the worker writes batch after batch: only a new or grown
slot's memory travels (one file descriptor, once); a batch itself travels as a SlotBatch (slot number, array
layout). Writing into pages that already exist costs no page faults; a new block per batch cost the worker about
10 ms for a 14 MB batch of MLPerf multi-hot rows (the kernel's zeroing and faulting of fresh pages), more than
assembling the batch. A slot is in use from the moment the worker takes it until the training process frees it:

    worker: take a free slot of its own (the shared state, under its lock); none free and fewer than per_worker made:
            make one; all in use: a fresh block of shared memory for this batch (never a wait, so a consumer that
            holds every batch cannot stall the workers) -> write the arrays -> send SlotBatch
    training process, two ways:
      - pinned loading (CUDA): SlotBatch.pin_memory() in the DataLoader's pin thread copies the arrays into pinned
        memory (a copy pinned loading makes anyway) and frees the slot at once;
      - CPU: SlotBatch.take() gives tensors that are views of the slot (no copy); the slot stays lent until no tensor
        of the training process uses its memory any more (the storage's use count is back to the count it had when
        the batch arrived), which `Slots.release()` checks before each next batch.

Slots are freed in any order (a consumer may drop batch 5 before batch 4): one state byte per slot records it.
`fresh_shared_arrays` (a new block per batch) remains the worker's fallback.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import uuid
from collections.abc import Callable

import numpy as np
import torch

_TORCH = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}
_READERS: dict[str, Slots] = {}  # training process: the live slot sets, by id
FREE, USED = 0, 1
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # the references to a storage's memory (c10 use count)


def zero_copy_supported() -> bool:
    """Whether this torch tells a storage's use count (the CPU path lends slots to the consumer only then)."""
    return _use_count is not None


def _layout(specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[list, int]:
    """Arrays {key: (shape, dtype)} laid out one after another, 8-byte aligned: [(key, offset, shape, dtype)], bytes."""
    layout, total = [], 0
    for key, (shape, dt) in specs.items():
        dt = np.dtype(dt)
        total = -(-total // 8) * 8
        layout.append((key, total, tuple(int(s) for s in shape), dt.str))
        total += math.prod(shape) * dt.itemsize
    return layout, total


def _view(storage: torch.UntypedStorage, offset: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    dt = np.dtype(dtype)
    return torch.empty(0, dtype=_TORCH[dt]).set_(storage, offset // dt.itemsize, shape)


def fresh_shared_arrays(specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[dict, dict[str, np.ndarray]]:
    """New arrays {key: (shape, dtype)} as tensors carved out of one new block of shared memory: (items for the
    batch dict, numpy views to fill). Sending them copies nothing and passes one file descriptor."""
    layout, total = _layout(specs)
    storage = torch.UntypedStorage._new_shared(max(total, 8))
    tensors = {key: _view(storage, offset, shape, dt) for key, offset, shape, dt in layout}
    return tensors, {k: t.numpy() for k, t in tensors.items()}


class Slots:
    """The slots of one DataLoader: up to `per_worker` slots for each of `workers` workers. pin: the DataLoader's pin
    thread copies batches out (CUDA); otherwise the training process uses them in place (views, lent)."""

    def __init__(self, workers: int, per_worker: int, pin: bool) -> None:
        self.id = uuid.uuid4().hex
        self.per_worker, self.pin = per_worker, pin
        self.state = mp.get_context().Array("b", workers * per_worker)  # FREE / USED per (worker, slot)
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}  # training process: received slots
        self.lent: dict[tuple[int, int], int] = {}  # training process: lent slot -> its storage's use count at arrival
        self.parent = os.getpid()

    def __enter__(self) -> Slots:
        _READERS[self.id] = self
        return self

    def __exit__(self, *exc) -> None:
        _READERS.pop(self.id, None)
        self.storages.clear()  # tensors still in use keep their memory
        self.lent.clear()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["storages"], state["lent"] = {}, {}
        return state

    def _set(self, worker: int, slot: int, value: int) -> None:
        with self.state.get_lock():
            self.state[worker * self.per_worker + slot] = value

    def take(self, sb: SlotBatch, pin: bool = False) -> dict[str, torch.Tensor]:
        """The batch's arrays: views of the slot (CPU loading; the slot is lent until they are all gone: `release`),
        or, for pinned loading, copied out (into pinned memory if pin) and the slot freed at once."""
        key = (sb.worker, sb.slot)
        if sb.storage is not None:
            self.storages[key] = sb.storage
        storage = self.storages[key]
        if self.pin:
            views = [(k, _view(storage, o, s, dt)) for k, o, s, dt in sb.layout]
            out = {k: v.pin_memory() if pin else v.clone() for k, v in views}
            self._set(*key, FREE)
            return out
        self.lent[key] = _use_count(storage._cdata)
        return {k: _view(storage, o, s, dt) for k, o, s, dt in sb.layout}

    def release(self) -> None:
        """Free the lent slots whose memory no tensor uses any more (training process, before each next batch)."""
        for key, base in list(self.lent.items()):
            if _use_count(self.storages[key]._cdata) <= base:
                del self.lent[key]
                self._set(*key, FREE)


class SlotWriter:
    """A worker's end: the arrays of each batch, in a free slot of its own or, when all are in use, in fresh memory."""

    def __init__(self, slots: Slots, worker: int) -> None:
        self.slots, self.worker = slots, worker
        self.storages: list[torch.UntypedStorage | None] = [None] * slots.per_worker
        self.bytes: list[np.ndarray | None] = [None] * slots.per_worker  # each slot's memory as a numpy uint8 array

    def _acquire(self) -> int | None:
        """A free slot (one already made first), marked in use; None when every slot is in use."""
        base, state = self.worker * self.slots.per_worker, self.slots.state
        with state.get_lock():
            free = [s for s in range(self.slots.per_worker) if state[base + s] == FREE]
            if not free:
                return None
            made = [s for s in free if self.storages[s] is not None]
            slot = made[0] if made else free[0]
            state[base + slot] = USED
            return slot

    def __call__(self, specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[dict, dict[str, np.ndarray]]:
        """(items for the batch dict, numpy views to fill) for arrays {key: (shape, dtype)}."""
        if os.getppid() != self.slots.parent:  # the training process is gone
            raise SystemExit(1)
        slot = self._acquire()
        if slot is None:
            return fresh_shared_arrays(specs)
        layout, total = _layout(specs)
        storage, new = self.storages[slot], None
        if storage is None or storage.nbytes() < total:
            storage = new = self.storages[slot] = torch.UntypedStorage._new_shared(max(64, total + total // 4))
            self.bytes[slot] = _view(storage, 0, (storage.nbytes(),), "|u1").numpy()
        mem = self.bytes[slot]
        views = {
            key: mem[offset : offset + math.prod(shape) * np.dtype(dt).itemsize].view(dt).reshape(shape)
            for key, offset, shape, dt in layout
        }
        return {"slot": SlotBatch(self.slots.id, self.worker, slot, new, layout)}, views


class SlotBatch:
    """What a worker sends for a batch's arrays: its slot, the arrays' layout, the slot's memory if new."""

    def __init__(self, slots: str, worker: int, slot: int, storage, layout: list) -> None:
        self.slots, self.worker, self.slot, self.storage, self.layout = slots, worker, slot, storage, layout

    def pin_memory(self, device=None) -> dict[str, torch.Tensor]:
        """Called by the DataLoader's pin thread: the arrays in pinned memory."""
        return _READERS[self.slots].take(self, pin=True)

    def take(self) -> dict[str, torch.Tensor]:
        """In the training process: the arrays (views of the slot, or copies when the slots are for pinning)."""
        return _READERS[self.slots].take(self)


def load(make: Callable[[Slots | None], torch.utils.data.IterableDataset], workers: int, prefetch: int, pin: bool):
    """Batch dicts of the dataset `make(slots)` (batch_size None) read by `workers` processes, whose batches arrive in
    reused shared-memory slots: copied into pinned memory by the DataLoader's pin thread (`pin`), or lent to the
    caller as they are and freed once it drops them (`take_arrays` puts the arrays into the dict). Without the use
    counts that tell when a lent slot is free (CPU), `make(None)`: fresh shared memory per batch."""
    if not pin and not zero_copy_supported():
        yield from torch.utils.data.DataLoader(
            make(None), batch_size=None, num_workers=workers, prefetch_factor=prefetch
        )
        return
    # per worker: its batches in flight and a few the caller holds (more: fresh memory for those batches)
    with Slots(workers, prefetch + (2 if pin else 4), pin=pin) as slots:
        loader = torch.utils.data.DataLoader(
            make(slots), batch_size=None, num_workers=workers, pin_memory=pin, prefetch_factor=prefetch
        )
        for d in loader:
            yield d
            slots.release()


def take_arrays(d: dict) -> None:
    """Put the arrays of a worker's batch dict into it, in place of its "slot" entry: views of the slot (copies in
    pinned memory when the slots are for pinning), or the fresh shared memory it came in."""
    if "slot" in d:
        arrays = d.pop("slot")
        d.update(arrays.take() if isinstance(arrays, SlotBatch) else arrays)
