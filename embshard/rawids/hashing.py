"""64-bit integer hashing of raw ids on torch tensors (CPU and CUDA give the same bits; no host sync).

splitmix64's output function of `id * golden + salt` (wrapping int64 arithmetic; right shifts made logical by
masking). Distinct salts give the independent hashes the map needs: the owner of an id (`route_rows`), its two
candidate buckets and the count-min sketch's two counters. `hash64_int` is the scalar twin (tests, tools).
"""

from __future__ import annotations

import torch

from embshard.lookup.shards import _GOLDEN, _MASK64, _MIX1, _MIX2, splitmix64

ROUTE_SALT = 0x2545F4914F6CDD1D
BUCKET_SALTS = (0x6A09E667F3BCC908, 0xBB67AE8584CAA73B)
SKETCH_SALTS = (0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1)


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on an int64 tensor (a new tensor)."""
    z = z.clone()
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        z ^= torch.bitwise_right_shift(z, shift) & ((1 << (64 - shift)) - 1)
        if mul is not None:
            z *= mul
    return z


def hash64(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """int64 hash of every id (a new tensor, same device)."""
    return mix64(ids.to(torch.int64) * _GOLDEN + _signed(salt))


def hash64_int(x: int, salt: int) -> int:
    """`hash64` of one Python int, as a signed int64 value."""
    return _signed(splitmix64((x * (_GOLDEN & _MASK64) + salt) & _MASK64))


def route_rows(ids: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor:
    """The virtual row of every raw id in a table of `rows` rows (an int, or a tensor broadcast with `ids`), in
    [0, rows): an id belongs to the row block holding its virtual row (package docstring)."""
    return torch.remainder(hash64(ids, ROUTE_SALT), rows)


def owner_blocks(ids: torch.Tensor, rows: int, block_size: int) -> torch.Tensor:
    """The row block (of uniform size `block_size`, the last shorter) that owns every raw id of a `rows`-row table."""
    return torch.div(route_rows(ids, rows), block_size, rounding_mode="floor")
