"""Shard geometry: how a table's rows or columns are cut into blocks. One rule for the plan's checks
(embshard.spec.plan), every placement (embshard.planner) and the runtime, which routes an id to row block id // bs.

- Row blocks (row-wise, table-row-wise): every block but the last has one size bs, the last at most bs.
  `row_blocks(rows, n)` is the canonical split over n ranks: bs = ceil(rows / n), so ceil(rows / bs) blocks,
  which can be fewer than n (rows=9, n=4: 3, 3, 3).
- Column blocks (column-wise): FBGEMM's TBE needs every block a multiple of 4 columns wide; `column_blocks(dim, n)`
  cuts the width into up to n blocks of whole units of 4, as even as possible (dim=24, n=4: 8, 8, 4, 4; dim=8,
  n=3: 4, 4).
- Capacities: `capacity(ids)` is the padded batches' size for a run of ragged batches (10% above by default, a multiple of
  64 ids): what a captured CUDA graph is sized for (embshard/collection/padding.py, embshard/rawids/graph.py).

Sizes are plain integers here; embshard.spec.plan turns them into Shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embshard.spec.tables import ConfigError


def even_splits(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` contiguous sizes differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def row_blocks(rows: int, parts: int) -> list[int]:
    """Row-block sizes for row-wise sharding over `parts` ranks: block size ceil(rows / parts), the last block
    shorter; there may be fewer than `parts` blocks (rows=10, parts=4: [3, 3, 3, 1]; rows=9, parts=4: [3, 3, 3])."""
    bs = -(-rows // parts)
    n = -(-rows // bs)
    return [bs] * (n - 1) + [rows - bs * (n - 1)]


def row_runs(rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    """`runs(row_blocks(rows, parts))` without listing the blocks: (block size, count) of the full blocks, then
    the shorter last block if there is one (rows=10, parts=4: ((3, 3), (1, 1)))."""
    bs = -(-rows // parts)
    n = -(-rows // bs)
    last = rows - bs * (n - 1)
    if last == bs:
        return ((bs, n),)
    return ((bs, n - 1), (last, 1)) if n > 1 else ((last, 1),)


def is_row_split(sizes: Sequence[int]) -> bool:
    """Whether row-block sizes (in row order) can be routed by id // block size: all but the last equal to the
    first, the last at most that."""
    return all(n == sizes[0] for n in sizes[:-1]) and sizes[-1] <= sizes[0]


def column_blocks(dim: int, parts: int, table: str = "?") -> list[int]:
    """Column-block widths for column-wise sharding: up to `parts` blocks, each a multiple of 4 wide (FBGEMM's
    TBE needs that), as even as possible (dim=24, parts=4: [8, 8, 4, 4]; dim=8, parts=3: [4, 4])."""
    if dim % 4:
        raise ConfigError(
            f"table {table!r}: embedding_dim={dim} cannot be cut into column blocks that are multiples of 4 wide "
            "(FBGEMM's TBE requires it): make embedding_dim a multiple of 4"
        )
    return [4 * n for n in even_splits(dim // 4, max(1, min(parts, dim // 4)))]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of these sizes starts."""
    out, pos = [], 0
    for n in sizes:
        out.append(pos)
        pos += n
    return out


def runs(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Consecutive equal sizes as (size, count) runs: [3, 3, 3, 1] -> ((3, 3), (1, 1))."""
    out: list[tuple[int, int]] = []
    for x in sizes:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return tuple(out)


def capacity(ids_F: np.ndarray | int, headroom: float = 0.1) -> np.ndarray:
    """Padded ids per feature for a run of ragged batches whose largest counts are `ids_F`: `headroom` above (in
    whole thousandths), rounded up to a multiple of 64 ids, in integers (3,200 ids give 3,520 at 10%: through
    floats, 3,200 x 1.1 rounds above 3,520)."""
    per_mille = 1000 + round(headroom * 1000)
    return (np.asarray(ids_F, dtype=np.int64) * per_mille + 63_999) // 64_000 * 64
