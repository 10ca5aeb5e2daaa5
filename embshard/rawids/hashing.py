"""64-bit integer hashing of raw ids on torch tensors (CPU and CUDA give the same bits; no host sync).

splitmix64's output function of `id * golden + salt` (wrapping int64 arithmetic; right shifts made logical by
masking). Distinct salts give the independent hashes the map needs: the owner of an id (`route_rows`), its two
candidate buckets and the count-min sketch's two counters.
"""

from __future__ import annotations

import torch

from embshard.lookup.shards import _GOLDEN, _mix_, _signed

ROUTE_SALT = 0x2545F4914F6CDD1D
BUCKET_SALTS = (0x6A09E667F3BCC908, 0xBB67AE8584CAA73B)
SKETCH_SALTS = (0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1)


def hash64(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """int64 hash of every id (a new tensor, same device)."""
    z = ids.to(torch.int64) * _GOLDEN + _signed(salt)
    _mix_(z, torch.empty_like(z))
    return z


def route_rows(ids: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor:
    """The virtual row of every raw id in a table of `rows` rows (an int, or a tensor broadcast with `ids`), in
    [0, rows): an id belongs to the row block holding its virtual row (package docstring)."""
    return torch.remainder(hash64(ids, ROUTE_SALT), rows)


def owner_blocks(ids: torch.Tensor, rows: int, block_size: int) -> torch.Tensor:
    """The row block (of uniform size `block_size`, the last shorter) that owns every raw id of a `rows`-row table."""
    return torch.div(route_rows(ids, rows), block_size, rounding_mode="floor")
