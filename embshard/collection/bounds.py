"""Ids outside their table (negative, or not below the table's row count), checked on the sending rank before
any exchange, so the error names the feature of the local batch. `LookupOptions.bounds_check` picks the answer:

- error (default): raise ValueError naming the feature, the table, the bad value and the fix;
- drop: remove the bad ids from their bags (with their per-id weights), as if the data never had them. No row is
  read or updated for them, so no weight is touched; a bag left empty pools to zeros, and a mean-pooled bag divides
  by the ids that remain. The first batch with a bad id of a feature warns (DroppedIdsWarning, with the count and
  an example); all drops are counted per feature (`ShardedEmbeddingBagCollection.dropped_ids()`).

Clamping into range was rejected: it would train the first or last row on garbage.

Raw-id tables (`TableConfig(ids="raw")`) take any int64 id: their features are never checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import numpy as np
import torch

from embshard.runtime.ops import cached_tensor, feature_of_ids
from embshard.spec.options import BoundsCheck
from embshard.spec.tables import TableConfig


class DroppedIdsWarning(RuntimeWarning):
    """Out-of-range ids were dropped from a batch (LookupOptions.bounds_check='drop')."""


def count_bad_ids(
    lengths_FB: torch.Tensor, values: torch.Tensor, keys: Sequence[str], table_of: Mapping[str, TableConfig]
) -> torch.Tensor:
    """`[1]` count of out-of-range ids in the local batch, as a device tensor (no host sync: it rides on the input
    exchange's counts). `keys[f]` is the feature of row f of `lengths_FB` `[F, B]`.

    On the device: each id's table size (its feature from the per-feature id counts, `feature_of_ids`) compared
    with the id, a handful of kernels and no copy of the batch. On the CPU (the training pipeline's host thread
    counts every batch before its copy): a min and a max per feature, a few milliseconds for millions of ids, and
    an exact count only in the features whose range leaves their table. Raw-id features are not checked."""
    raw = [table_of[k].raw_ids for k in keys]
    if values.numel() == 0 or all(raw):  # no ids to check (an empty batch or empty bags, raw ids only): no kernel
        return torch.zeros(1, dtype=torch.int64, device=values.device)
    if values.device.type == "cpu":
        return _count_bad_ids_host(lengths_FB, values, keys, table_of)
    bad, _ = _bad_ids(lengths_FB, values, keys, table_of)
    return bad.sum(dtype=torch.int64).reshape(1)


def _bad_ids(
    lengths_FB: torch.Tensor, values: torch.Tensor, keys: Sequence[str], table_of: Mapping[str, TableConfig]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bad, feature): per id, whether it is outside its feature's table (raw-id features never are), and its
    feature's row of `lengths_FB`; on the ids' device, no host sync."""
    device = values.device
    rows_F = cached_tensor([table_of[k].num_embeddings for k in keys], device)
    feature = feature_of_ids(lengths_FB.sum(1, dtype=torch.int64), values.numel())
    bad = (values < 0) | (values >= rows_F.index_select(0, feature))
    raw = [table_of[k].raw_ids for k in keys]
    if any(raw):  # raw ids are all valid
        bad &= ~cached_tensor(raw, device, torch.bool).index_select(0, feature)
    return bad, feature


def _count_bad_ids_host(
    lengths_FB: torch.Tensor, values: torch.Tensor, keys: Sequence[str], table_of: Mapping[str, TableConfig]
) -> torch.Tensor:
    """`count_bad_ids` on the CPU: each feature's min and max (numpy reduceat over the features' segments), then an
    exact count in the features whose range leaves their table."""
    ids_F = lengths_FB.sum(1, dtype=torch.int64).numpy()
    ends = np.cumsum(ids_F)
    v = values.numpy()[: int(ends[-1])]
    nonempty = np.array([f for f in np.flatnonzero(ids_F) if not table_of[keys[f]].raw_ids], dtype=np.int64)
    if nonempty.size == 0:
        return torch.zeros(1, dtype=torch.int64)
    starts = ends[nonempty] - ids_F[nonempty]  # consecutive segments: empty features in between take no ids
    rows = np.array([table_of[keys[f]].num_embeddings for f in nonempty], dtype=np.int64)
    out_of_range = (np.minimum.reduceat(v, starts) < 0) | (np.maximum.reduceat(v, starts) >= rows)
    bad = 0
    for f, r in zip(nonempty[out_of_range], rows[out_of_range]):
        seg = v[ends[f] - ids_F[f] : ends[f]]
        bad += int(np.count_nonzero((seg < 0) | (seg >= r)))
    return torch.tensor([bad], dtype=torch.int64)


def check_ids(
    lengths_FB: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    keys: Sequence[str],
    table_of: Mapping[str, TableConfig],
    mode: BoundsCheck,
    dropped: dict[str, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return (lengths_FB, values, weights) with every id a row of its feature's table, or raise (mode error).

    `keys[f]` is the feature of row f of `lengths_FB` `[F, B]`; `dropped` accumulates dropped ids per feature.
    One host sync when all ids are valid.
    """
    F, B = lengths_FB.shape
    device = values.device
    bad, feature_of = _bad_ids(lengths_FB, values, keys, table_of)
    if not bool(bad.any()):
        return lengths_FB, values, weights
    if mode is BoundsCheck.ERROR:
        pos = int(bad.nonzero()[0])
        key = keys[int(feature_of[pos])]
        t = table_of[key]
        raise ValueError(
            f"feature {key!r}: id {int(values[pos])} is outside table {t.name!r} (rows 0..{t.num_embeddings - 1}); "
            "map ids into range (e.g. hash modulo num_embeddings) or enlarge the table, or drop such ids with a "
            "warning: LookupOptions(bounds_check='drop')"
        )
    bag = torch.repeat_interleave(torch.arange(F * B, device=device), lengths_FB.flatten(), output_size=values.numel())
    removed_FB = torch.bincount(bag[bad], minlength=F * B).view(F, B)
    bad_pos = bad.nonzero().flatten()
    counts = torch.bincount(feature_of[bad_pos], minlength=F).tolist()
    first_bad = torch.full((F,), values.numel(), device=device, dtype=torch.int64)
    first_bad = first_bad.scatter_reduce(0, feature_of[bad_pos], bad_pos, reduce="amin").tolist()
    for f, n in enumerate(counts):
        if not n:
            continue
        key = keys[f]
        if key not in dropped:
            t = table_of[key]
            warnings.warn(
                f"feature {key!r}: dropped {n} id(s) outside table {t.name!r} (rows 0..{t.num_embeddings - 1}) from "
                f"this batch, e.g. {int(values[first_bad[f]])}; they are removed from their bags and train nothing. "
                "Later drops of this feature are counted without a warning: see dropped_ids()",
                DroppedIdsWarning,
                stacklevel=3,
            )
        dropped[key] = dropped.get(key, 0) + n
    keep = ~bad
    new_lengths = (lengths_FB - removed_FB.to(lengths_FB.dtype)).contiguous()
    return new_lengths, values[keep], weights[keep] if weights is not None else None
