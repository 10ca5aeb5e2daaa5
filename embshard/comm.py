"""Explicit collectives. Each `start_*` launches the collective and returns a handle; `.wait()` returns the
received tensor. Nothing waits lazily: a reader sees where every collective starts and where it is waited on.

Float tensors that require grad get an autograd edge at `.wait()`: the backward of an all-to-all is the
all-to-all with the splits swapped, run when autograd reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class AllToAllHandle:
    """An all-to-all in flight. `wait()` returns the received tensor (once)."""

    def __init__(
        self,
        sent: torch.Tensor,
        received: torch.Tensor,
        work: dist.Work | None,
        input_splits: list[int],
        output_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> None:
        self._sent = sent
        self._received = received
        self._work = work
        self._input_splits = input_splits
        self._output_splits = output_splits
        self._group = group

    def wait(self) -> torch.Tensor:
        """Block until the data has arrived and return it (connected to autograd when the input needs grad)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        received, sent = self._received, self._sent
        self._received = self._sent = None  # the handle is done: it must not keep the step's buffers alive
        if sent.requires_grad:
            return _AllToAllGrad.apply(sent, received, self._input_splits, self._output_splits, self._group)
        return received


class _AllToAllGrad(torch.autograd.Function):
    """Identity on the already-received tensor; backward sends gradients back along the reverse routes.

    The context keeps only the splits and the group: holding the handle or the received tensor would make a
    reference cycle (output -> its node -> context -> output) that keeps every step's buffers alive until
    Python's garbage collector runs."""

    @staticmethod
    def forward(ctx, sent, received, input_splits, output_splits, group):  # type: ignore[override]
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        ctx.sent_shape = sent.shape
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        input_splits, output_splits = ctx.splits
        grad_in = start_all_to_all(grad.contiguous(), output_splits, input_splits, ctx.group).wait()
        return grad_in.view(ctx.sent_shape), None, None, None, None


def start_all_to_all(
    tensor: torch.Tensor,
    input_splits: Sequence[int],
    output_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> AllToAllHandle:
    """Start an all-to-all of the first dimension of `tensor`: `input_splits[r]` rows go to rank r and
    `output_splits[r]` rows arrive from rank r. Returns a handle; call `.wait()` for the received tensor."""
    input_splits, output_splits = list(input_splits), list(output_splits)
    if sum(input_splits) != tensor.shape[0]:
        raise ValueError(f"all_to_all: input_splits sum to {sum(input_splits)} but the tensor has {tensor.shape[0]}")
    send = tensor.detach().contiguous()
    received = send.new_empty((sum(output_splits), *send.shape[1:]))
    if _world(group) == 1:
        received.copy_(send)
        work = None
    else:
        work = dist.all_to_all_single(
            received,
            send,
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=group,
            async_op=True,
        )
    return AllToAllHandle(tensor, received, work, input_splits, output_splits, group)


class CollectiveHandle:
    """A collective without autograd in flight (all-reduce, all-gather); `wait()` returns its result tensor."""

    def __init__(self, result: torch.Tensor, work: dist.Work | None) -> None:
        self._result = result
        self._work = work

    def wait(self) -> torch.Tensor:
        """Block until the collective is complete and return its result."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


def start_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> CollectiveHandle:
    """Start an in-place sum over ranks of `tensor` (no autograd); `wait()` returns `tensor`."""
    if _world(group) == 1:
        return CollectiveHandle(tensor, None)
    return CollectiveHandle(tensor, dist.all_reduce(tensor, group=group, async_op=True))


def start_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> CollectiveHandle:
    """Start gathering `tensor` (same shape on every rank) from every rank (no autograd); `wait()` returns
    `[W, *shape]`, every rank's tensor in rank order."""
    W = _world(group)
    flat = tensor.new_empty(W * tensor.numel())  # gloo wants the flat concatenation
    if W == 1:
        flat.copy_(tensor.reshape(-1))
        return CollectiveHandle(flat.view(W, *tensor.shape), None)
    work = dist.all_gather_into_tensor(flat, tensor.contiguous().reshape(-1), group=group, async_op=True)
    return CollectiveHandle(flat.view(W, *tensor.shape), work)


def _world(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def world_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(world size, rank) of `group`, or (1, 0) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
