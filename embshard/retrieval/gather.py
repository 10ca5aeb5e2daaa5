"""Every rank's rows side by side, with autograd: the queries (and targets, item vectors) of the global batch.

gather_sizes(B_r)               one all-gather of the local batch sizes -> [B_0, ..., B_{W-1}] (a host sync)
gather_rows(x [B_r, ...])       all-gather -> [B_global, ...] in rank order (sizes may differ: padded to the
                                largest for the collective, then cut)
backward of gather_rows         the gradient of the global rows [B_global, ...] goes back to each row's rank and
                                is summed over ranks: a reduce-scatter, written as one all-to-all (rank d receives
                                every rank's gradient of its rows) and a sum, so it runs on gloo and NCCL alike
scatter_sum_rows(x [B_global])  the reverse: every rank's partial rows of the global batch, summed over the ranks,
                                each rank keeping its own [B_r, ...] (that reduce-scatter); backward: gather_rows
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embshard.runtime.comm import start_all_gather, start_all_to_all, world_and_rank


def gather_sizes(n: int, device: torch.device, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's `n` (its local batch size), in rank order: one small all-gather and a host sync."""
    return start_all_gather(torch.tensor([n], dtype=torch.int64, device=device), group).wait().view(-1).tolist()


def _all_gather_padded(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    W, biggest = len(sizes), max(sizes)
    if all(s == biggest for s in sizes):
        return start_all_gather(x.contiguous(), group).wait().view(W * biggest, *x.shape[1:])
    padded = x.new_zeros(biggest, *x.shape[1:])
    padded[: x.shape[0]] = x
    everyone = start_all_gather(padded, group).wait()
    return torch.cat([everyone[r, : sizes[r]] for r in range(W)])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_padded(x.detach(), sizes, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        sizes, group = ctx.sizes, ctx.group
        W, rank = world_and_rank(group)
        if W == 1:
            return grad, None, None
        mine = sizes[rank]
        received = start_all_to_all(grad.contiguous(), sizes, [mine] * W, group).wait()
        return received.view(W, mine, *grad.shape[1:]).sum(0), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`[sum(sizes), ...]`: every rank's `x` (`sizes[r]` rows on rank r), in rank order. Collective. Differentiable
    for float tensors: the backward sums each row's gradient over the ranks and returns it to the row's rank."""
    if x.requires_grad and torch.is_grad_enabled():
        return _GatherRows.apply(x, sizes, group)
    return _all_gather_padded(x, sizes, group)


class _ScatterSumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        W, rank = world_and_rank(group)
        if W == 1:
            return x.detach().clone()
        mine = sizes[rank]
        received = start_all_to_all(x.detach().contiguous(), sizes, [mine] * W, group).wait()
        return received.view(W, mine, *x.shape[1:]).sum(0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_padded(grad.contiguous(), ctx.sizes, ctx.group), None, None


def scatter_sum_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`[sizes[rank], ...]`: this rank's rows of the sum over every rank's `x` `[sum(sizes), ...]` (rows in rank
    order, as gather_rows lays them out). Collective; differentiable (the backward all-gathers the gradient). Under
    grad mode every rank runs that backward collective, also a rank whose `x` needs no gradient (e.g. a rank
    holding no rows of the summed blocks): the ranks' backward collectives stay in step."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return _ScatterSumRows.apply(x, sizes, group)
