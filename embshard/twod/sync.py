"""Periodic 2D sharding: the replicas (one per sharding group) train on their own groups' batches and drift apart;
every `replica_sync_every` steps their weights and optimizer state are replaced by the mean over the replicas
(TorchRec's `DMPCollection` way)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from embshard.runtime.comm import start_all_reduce, world_and_rank

CHUNK = 1 << 24  # elements averaged per all-reduce: a buffer of 64 MiB in fp32 at most


def average_replicas(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace every tensor, in place, by its mean over the ranks of `group` (collective: every rank gives the same
    tensors' shapes in the same order). Summed in fp32 (fp64 tensors in fp64), in chunks of at most `CHUNK`
    elements, written back in the tensor's dtype."""
    R, _ = world_and_rank(group)
    if R == 1:
        return
    for t in tensors:
        work = torch.float64 if t.dtype == torch.float64 else torch.float32
        flat = t.view(-1) if t.is_contiguous() else None
        if flat is None:  # a strided view: the whole tensor at once
            buf = t.to(work).contiguous()
            start_all_reduce(buf, group, "2D replica average", scoped=False).wait()
            t.copy_(buf.div_(R))
            continue
        for a in range(0, flat.numel(), CHUNK):
            part = flat[a : a + CHUNK]
            buf = part.to(work, copy=True)
            start_all_reduce(buf, group, "2D replica average", scoped=False).wait()
            part.copy_(buf.div_(R))
