"""Small device-side helpers shared by the id check, the exchanges and the schemes: constant tensors made once,
segment sums and per-id feature indices without host syncs, and FBGEMM's sparse permutes guarded for empty input.

FBGEMM's CUDA sparse ops launch one block per row of their input; with no rows (a rank whose local batch is empty,
or a feature with no ids) some of them fail to launch. Every rank must still enter every collective of the step, so
a rank with nothing to send lays out its (empty) buffers here on the host side of the op instead of calling it.
"""

from __future__ import annotations

from collections.abc import Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch

_DEVICE_CACHE: dict[tuple, torch.Tensor] = {}


def cached_tensor(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A device copy of a small constant list, made once per (values, device, dtype): no per-step copy."""
    key = (tuple(values), str(device), dtype)
    t = _DEVICE_CACHE.get(key)
    if t is None:
        if len(_DEVICE_CACHE) > 4096:
            _DEVICE_CACHE.clear()
        t = _DEVICE_CACHE[key] = torch.tensor(list(values), device=device, dtype=dtype)
    return t


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on a GPU copied from page-locked memory without waiting (no host sync)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def small_to_device(values: Sequence, device: torch.device) -> torch.Tensor:
    """A small int64 host list (nested lists: a table) on `device`, copied without a host sync (`host_to_device`):
    for values that change from step to step, where `cached_tensor` would only grow."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def segment_sums(lengths: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Sums of consecutive segments of `lengths` with the given sizes (on the same device, no sync)."""
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    bounds = cached_tensor(ends, lengths.device)
    csum = torch.cat([lengths.new_zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])
    return csum[bounds[1:]] - csum[bounds[:-1]]


def feature_of_ids(ids_F: torch.Tensor, n: int) -> torch.Tensor:
    """For `n` ids laid out feature-major with `ids_F[f]` ids of feature f, the feature of each id (no host sync).
    The same as `repeat_interleave(arange(F), ids_F)`, whose CUDA kernel spends one thread per feature: slow for a
    few features of many ids."""
    ends = ids_F.to(torch.int64).cumsum(0)
    return torch.searchsorted(ends, torch.arange(n, device=ids_F.device), right=True)


def weights_or_ones(values: torch.Tensor, weights: torch.Tensor | None, weighted: bool) -> torch.Tensor | None:
    """The per-id weights to send for a scheme: None if not `weighted` (none of its tables is weighted, and the
    batch is not one whose every id is weighted: a padded batch, `Scheme.every_id_weighted`), else the batch's
    weights (fp32 ones where the batch has none)."""
    if not weighted:
        return None
    return weights if weights is not None else torch.ones_like(values, dtype=torch.float32)


def permute_2d(
    perm: torch.Tensor, lengths_RB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None, n_out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `perm` of a jagged `[R, B]` batch (lengths, ids, weights): FBGEMM's `permute_2D_sparse_data` with the
    output's id count `n_out` known on the host. Returns `[len(perm), B]` lengths, ids and weights."""
    if lengths_RB.numel() == 0 or n_out == 0:  # nothing to move (all selected bags are empty): no kernel
        w = weights[:0] if weights is not None else None
        return lengths_RB.index_select(0, perm.long()), values[:0], w
    return torch.ops.fbgemm.permute_2D_sparse_data(perm, lengths_RB, values, weights, n_out)


def permute_1d(
    perm: torch.Tensor, segment_lengths: torch.Tensor, data: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Segments `perm` of `data` (and of `weights`, same segments) cut into consecutive segments of
    `segment_lengths`: FBGEMM's `permute_1D_sparse_data`, the output size being the input's (no sync)."""
    if data.numel() == 0:  # nothing to move: no kernel
        return data, weights
    _, out, w = torch.ops.fbgemm.permute_1D_sparse_data(perm, segment_lengths, data, weights, data.numel())
    return out, w


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets `[0, l0, l0+l1, ...]` of a jagged batch (the lengths' dtype; also for empty `lengths`)."""
    if lengths.numel() == 0:
        return lengths.new_zeros(1)
    return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` in the forward; its gradient times `scale` in the backward (`x` itself when scale is 1)."""
    return x if scale == 1 else _ScaleGrad.apply(x, scale)


def join_views(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A view of the one contiguous tensor that `parts` (of one shape but the first dimension) are, in order, the
    whole of (the split views of one tensor, as `split` gives them), shaped `[-1, *parts[0].shape[1:]]`; None if they
    are not (then `torch.cat` joins them).
    Autograd reaches the tensor through the view directly, without the pieces."""
    if not parts or any(p.shape[1:] != parts[0].shape[1:] for p in parts):
        return None
    base = parts[0]._base
    if base is None or not base.is_contiguous() or any(p._base is not base or not p.is_contiguous() for p in parts):
        return None
    at, size = base.data_ptr(), base.element_size()
    for p in parts:
        if p.data_ptr() != at:
            return None
        at += p.numel() * size
    if at != base.data_ptr() + base.numel() * size:
        return None
    return base.view(-1, *parts[0].shape[1:])


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` without a copy where there is nothing to join: one part itself, or the view `join_views`
    finds."""
    if len(parts) == 1:
        return parts[0]
    view = join_views(parts)
    return view if view is not None else torch.cat(list(parts))
