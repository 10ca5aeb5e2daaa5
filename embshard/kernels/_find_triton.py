"""The Triton kernel that looks raw ids up in an `IdMap`'s index (embshard/rawids/index.py), on CUDA.

One program takes BLOCK keys: it hashes each key twice (splitmix64 of `key * golden + salt`, one salt per candidate
bucket, the bits `embshard.rawids.hashing` computes), takes the shard's bucket range (first bucket, buckets) from a
small table, reads both candidate buckets of P slots (keys and rows), and writes the row of the slot holding the key
(-1: none) and the two buckets. The torch ops it replaces (IndexOps._find_torch) build `[m, 2, P]` int64 and int32
temporaries (about 3 GB read and written at 2M keys) in ~26 launches; this reads the buckets once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embshard.lookup.shards import _GOLDEN, _MIX1, _MIX2

BLOCK = 64
"""Keys per program."""


@triton.jit
def _mix(z, mix1, mix2):
    """splitmix64's output function on int64 (logical shifts: arithmetic shift, then the high bits masked off)."""
    z = z ^ ((z >> 30) & 0x3FFFFFFFF)
    z = z * mix1
    z = z ^ ((z >> 27) & 0x1FFFFFFFFF)
    z = z * mix2
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


@triton.jit
def _bucket(key, salt, first, nb, golden, mix1, mix2):
    """first + (hash mod nb), the remainder taken non-negative (torch.remainder with nb > 0)."""
    r = _mix(key * golden + salt, mix1, mix2) % nb
    return first + tl.where(r < 0, r + nb, r)


@triton.jit
def _probe(SLOT_KEY, SLOT_ROW, bucket, j, key, live, P: tl.constexpr):
    """Per key the row of the slot of `bucket` holding it, else -1."""
    slot = bucket[:, None] * P + j[None, :]
    sk = tl.load(SLOT_KEY + slot, mask=live[:, None], other=0)
    sr = tl.load(SLOT_ROW + slot, mask=live[:, None], other=-1).to(tl.int64)
    return tl.max(tl.where((sk == key[:, None]) & (sr >= 0), sr, -1), 1)


@triton.jit
def _find_kernel(
    KEYS, SHARD, BTAB, SLOT_KEY, SLOT_ROW, ROW, CAND, m, salt0, salt1, golden, mix1, mix2,
    P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    key = tl.load(KEYS + i, mask=live, other=0)
    s = tl.load(SHARD + i, mask=live, other=0)
    first = tl.load(BTAB + 2 * s, mask=live, other=0)
    nb = tl.load(BTAB + 2 * s + 1, mask=live, other=1)
    c0 = _bucket(key, salt0, first, nb, golden, mix1, mix2)
    c1 = _bucket(key, salt1, first, nb, golden, mix1, mix2)
    tl.store(CAND + 2 * i, c0, mask=live)
    tl.store(CAND + 2 * i + 1, c1, mask=live)
    j = tl.arange(0, P).to(tl.int64)
    best = tl.maximum(_probe(SLOT_KEY, SLOT_ROW, c0, j, key, live, P), _probe(SLOT_KEY, SLOT_ROW, c1, j, key, live, P))
    tl.store(ROW + i, best, mask=live)


def find_(
    keys: torch.Tensor,
    shard: torch.Tensor,
    bucket_tab: torch.Tensor,
    slot_key: torch.Tensor,
    slot_row: torch.Tensor,
    salts: tuple[int, int],
    slots_per_bucket: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of every key in the index or -1 (int64 `[m]`), its two candidate buckets (int64 `[m, 2]`)). `keys`,
    `shard` int64 `[m]`; `bucket_tab` int64 `[T, 2]` (first bucket, buckets) per shard; `slot_key` int64 and
    `slot_row` (int32 or int64) the slots (at least buckets x P); `salts` the two buckets' signed 64-bit salts."""
    m = keys.numel()
    row = torch.empty(m, dtype=torch.int64, device=keys.device)
    cand = torch.empty(m, 2, dtype=torch.int64, device=keys.device)
    if m:
        _find_kernel[(triton.cdiv(m, BLOCK),)](
            keys, shard, bucket_tab, slot_key, slot_row, row, cand, m, salts[0], salts[1], _GOLDEN, _MIX1, _MIX2,
            P=slots_per_bucket, BLOCK=BLOCK,
        )  # fmt: skip
    return row, cand
