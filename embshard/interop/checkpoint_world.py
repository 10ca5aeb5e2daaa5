"""The world size of the TorchRec job that saved a DCP checkpoint, read from the checkpoint's index.

TorchRec's optimizer state depends on it (embshard.interop.common.GRADIENT_DIVISION), and DCP records it nowhere as
such. What the index does show: the chunks of every sharded tensor, in rank order, and (DCP's file writer) which
rank wrote each chunk, in the file names `__{rank}_{n}.distcp`. A table TorchRec shards row-wise has one row block on
every rank, in rank order, of ceil(rows / W) rows (empty blocks included, on the last ranks): its W chunks, written
by ranks 0..W-1, give W. A table-row-wise table has the same form over the ranks of one host; it is told apart
by the ranks that wrote other chunks (a rank past its blocks wrote to the checkpoint: the job had more ranks).
Without such a table (every table table-wise, column-wise or data-parallel, or a one-rank job) the checkpoint
does not say W: the caller must.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

_WRITER = re.compile(r"__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class WorldEvidence:
    """What a checkpoint's index says of the saving job's world size."""

    exact: int | None
    """The world size, where a row-wise table spans every rank; else None."""
    lower: int
    """At least this many ranks wrote to the checkpoint (0: the writers are not recorded)."""
    spanning: str | None
    """The tensor whose row blocks give `exact`."""


def world_evidence(metadata: Any) -> WorldEvidence:
    """WorldEvidence of a DCP checkpoint's `Metadata` (module docstring)."""
    writers: dict[tuple[str, tuple[int, ...]], int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        m = _WRITER.search(os.path.basename(str(getattr(info, "relative_path", ""))))
        if m is not None and getattr(index, "offset", None) is not None:
            writers[(index.fqn, tuple(index.offset))] = int(m.group(1))
    lower = max(writers.values(), default=-1) + 1
    best, spanning = 0, None
    for key, md in metadata.state_dict_metadata.items():
        n = _row_blocks_in_rank_order(key, md, writers)
        if n > best:
            best, spanning = n, key
    exact = best if best >= 2 and best >= lower else None
    return WorldEvidence(exact, lower, spanning if exact else None)


def _row_blocks_in_rank_order(key: str, md: Any, writers: dict[tuple[str, tuple[int, ...]], int]) -> int:
    """n if the tensor's chunks are TorchRec's row-wise blocks over n >= 2 ranks, block i written by rank i; else 0."""
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", None) or []]
    size = tuple(getattr(md, "size", ()))
    n = len(chunks)
    if n < 2 or not size:
        return 0
    rows, rest = size[0], size[1:]
    block = math.ceil(rows / n)
    for i, (offsets, sizes) in enumerate(chunks):
        start = min(i * block, rows)
        if offsets != (start, *(0,) * len(rest)) or sizes != (min(block, rows - start), *rest):
            return 0
        rank = writers.get((key, offsets))
        if sizes[0] > 0 and rank is not None and rank != i:
            return 0
    return n
