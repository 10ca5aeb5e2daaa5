"""Regroup pooled embeddings into the model's feature groups with FBGEMM's `permute_multi_embedding`.

The inputs are KeyedTensor-like blocks (`[B, sum of key widths]` with their keys); each output group is one dense
`[B, sum of its keys' widths]` tensor, in the group's key order. Keys may appear in several groups. The permute
metadata is built once (FBGEMM's `kt_regroup_arguments`) and kept on the device.

The kernel copies one (key, sample) segment at a time, so many narrow keys (100 tables 16 wide) make it slow.
Keys that sit side by side in their input block and stay side by side in every group that uses them are handed to
FBGEMM as one wider key (`coalesce`): same result, a few wide segments instead of many narrow ones.

FBGEMM leaves the gradient of keys that appear in no group unwritten (uninitialised memory); a thin autograd
wrapper zeroes those columns, so an unused feature gets an exactly-zero gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from torch import nn


class _ZeroUnusedColumnsGrad(torch.autograd.Function):
    """Identity forward; backward zeroes the given columns of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, unused_cols: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(unused_cols)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (unused_cols,) = ctx.saved_tensors
        return grad.index_fill(1, unused_cols, 0.0), None


def coalesce(
    keys: Sequence[Sequence[str]], dims: Sequence[Sequence[int]], groups: Sequence[Sequence[str]]
) -> tuple[list[list[str]], list[list[int]], list[list[str]]]:
    """(keys, dims, groups) with runs of keys merged into one key (named by joining them with "+"): neighbours a, b
    of one block join when every group that uses a has b right after it and every group that uses b has a right
    before it, so every group holds each run whole and in order."""
    after = {k_list[i]: k_list[i + 1] for k_list in keys for i in range(len(k_list) - 1)}
    before = {b: a for a, b in after.items()}
    joins = set(after)  # keys that still join the key after them
    for g in groups:
        for i, k in enumerate(g):
            if k in after and (g[i + 1] if i + 1 < len(g) else None) != after[k]:
                joins.discard(k)
            if k in before and (g[i - 1] if i else None) != before[k]:
                joins.discard(before[k])
    new_keys: list[list[str]] = []
    new_dims: list[list[int]] = []
    size: dict[str, int] = {}  # first key of a run -> its number of keys
    for k_list, d_list in zip(keys, dims):
        runs: list[str] = []
        widths: list[int] = []
        run: list[str] = []
        width = 0
        for k, d in zip(k_list, d_list):
            run.append(k)
            width += d
            if k not in joins:
                runs.append("+".join(run))
                widths.append(width)
                size[run[0]] = len(run)
                run, width = [], 0
        new_keys.append(runs)
        new_dims.append(widths)
    new_groups = []
    for g in groups:
        merged, i = [], 0
        while i < len(g):
            n = size[g[i]]  # a group holds each run whole, from its first key
            merged.append("+".join(g[i : i + n]))
            i += n
        new_groups.append(merged)
    return new_keys, new_dims, new_groups


class Regroup(nn.Module):
    """Regroup a fixed layout of keyed blocks into named groups of keys (duplicates allowed)."""

    def __init__(
        self,
        keys: Sequence[Sequence[str]],
        dims: Sequence[Sequence[int]],
        groups: Mapping[str, Sequence[str]],
    ) -> None:
        super().__init__()
        if len(keys) != len(dims) or any(len(k) != len(d) for k, d in zip(keys, dims)):
            raise ValueError("Regroup: keys and dims must have the same nesting")
        known: dict[str, int] = {}
        for k_list, d_list in zip(keys, dims):
            for k, d in zip(k_list, d_list):
                if k in known:
                    raise ValueError(f"Regroup: key {k!r} appears in two input blocks; input keys must be unique")
                known[k] = d
        if not groups:
            raise ValueError("Regroup: give at least one output group")
        for name, members in groups.items():
            missing = [k for k in members if k not in known]
            if missing:
                raise ValueError(
                    f"output group {name!r} names unknown features {missing}; known features: {sorted(known)}"
                )
            if not members:
                raise ValueError(f"output group {name!r} is empty; list at least one feature")
        self.names = list(groups)
        self._keys = [list(k) for k in keys]
        self._dims = [list(d) for d in dims]
        self._groups = [list(groups[n]) for n in self.names]
        used = {k for g in self._groups for k in g}
        self._unused_cols: list[torch.Tensor] = []
        for k_list, d_list in zip(self._keys, self._dims):
            cols, pos = [], 0
            for k, d in zip(k_list, d_list):
                if k not in used:
                    cols.extend(range(pos, pos + d))
                pos += d
            self._unused_cols.append(torch.tensor(cols, dtype=torch.int64))
        self.out_dims = [sum(known[k] for k in g) for g in self._groups]
        self._args: tuple | None = None
        self._args_device: torch.device | None = None

    def _arguments(self, device: torch.device) -> tuple:
        if self._args_device != device:
            permutes, in_shapes, out_shapes, out_lengths = torch.ops.fbgemm.kt_regroup_arguments(
                torch.empty(0), *coalesce(self._keys, self._dims, self._groups)
            )
            self._args = (permutes.to(device), in_shapes.to(device), out_shapes.to(device), list(out_lengths))
            self._unused_cols = [c.to(device) for c in self._unused_cols]
            self._args_device = device
        return self._args  # type: ignore[return-value]

    def forward(self, blocks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`blocks[i]` is `[B, sum(dims[i])]`; returns {group name: `[B, group width]`}."""
        device = blocks[0].device
        permutes, in_shapes, out_shapes, out_lengths = self._arguments(device)
        inputs = []
        for x, unused in zip(blocks, self._unused_cols):
            if x.requires_grad and unused.numel():
                x = _ZeroUnusedColumnsGrad.apply(x, unused)
            inputs.append(x)
        outs = torch.ops.fbgemm.permute_multi_embedding(inputs, permutes, in_shapes, out_shapes, out_lengths)
        return dict(zip(self.names, outs))
