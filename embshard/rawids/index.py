"""The id -> row index of an `IdMap` (idmap.py): an open-addressing hash table of buckets of P slots, two candidate
buckets per key (the design: embshard/rawids/__init__.py).

Lookups run as one Triton launch on CUDA (embshard/kernels/_idmap_triton.py: both buckets read once per key) and
as torch ops elsewhere (`_find_torch`, the same results).

Storage (buffers of the IdMap): `slot_key` `[S + 1]` int64 and `slot_row` `[S + 1]` (int32 while the group's rows
and slots fit, else int64; -1: empty), the last element of each a trash slot that masked-off writes go to;
`bucket_tab` `[T, 2]` (first bucket, buckets) per shard. A bucket is read as one row of the `[NB, P]` view of the
slots (`index_select`: no `[m, P]` index tensor), both candidate buckets at once.
"""

from __future__ import annotations

import torch

from embshard.lookup.shards import _GOLDEN, _mix_, _signed
from embshard.rawids.hashing import BUCKET_SALTS
from embshard.spec.id_map import P

_SALTS = (_signed(BUCKET_SALTS[0]), _signed(BUCKET_SALTS[1]))
"""The two candidate buckets' salts as signed 64-bit ints (the Triton lookup's arguments)."""


def triton_for(choice: str, device: torch.device) -> bool:
    """Whether a map step runs on its Triton kernels: `choice` 'triton', or 'auto' on CUDA ('torch': never)."""
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


class IndexOps:
    """The index's lookups and inserts, mixed into `IdMap` (which holds the buffers)."""

    slot_key: torch.Tensor
    slot_row: torch.Tensor
    bucket_tab: torch.Tensor
    bucket_salts: torch.Tensor
    NB: int
    S: int
    map_kernel: str = "auto"
    """'auto': the Triton lookup on CUDA, torch ops elsewhere; 'triton' or 'torch' (tests)."""

    def _kernels(self, t: torch.Tensor) -> bool:
        """Whether the index runs on its Triton kernels (`map_kernel`) for tensors like `t`."""
        return triton_for(self.map_kernel, t.device)

    def _candidates(self, keys: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """`[m, 2]` the two candidate buckets of every (shard, key): bucket base + hash mod buckets, one hash per salt
        (`hashing.hash64`, both salts in one pass)."""
        z = keys.unsqueeze(1) * _GOLDEN + self.bucket_salts  # [m, 2]
        _mix_(z, torch.empty_like(z))
        tab = self.bucket_tab[shard]  # [m, 2]: first bucket, buckets
        return tab[:, :1] + torch.remainder(z, tab[:, 1:])

    def _bucket_rows(self, cand: torch.Tensor) -> torch.Tensor:
        """`[m, 2, P]` the slots' rows of both candidate buckets (-1: empty)."""
        return self.slot_row[: self.S].view(self.NB, P).index_select(0, cand.reshape(-1)).view(-1, 2, P)

    def _find(self, keys: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(group row of every (shard, key) or -1 (int64), its two candidate buckets `[m, 2]` (int64)). A key is in
        the index at most once, so the row is the one matching slot's."""
        if self._kernels(keys):
            from embshard.kernels._idmap_triton import find_

            return find_(
                keys.contiguous(), shard.contiguous(), self.bucket_tab, self.slot_key, self.slot_row, _SALTS, P
            )
        return self._find_torch(keys, shard)

    def _find_torch(self, keys: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_find` in torch ops: both candidate buckets `[m, 2, P]` gathered, then matched."""
        m = keys.numel()
        cand = self._candidates(keys, shard)
        rows = self._bucket_rows(cand)
        skeys = self.slot_key[: self.S].view(self.NB, P).index_select(0, cand.reshape(-1)).view(m, 2, P)
        match = (skeys == keys.view(m, 1, 1)) & (rows >= 0)
        row = torch.where(match, rows, -1).view(m, 2 * P).amax(1)
        return row.to(torch.int64), cand

    def _insert(self, keys: torch.Tensor, cand: torch.Tensor, active: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Insert the active keys (rows `rows`): into the emptier candidate bucket (the first on ties), then, where
        that was full, the other; the slot (int64), or -1 where both were full."""
        m = keys.numel()
        if self._kernels(keys):
            from embshard.kernels._idmap_triton import free_counts_

            free, n_free = None, free_counts_(self.slot_row, cand.contiguous(), P)
        else:
            free = self._bucket_rows(cand) < 0  # [m, 2, P]
            n_free = torch.count_nonzero(free, 2)
        swap = n_free[:, 1] > n_free[:, 0]
        first = torch.where(swap, cand[:, 1], cand[:, 0])
        second = torch.where(swap, cand[:, 0], cand[:, 1])
        if free is not None:
            free = torch.where(swap.view(m, 1), free[:, 1], free[:, 0])
        slot = self._place(keys, first, active, rows, free)
        retry = active & (slot < 0)
        slot2 = self._place(keys, second, retry, rows, None)
        return torch.where(slot >= 0, slot, slot2)

    def _place(
        self,
        keys: torch.Tensor,
        bucket: torch.Tensor,
        active: torch.Tensor,
        rows: torch.Tensor,
        free: torch.Tensor | None,
    ) -> torch.Tensor:
        """The active keys that share a bucket take its free slots in order (the q-th key of a bucket, in key
        order, its q-th free slot); returns the slot (int64) or -1 (bucket full), and writes the placed keys.
        `free`: the bucket's free slots `[m, P]` if already read. The rank q comes from a stable sort of the
        buckets: q = position - start of the position's run (the run start by a scatter at the run's first
        position, then a gather; no cummax, whose CUDA kernel scans a 1-d tensor in a single thread block)."""
        m = keys.numel()
        dev = keys.device
        ar = torch.arange(m, device=dev)
        key = torch.where(active, bucket, self.NB)
        sb, order = torch.sort(key.to(torch.int32) if self.NB < 2**31 - 1 else key, stable=True)
        starts = torch.ones(m, dtype=torch.bool, device=dev)
        torch.ne(sb[1:], sb[:-1], out=starts[1:])
        run = torch.cumsum(starts, 0) - 1
        run_start = torch.empty(m + 1, dtype=torch.int64, device=dev).scatter_(0, torch.where(starts, run, m), ar)
        q = torch.empty_like(ar).scatter_(0, order, ar - run_start[run])
        if self._kernels(keys):
            from embshard.kernels._idmap_triton import pick_free_

            slot = pick_free_(self.slot_row, bucket.contiguous(), q, active.contiguous(), P)
            found = slot >= 0
        else:
            if free is None:
                free = self.slot_row[: self.S].view(self.NB, P).index_select(0, bucket) < 0  # [m, P]
            pick = free & (torch.cumsum(free, 1, dtype=torch.int32) == (q + 1).clamp_(max=P + 1).view(m, 1))
            found = active & pick.any(1)
            slot = torch.where(found, bucket * P + pick.to(torch.int8).argmax(1), -1)
        target = torch.where(found, slot, self.S)
        self.slot_key.scatter_(0, target, keys)
        self.slot_row.scatter_(0, target, torch.where(found, rows, -1).to(self.slot_row.dtype))
        return slot
