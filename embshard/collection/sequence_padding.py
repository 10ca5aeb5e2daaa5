"""Sequence batches padded to a capacity per feature, so that a captured CUDA graph of the sequence collection's
step (collection/sequence_graph.py) has the same sizes in every step.

A padded batch appends filler ids to each feature's last sample, up to the feature's capacity; the fillers cycle
over the first FILLER_ROWS rows of the feature's table (no row hot). The collection looks them up like any id, and
`zero_fillers` zeroes their rows: the output's values hold the capacity's rows, the fillers' last and all zero,
while the output's lengths are the batch's own, so a jagged consumer never reads them and a loss over the values gets
nothing from them. Their gradients are zeroed before the lookups' backward, so the fused update leaves their rows as
they are (sgd, adagrad and row-wise adagrad without weight decay change a row by its gradient alone).

Only a window at the end of each feature's rows can hold fillers: per feature (first row of the window, `[K, 1]`
keep mask: 1 for the batch's own rows of the window, 0 for fillers), the mask computed on the device each step from
the batch's counts (`keep_masks`), so the window's sizes stay those of the capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from embshard.collection.padding import FILLER_ROWS
from embshard.runtime.ops import join_views


def filler_ids(rows: int, n: int, device: torch.device) -> torch.Tensor:
    """`[n]` filler ids of a table of `rows` rows (int64): 0, 1, ... cycling over min(rows, FILLER_ROWS) rows."""
    return torch.arange(n, device=device, dtype=torch.int64) % min(rows, FILLER_ROWS)


def window_starts(cap_F: np.ndarray, least_F: np.ndarray) -> np.ndarray:
    """First row of each feature's filler window: room for three times the fillers of a batch of `least_F` ids
    (and 64 more), from the end of the capacity."""
    cap, least = np.asarray(cap_F, dtype=np.int64), np.asarray(least_F, dtype=np.int64)
    return np.maximum(0, cap - 3 * (cap - least) - 64)


def keep_masks(
    n_F: torch.Tensor, cap_F: Sequence[int], starts_F: Sequence[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Per feature, the `[cap_f - start_f, 1]` keep mask of its window: row r kept iff r < n_f (`n_F`: the batch's
    ids per feature, on the device)."""
    out = []
    for f, (cap, start) in enumerate(zip(cap_F, starts_F)):
        rows = torch.arange(start, cap, device=n_F.device)
        out.append((rows < n_F[f]).to(dtype).unsqueeze(1))
    return out


class _FillerSplit(torch.autograd.Function):
    """The features' rows of one contiguous `[N, D]` tensor, split per feature with their fillers zeroed (in place:
    nothing reads the lookup's rows but this); backward joins the features' gradients into one new tensor, as a
    split's backward does, and zeroes the fillers' rows of it."""

    @staticmethod
    def forward(ctx, base_ND, sizes, starts, *keeps):  # type: ignore[override]
        ctx.sizes, ctx.starts = sizes, starts
        ctx.save_for_backward(*keeps)
        at = 0
        for n, start, keep in zip(sizes, starts, keeps):
            base_ND[at + start : at + n].mul_(keep)
            at += n
        return tuple(base_ND.split(list(sizes)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        keeps = ctx.saved_tensors
        like = next(g for g in grads if g is not None)
        parts = [g if g is not None else like.new_zeros(n, like.shape[1]) for g, n in zip(grads, ctx.sizes)]
        grad_ND = torch.cat(parts)
        at = 0
        for n, start, keep in zip(ctx.sizes, ctx.starts, keeps):
            grad_ND[at + start : at + n].mul_(keep)
            at += n
        return (grad_ND, None, None, *([None] * len(keeps)))


def zero_fillers(rows: Sequence[torch.Tensor], fillers: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """Each feature's `[cap_f, D]` rows with the fillers of its window zeroed, in the output and in the gradient
    (`fillers[f]`: (first row of the window, keep mask)). Rows that are, in order, one tensor (one rank, one lookup)
    are zeroed in place and their gradients in the backward's own join; others through a copy."""
    starts = tuple(int(start) for start, _ in fillers)
    keeps = [keep for _, keep in fillers]
    base = join_views(rows) if len(rows) > 1 else None
    if base is not None:
        return list(_FillerSplit.apply(base, tuple(int(r.shape[0]) for r in rows), starts, *keeps))
    return [torch.cat([r[:start], r[start:] * keep.to(r.dtype)]) for r, start, keep in zip(rows, starts, keeps)]
