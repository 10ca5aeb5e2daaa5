"""A piece: a block of a logical tensor of a checkpoint, the unit that is written, read and checked
(`layout.py` says which pieces a rank writes and reads)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Piece:
    """A block of a logical tensor: `tensor` (contiguous, shape = its extent) at `offsets` in a tensor of `size`."""

    key: str
    """Name of the logical tensor, e.g. 'ebc/t_C1/weight'."""
    size: tuple[int, ...]
    """Shape of the whole logical tensor."""
    offsets: tuple[int, ...]
    """Where the block starts in it."""
    tensor: torch.Tensor
    """The block's values (a view of a live tensor, or a host copy)."""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def split_rows(piece: Piece, chunk_bytes: int) -> list[Piece]:
    """`piece` cut along its first dimension into chunks of at most `chunk_bytes` (at least one row each)."""
    t = piece.tensor
    if t.dim() == 0 or piece.nbytes <= chunk_bytes:
        return [piece]
    row_bytes = max(1, piece.nbytes // t.shape[0])
    rows = max(1, chunk_bytes // row_bytes)
    out = []
    for r0 in range(0, t.shape[0], rows):
        offsets = (piece.offsets[0] + r0, *piece.offsets[1:])
        out.append(replace(piece, offsets=offsets, tensor=t[r0 : r0 + rows]))
    return out
