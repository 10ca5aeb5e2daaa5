"""Numeric guard: stop a training step before its update when the loss or a pooled embedding is NaN or Inf.

The sparse optimizer runs inside the backward, so the check must come after the forward and before
`loss.backward()`. One flag per rank (non-finite anywhere in the loss or the pooled embeddings), summed over the
ranks in one small all-reduce and read with one host sync, so every rank stops at the same step; then each rank
names what it found (the step, the feature, its table, how many samples). Off by default (`runtime.nan_check`):
the host sync costs the pipeline its overlap.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from embshard.runtime.comm import start_all_reduce


class NonFiniteError(FloatingPointError):
    """The loss or a pooled embedding is NaN or Inf; raised on every rank before the update."""


def _columns(ebc, out) -> list[tuple[str, torch.Tensor]]:
    """(feature, its pooled `[B, D]` columns) for every feature in the collection's output."""
    if hasattr(out, "to_dict"):  # a KeyedTensor of every feature
        return list(out.to_dict().items())
    width = {f: t.embedding_dim for t in ebc.tables for f in t.feature_names}
    cols = []
    for group, members in (ebc.groups or {}).items():
        start = 0
        for f in members:
            cols.append((f, out[group][:, start : start + width[f]]))
            start += width[f]
    return cols


def check_finite(step: int, loss: torch.Tensor, ebc, pooled: Mapping | object) -> None:
    """Raise NonFiniteError on every rank if any rank's loss or pooled embeddings hold NaN or Inf (collective)."""
    values = list(pooled.values()) if isinstance(pooled, Mapping) else [pooled.values()]
    bad = (~torch.isfinite(loss.detach())).any().float().reshape(1)
    for v in values:
        bad = bad + (~torch.isfinite(v.detach())).any().float()
    if dist.is_initialized():
        bad = start_all_reduce(bad, ebc.group, "nan check all-reduce").wait(host=True)
    if not bool(bad.item()):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    table_of = {f: t.name for t in ebc.tables for f in t.feature_names}
    found = []
    if not bool(torch.isfinite(loss.detach()).all()):
        found.append(f"the loss is {loss.detach().float().flatten()[:4].tolist()}")
    for feature, cols in _columns(ebc, pooled):
        rows = (~torch.isfinite(cols.detach())).any(dim=1)
        if bool(rows.any()):
            found.append(
                f"feature {feature!r} (table {table_of[feature]!r}): NaN/Inf in {int(rows.sum())} of {len(rows)} samples"
            )
    here = "; ".join(found) if found else "nothing here (another rank found them)"
    raise NonFiniteError(
        f"step {step}: non-finite values; rank {rank}: {here}. The update was not applied. Lower the learning rate, "
        "check the input features (dense values, per-id weights) and the tables named, or resume from a checkpoint"
    )
