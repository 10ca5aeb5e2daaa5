"""Batches from worker processes to the training process through shared memory, two ways:

- `fresh_shared_arrays` (CPU training): every batch is written into a new block of shared memory, which the training
  process maps and uses as it is (no copy; one file descriptor passed per batch). The worker pays page faults and
  the kernel's zeroing of the new pages (about 10 ms for a 14 MB batch of MLPerf multi-hot rows here).
- `Slots` (CUDA: batches are copied into pinned memory anyway): per worker a few slots of shared memory written
  again and again, freed once the DataLoader's pin thread has copied the batch out:

    training process: Slots (per worker a semaphore counting its free slots) -> DataLoader workers start
    worker: take a free slot (wait on its semaphore) -> write the batch's arrays into the slot's shared memory
            (grown when too small; only a new or grown slot's memory travels, as one file descriptor)
            -> send a SlotBatch: slot number, array layout, small metadata
    training process: SlotBatch.pin_memory() (the DataLoader's pin thread, when CUDA is available) or .take()
            copies the arrays out (into pinned memory or the CPU allocator) and frees the slot

Slots are freed in the order they were filled, so a counting semaphore per worker is the whole protocol. Without
CUDA the copy out of a slot would land in fresh memory of the training process, moving the page faults there, so
CPU training uses fresh blocks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import numpy as np
import torch

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}
_READERS: dict[str, Slots] = {}  # training process: the live slot sets, by id


def fresh_shared_arrays(specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[dict, dict[str, np.ndarray]]:
    """New arrays {key: (shape, dtype)} as tensors carved out of one new block of shared memory: (items for the
    batch dict, numpy views to fill). Sending them copies nothing and passes one file descriptor."""
    offsets, total = {}, 0
    for k, (shape, dt) in specs.items():
        total = -(-total // 8) * 8  # 8-byte aligned
        offsets[k] = total
        total += int(np.prod(shape)) * np.dtype(dt).itemsize
    storage = torch.UntypedStorage._new_shared(max(total, 8))
    tensors, views = {}, {}
    for k, (shape, dt) in specs.items():
        dt = np.dtype(dt)
        tensors[k] = torch.empty(0, dtype=_TORCH[dt]).set_(storage, offsets[k] // dt.itemsize, shape)
        views[k] = tensors[k].numpy()
    return tensors, views


class Slots:
    """The slots of one DataLoader: `per_worker` slots for each of `workers` workers."""

    def __init__(self, workers: int, per_worker: int) -> None:
        self.id = uuid.uuid4().hex
        self.per_worker = per_worker
        self.free = [mp.get_context().Semaphore(per_worker) for _ in range(workers)]
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}  # training process: received slots
        self.parent = os.getpid()

    def __enter__(self) -> Slots:
        _READERS[self.id] = self
        return self

    def __exit__(self, *exc) -> None:
        _READERS.pop(self.id, None)
        self.storages.clear()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["storages"] = {}
        return state

    def take(self, sb: SlotBatch, pin: bool) -> dict[str, torch.Tensor]:
        """The batch's arrays copied out of its slot (into pinned memory if pin), and the slot freed."""
        if sb.storage is not None:
            self.storages[(sb.worker, sb.slot)] = sb.storage
        storage = self.storages[(sb.worker, sb.slot)]
        out = {}
        for key, offset, shape, dtype in sb.layout:
            dt = np.dtype(dtype)
            view = torch.empty(0, dtype=_TORCH[dt]).set_(storage, offset // dt.itemsize, shape)
            out[key] = view.pin_memory() if pin else view.clone()
        self.free[sb.worker].release()
        return out


class SlotWriter:
    """A worker's end: hands out the next slot's arrays for a batch."""

    def __init__(self, slots: Slots, worker: int) -> None:
        self.slots, self.worker = slots, worker
        self.count = 0
        self.storages: list[torch.UntypedStorage | None] = [None] * slots.per_worker

    def __call__(self, specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[dict, dict[str, np.ndarray]]:
        """(items for the batch dict, numpy views to fill) for arrays {key: (shape, dtype)}."""
        while not self.slots.free[self.worker].acquire(timeout=1.0):
            if os.getppid() != self.slots.parent:  # the training process is gone
                raise SystemExit(1)
        slot = self.count % self.slots.per_worker
        self.count += 1
        layout, total = [], 0
        for key, (shape, dt) in specs.items():
            total = -(-total // 8) * 8  # 8-byte aligned
            layout.append((key, total, tuple(shape), np.dtype(dt).str))
            total += int(np.prod(shape)) * np.dtype(dt).itemsize
        storage, new = self.storages[slot], None
        if storage is None or storage.nbytes() < total:
            storage = new = self.storages[slot] = torch.UntypedStorage._new_shared(max(64, total + total // 4))
        views = {}
        for key, offset, shape, dt in layout:
            dt = np.dtype(dt)
            views[key] = torch.empty(0, dtype=_TORCH[dt]).set_(storage, offset // dt.itemsize, shape).numpy()
        return {"slot": SlotBatch(self.slots.id, self.worker, slot, new, layout)}, views


class SlotBatch:
    """What a worker sends for a batch's arrays: its slot, the arrays' layout, the slot's memory if new."""

    def __init__(self, slots: str, worker: int, slot: int, storage, layout: list) -> None:
        self.slots, self.worker, self.slot, self.storage, self.layout = slots, worker, slot, storage, layout

    def pin_memory(self, device=None) -> dict[str, torch.Tensor]:
        """Called by the DataLoader's pin thread: the arrays in pinned memory."""
        return _READERS[self.slots].take(self, pin=True)

    def take(self) -> dict[str, torch.Tensor]:
        return _READERS[self.slots].take(self, pin=False)
