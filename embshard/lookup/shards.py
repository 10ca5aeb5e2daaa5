"""The shards a rank holds (`LocalShard`), how they are grouped into kernels, and their deterministic initial rows.

A `LocalShard` is one block of a table (embshard.spec.plan.Shard) on this rank plus the lookup keys that read it. Shards
with equal `group_key` share one kernel (one FBGEMM TBE: one tier, weight type, weighted-ness and cache policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embshard.spec.plan import CacheAlgorithm, LookupKernel, MemoryTier, Shard, TablePlan
from embshard.spec.tables import TableConfig

INIT_BLOCK_ELEMENTS = 1 << 22  # elements hashed per pass (temporary int64 buffers of 32 MiB)

# splitmix64 (Steele, Lea, Flood 2014) constants as signed int64: torch's int64 arithmetic wraps modulo 2^64.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's output function on a Python int (mod 2^64): the scalar twin of the tensor code below."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def table_key(seed: int, table_index: int) -> int:
    """The 64-bit stream key of one table: splitmix64 of (seed, table index)."""
    return splitmix64(splitmix64(seed) + 0x9E3779B97F4A7C15 * (table_index + 1))


def _signed(x: int) -> int:
    """A 64-bit value as torch's int64 holds it (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """splitmix64's output function, in place on an int64 tensor (`tmp`: a buffer of its shape; right shifts made
    logical by masking)."""
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)


def init_rows(
    cfg: TableConfig,
    table_index: int,
    row_offset: int,
    num_rows: int,
    col_offset: int,
    num_cols: int,
    seed: int | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Deterministic initial weights of rows [row_offset, +num_rows) x columns [col_offset, +num_cols), fp32 on
    `device`.

    Element (r, c) of table `table_index` is a pure function of (seed, table index, r * embedding_dim + c): a
    counter-based hash (splitmix64 of the element's index, keyed by `table_key`), whose top 24 bits give u in
    [0, 1) and the value (2u - 1) x cfg.init_bound, computed with integer and single float operations that give the
    same bits on the CPU and on CUDA. So any block of a table, in any sharding, on any device, starts identical to
    the unsharded table, and the draw runs where the weights live (no host round trip: a 40M-row table takes well
    under a second on a GPU). Drawn in passes of INIT_BLOCK_ELEMENTS elements. `seed=None` draws with the device's
    generator instead (not reproducible).
    """
    device = torch.device(device)
    if seed is None:
        return torch.empty(num_rows, num_cols, device=device).uniform_(-cfg.init_bound, cfg.init_bound)
    out = torch.empty(num_rows, num_cols, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    key = _signed(table_key(seed, table_index))
    D = cfg.embedding_dim
    cols = torch.arange(col_offset, col_offset + num_cols, dtype=torch.int64, device=device)
    step = max(1, INIT_BLOCK_ELEMENTS // num_cols)
    bound = float(cfg.init_bound)
    z_buf = torch.empty(min(step, num_rows) * num_cols, dtype=torch.int64, device=device)
    tmp_buf = torch.empty_like(z_buf)
    for r0 in range(0, num_rows, step):
        n = min(step, num_rows - r0)
        z, tmp = z_buf[: n * num_cols].view(n, num_cols), tmp_buf[: n * num_cols].view(n, num_cols)
        rows = torch.arange(row_offset + r0, row_offset + r0 + n, dtype=torch.int64, device=device)
        torch.add((rows * D).unsqueeze(1), cols, out=z)  # the element's index in the table
        out[r0 : r0 + n] = _uniform_of_index_(z, tmp, key, bound)
    return out


def fp32(x: float) -> float:
    """`x` rounded to fp32 (the factor and offset the initial values apply in fp32)."""
    return torch.tensor(x, dtype=torch.float32).item()


def _uniform_of_index_(
    z: torch.Tensor,
    tmp: torch.Tensor,
    key: int | torch.Tensor,
    bound: float | torch.Tensor,
    scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The initial values of the elements whose table indices are `z` (int64, overwritten; `tmp` a scratch of its
    shape): splitmix64 of the index keyed by `key`, its top 24 bits as u in [0, 1), then u x scale - bound in fp32,
    scale = 2 x bound / 2^24 (derived from a number `bound`; with per-row tensors `key`, `bound` and `scale`
    broadcast against `z`)."""
    z.mul_(_GOLDEN).add_(key)
    _mix_(z, tmp)
    torch.bitwise_right_shift(z, 40, out=tmp)
    u = tmp.bitwise_and_(0xFFFFFF).to(torch.float32)  # the top 24 bits: exact in fp32
    u.mul_(2.0 * bound / (1 << 24) if scale is None else scale)
    return u.sub_(bound)


def init_rows_at(
    cfg: TableConfig,
    table_index: int,
    rows: torch.Tensor,
    col_offset: int,
    num_cols: int,
    seed: int | None,
) -> torch.Tensor:
    """`init_rows` for any rows of the table: the initial weights `[len(rows), num_cols]` (fp32, on `rows`' device)
    of the rows `rows` (int64 table rows, in any order, repeats allowed), bit for bit what `init_rows` draws for
    them. Device ops only (no host sync): raw-id tables re-initialise the rows they give to new ids with it."""
    device = rows.device
    if seed is None:
        return torch.empty(rows.numel(), num_cols, device=device).uniform_(-cfg.init_bound, cfg.init_bound)
    key = _signed(table_key(seed, table_index))
    cols = torch.arange(col_offset, col_offset + num_cols, dtype=torch.int64, device=device)
    z = (rows.to(torch.int64) * cfg.embedding_dim).unsqueeze(1) + cols  # the element's index in the table
    return _uniform_of_index_(z, torch.empty_like(z), key, float(cfg.init_bound))


@dataclass(frozen=True)
class LocalShard:
    """A shard this rank holds, and the lookup features (in order) that read it."""

    table: TableConfig
    """The table the shard belongs to."""
    table_index: int
    """Index of the table in the collection (for deterministic initialisation)."""
    shard: Shard
    """The block of the table."""
    features: tuple[str, ...]
    """Lookup keys that read this shard, in lookup order."""
    tier: MemoryTier
    """Memory tier."""
    cache_load_factor: float = 0.2
    """UVM-caching cache size as a fraction of the shard's rows."""
    cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU
    """UVM-caching replacement policy."""
    kernel: LookupKernel = LookupKernel.FBGEMM
    """Lookup kernel: FBGEMM's TBE or embshard's small-table kernel."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", MemoryTier(self.tier))
        object.__setattr__(self, "cache_algorithm", CacheAlgorithm(self.cache_algorithm))
        object.__setattr__(self, "kernel", LookupKernel(self.kernel))

    @classmethod
    def planned(
        cls, table: TableConfig, index: int, shard: Shard, features: Sequence[str], tp: TablePlan
    ) -> LocalShard:
        """The shard `shard` of `table` (collection index `index`), read by `features`, with its table plan's
        tier, cache settings and kernel."""
        return cls(table, index, shard, tuple(features), tp.tier, tp.cache_load_factor, tp.cache_algorithm, tp.kernel)

    @property
    def group_key(self) -> tuple:
        """Shards with equal keys share one kernel: one TBE has one tier, weight type, weighted-ness and
        (UVM-caching) one cache policy; cache sizes may differ (lookup/settings.py: the group's cache holds the sum).
        Raw-id tables are grouped apart (their lookup's ids go through their id -> row maps first)."""
        policy = self.cache_algorithm if self.tier is MemoryTier.UVM_CACHING else None
        return (self.tier, self.table.data_type, self.table.weighted, policy, self.kernel, self.table.raw_ids)


def group_shards(shards: Sequence[LocalShard]) -> list[list[LocalShard]]:
    """Shards grouped into TBEs by `group_key`: groups in first-seen order, shards in their order within."""
    groups: dict[tuple, list[LocalShard]] = {}
    for s in shards:
        groups.setdefault(s.group_key, []).append(s)
    return list(groups.values())
