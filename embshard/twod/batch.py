"""Exact 2D sharding: every sharding group trains on the whole world's batch.

Method. Before the input exchange, the ranks of each replica set (rank i of every group) all-gather their local
batches (`gather_replica_batch`: bag lengths, ids, per-id weights), so rank i of every group holds the same
concatenation of the replica set's batches, in group order. Each group then runs the usual step on it: its id
exchange, lookups and pooled exchange see the global batch of the whole world, split over the group's G ranks
instead of the world's W. Each rank keeps the output rows of its own samples (`own_rows`); in backward, the
replica set all-gathers the output gradients of its ranks, so every group's backward, and so every group's fused
update, receives the gradient of every sample of the world: the update the non-2D run makes on the same global
batch, for every optimizer (the sum over samples is formed inside each group's lookup, as without 2D). Data-parallel
tables then sum their gradients within the group, which already covers every sample.

Cost: the model-parallel lookups of each group run on the world's batch; what crosses groups is the ids once in
forward and the `[B, D]` output gradients once in backward; the exchanges stay within the group.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from embshard.runtime.comm import start_all_gather, world_and_rank
from embshard.runtime.ops import permute_1d
from embshard.spec.tables import ConfigError


@dataclass(frozen=True)
class ReplicaRows:
    """Where this rank's samples sit in its replica set's gathered batch."""

    batch_sizes: tuple[int, ...]
    """Every replica's local batch size, in group order."""
    index: int
    """This rank's position in the replica set (its group)."""
    group: dist.ProcessGroup
    """The replica set."""

    @property
    def start(self) -> int:
        """First row of this rank's samples."""
        return sum(self.batch_sizes[: self.index])

    @property
    def stop(self) -> int:
        """One past the last row of this rank's samples."""
        return self.start + self.batch_sizes[self.index]


def _padded(t: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """`t` grown to `n` along `dim` with zeros."""
    if t.shape[dim] == n:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def gather_replica_batch(
    lengths_FB: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    keys: Sequence[str],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ReplicaRows]:
    """The replica set's batches side by side: `[F, sum B]` lengths (every feature's bags of replica 0, then 1,
    ...), ids and weights feature-major, and where this rank's rows are. Collective over `group`. Every rank must
    give the same features in the same order (`keys`) and weights or not alike (ConfigError otherwise)."""
    R, me = world_and_rank(group)
    F, B = lengths_FB.shape
    sig = zlib.crc32("\0".join(keys).encode()) & 0x7FFFFFFF
    mine = torch.tensor([B, values.numel(), int(weights is not None), sig], dtype=torch.int64)
    sizes = start_all_gather(mine.to(values.device), group, "2D batch sizes").wait().cpu().tolist()
    if len({tuple(s[2:]) for s in sizes}) > 1:
        raise ConfigError(
            f"2D sharding: the ranks of a replica set give batches of different features or weightedness "
            f"(features {list(keys)}, weights {weights is not None} here): every rank must give the same features "
            "in the same order, all with per-id weights or none"
        )
    Bs = [s[0] for s in sizes]
    ns = [s[1] for s in sizes]
    B_max, n_max = max(Bs), max(ns)
    lengths_RFB = start_all_gather(_padded(lengths_FB, B_max, 1), group, "2D batch lengths").wait()
    values_R = start_all_gather(_padded(values, n_max), group, "2D batch ids").wait()
    weights_R = (
        start_all_gather(_padded(weights, n_max), group, "2D batch weights").wait() if weights is not None else None
    )
    lengths_all = torch.cat([lengths_RFB[r, :, : Bs[r]] for r in range(R)], dim=1)
    values_cat = torch.cat([values_R[r, : ns[r]] for r in range(R)])
    weights_cat = torch.cat([weights_R[r, : ns[r]] for r in range(R)]) if weights_R is not None else None
    ids_RF = lengths_RFB.sum(2).reshape(-1)  # ids per (replica, feature) segment; padding adds none
    perm = torch.arange(R * F, device=values.device).view(R, F).t().reshape(-1).to(torch.int32)
    values_all, weights_all = permute_1d(perm, ids_RF.to(torch.int32), values_cat, weights_cat)
    return lengths_all, values_all, weights_all, ReplicaRows(tuple(Bs), me, group)


class _OwnRows(torch.autograd.Function):
    """Forward: this rank's rows of each output. Backward: the replica set's gradients of their rows, gathered into
    the gradient of the whole gathered batch (one all-gather for every output together)."""

    @staticmethod
    def forward(ctx, rows: ReplicaRows, *outputs: torch.Tensor):  # type: ignore[override]
        ctx.rows = rows
        ctx.widths = [t.shape[1] for t in outputs]
        ctx.meta = [(t.dtype, t.device) for t in outputs]
        return tuple(t[rows.start : rows.stop].clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        rows: ReplicaRows = ctx.rows
        B = rows.batch_sizes[rows.index]
        dtype, device = ctx.meta[0]
        mine = torch.cat(
            [
                (g if g is not None else torch.zeros(B, w, dtype=dtype, device=device)).to(dtype)
                for g, w in zip(grads, ctx.widths)
            ],
            dim=1,
        )
        gathered = start_all_gather(_padded(mine, max(rows.batch_sizes)), rows.group, "2D output gradients").wait()
        full = torch.cat([gathered[r, :b] for r, b in enumerate(rows.batch_sizes)])
        parts = torch.split(full, ctx.widths, dim=1)
        return (None, *(p.to(m[0]).contiguous() for p, m in zip(parts, ctx.meta)))


def own_rows(outputs: Mapping[str, torch.Tensor], rows: ReplicaRows) -> dict[str, torch.Tensor]:
    """This rank's rows of each `[sum B, D]` output of the gathered batch (differentiable: the backward gathers the
    replica set's gradients, see the module docstring)."""
    names = list(outputs)
    return dict(zip(names, _OwnRows.apply(rows, *(outputs[n] for n in names))))
