"""Explicit collectives. Each `start_*` launches the collective and returns a handle; `.wait()` returns the
received tensor. Nothing waits lazily: a reader sees where every collective starts and where it is waited on.

Float tensors that require grad get an autograd edge at `.wait()`: the backward of an all-to-all is the
all-to-all with the splits swapped, run when autograd reaches it.

Watchdog. Every collective carries a label (the exchange, and the step from `scope`). With `set_timeout(s)`, a
wait that blocks the host (every wait on the CPU; on the GPU the waits whose result the host reads) raises
`CollectiveTimeout` after `s` seconds, naming the exchange, the step and the collectives this rank issued before
it that have not completed, instead of hanging. On the GPU most waits only order streams: a hang there shows at
the step's next host wait, whose error lists the collective still pending.

CUDA graphs that hold collectives. With NCCL's graph mixing support off (`NCCL_GRAPH_MIXING_SUPPORT=0`, which
`distributed.init_distributed` sets for a whole-step graph: the captured collectives of its two communicators then
do not wait on each other, as they did with it on), NCCL requires that no collective outside a graph is issued on a
communicator while a launch of a graph that uses it is outstanding. Each replay of such a graph calls
`graph_launched` with the groups it holds collectives of, and every NCCL collective started here first waits for
the latest replay holding its group's to finish (`wait_for_graphs`: one host wait, paid only by the first
uncaptured collective after a replay).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

_TIMEOUT_S: float | None = None
_SCOPE: list[str] = [""]
_ISSUED: deque = deque(maxlen=32)  # (label, work) of the latest collectives this rank started
_TRACE: list[list[str]] = []  # open `trace()` recorders: every collective's label, in the order started
_GRAPH_LAUNCHES: dict[int, tuple] = {}  # id(group) -> (group, event of the latest replay holding its collectives)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout (`set_timeout`); raised on the rank that waited."""


def set_timeout(seconds: float | None) -> None:
    """Raise `CollectiveTimeout` when a host-blocking wait exceeds `seconds` (None: wait forever)."""
    global _TIMEOUT_S
    _TIMEOUT_S = seconds


@contextmanager
def scope(label: str) -> Iterator[None]:
    """Prefix the labels of the collectives started inside (e.g. "step 12") for the watchdog's messages."""
    _SCOPE.append(label)
    try:
        yield
    finally:
        _SCOPE.pop()


def scoped_label(what: str) -> str:
    """`what` prefixed by the current `scope` (capture it in forward for a collective that backward starts)."""
    return f"{_SCOPE[-1]}: {what}" if _SCOPE[-1] else what


@contextmanager
def trace() -> Iterator[list[str]]:
    """Record the label of every collective this rank starts inside (in order) into the yielded list. Every rank
    must start the same collectives in the same order: comparing the ranks' traces (`first_divergence`) names the
    first one where they part, the cause of a hang or of a collective desync."""
    labels: list[str] = []
    _TRACE.append(labels)
    try:
        yield labels
    finally:
        _TRACE.remove(labels)


def first_divergence(traces: Sequence[Sequence[str]]) -> str | None:
    """None if every rank's trace (`trace()`) is the same, else where the first difference is, naming each rank's
    collective there."""
    n = max((len(t) for t in traces), default=0)
    for i in range(n):
        at = [t[i] if i < len(t) else "<none>" for t in traces]
        if len(set(at)) > 1:
            return f"collective #{i} differs between ranks: " + "; ".join(f"rank {r}: {a}" for r, a in enumerate(at))
    return None


def graph_launched(groups: Sequence[dist.ProcessGroup | None] | None = None) -> None:
    """Note a replay of a CUDA graph holding NCCL collectives of `groups` (None: of any group), just launched on the
    current stream, where graph mixing support is off (otherwise NCCL orders graph and uncaptured collectives itself
    and nothing is noted)."""
    if os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0":
        event = torch.cuda.current_stream().record_event()  # replays complete in stream order: the latest suffices
        for group in groups if groups is not None else [None]:
            _GRAPH_LAUNCHES[id(group)] = (group, event)


def wait_for_graphs(group: dist.ProcessGroup | None = None) -> None:
    """Before a collective outside a graph on `group` (None: the default group, or any): wait until the latest graph
    replay noted by `graph_launched` that holds collectives of `group` has finished, when `group` is an NCCL group
    (gloo's collectives never meet a graph) and no capture is under way (a captured collective is part of the graph
    being made)."""
    if not _GRAPH_LAUNCHES or torch.cuda.is_current_stream_capturing():
        return
    if group is not None and "nccl" not in str(dist.get_backend(group)):
        return
    for key, (held, event) in list(_GRAPH_LAUNCHES.items()):
        if held is None or group is None or held is group:
            event.synchronize()
            del _GRAPH_LAUNCHES[key]


def _issued(label: str, work: dist.Work | None) -> dist.Work | None:
    if work is not None:
        _ISSUED.append((label, work))
        for labels in _TRACE:
            labels.append(label)
    return work


def wait_work(work: dist.Work, label: str, host: bool = True) -> None:
    """Wait for `work`; with a timeout set and a host-blocking wait (`host`, or any CPU collective), raise
    `CollectiveTimeout` naming `label` and the collectives still pending when it does not complete in time."""
    if _TIMEOUT_S is None or not host:
        work.wait()
        return
    deadline = time.monotonic() + _TIMEOUT_S
    nap = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            pending = [lbl for lbl, w in _ISSUED if w is not work and not w.is_completed()]
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise CollectiveTimeout(
                f"rank {rank}: {label} did not complete within {_TIMEOUT_S:g} s (runtime.collective_timeout_s). "
                f"Collectives this rank started before it and still pending: {pending or 'none'}. Every rank must "
                "run the same collectives in the same order: look for a rank that stopped, skipped a step or a "
                "batch, or ran into an error first (its own log says which)"
            )
        # Yield first (a host sync of the step is usually short), then back off to at most 50 us between polls: a
        # late wait costs tens of microseconds, not the millisecond a fixed sleep would.
        time.sleep(nap)
        nap = min(5e-5, nap + 2e-6)
    work.wait()  # completes it (and surfaces a backend error)


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
        label: str = "all-to-all",
    ) -> None:
        self.label = label
        self._sent = sent
        self._received = received
        self._work = work
        self._input_splits = input_splits
        self._output_splits = output_splits
        self._group = group

    def wait(self, host: bool = False) -> torch.Tensor:
        """Wait until the data has arrived and return it (connected to autograd when the input needs grad);
        `host=True` when the host reads the result right after (the watchdog's timeout applies)."""
        if self._work is not None:
            wait_work(self._work, self.label, host=host or self._received.device.type == "cpu")
            self._work = None
        received, sent = self._received, self._sent
        self._received = self._sent = None  # the handle is done: it must not keep the step's buffers alive
        if sent.requires_grad:
            splits = (self._input_splits, self._output_splits)
            return _AllToAllGrad.apply(sent, received, splits, self._group, self.label)
        return received


class _AllToAllGrad(torch.autograd.Function):
    """Identity on the already-received tensor; backward sends gradients back along the reverse routes.

    The context keeps only the splits and the group: holding the handle or the received tensor would make a
    reference cycle (output -> its node -> context -> output) that keeps every step's buffers alive until
    Python's garbage collector runs."""

    @staticmethod
    def forward(ctx, sent, received, splits, group, label):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.label = splits, group, label
        ctx.sent_shape = sent.shape
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        input_splits, output_splits = ctx.splits
        label = f"{ctx.label} (backward)"
        grad_in = start_all_to_all(grad.contiguous(), output_splits, input_splits, ctx.group, label, scoped=False)
        return grad_in.wait().view(ctx.sent_shape), None, None, None, None


def start_all_to_all(
    tensor: torch.Tensor,
    input_splits: Sequence[int],
    output_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
    label: str = "all-to-all",
    scoped: bool = True,
) -> AllToAllHandle:
    """Start an all-to-all of the first dimension of `tensor`: `input_splits[r]` rows go to rank r and
    `output_splits[r]` rows arrive from rank r. Returns a handle; call `.wait()` for the received tensor.
    `label` names it in watchdog errors (prefixed by the current `scope` unless `scoped=False`)."""
    input_splits, output_splits = list(input_splits), list(output_splits)
    if sum(input_splits) != tensor.shape[0]:
        raise ValueError(f"all_to_all: input_splits sum to {sum(input_splits)} but the tensor has {tensor.shape[0]}")
    send = tensor.detach().contiguous()
    received = send.new_empty((sum(output_splits), *send.shape[1:]))
    if _world(group) == 1:
        received.copy_(send)
        work = None
    else:
        wait_for_graphs(group)
        work = dist.all_to_all_single(
            received,
            send,
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=group,
            async_op=True,
        )
    label = scoped_label(label) if scoped else label
    return AllToAllHandle(tensor, received, _issued(label, work), input_splits, output_splits, group, label)


class CollectiveHandle:
    """A collective without autograd in flight (all-reduce, all-gather); `wait()` returns its result tensor."""

    def __init__(self, result: torch.Tensor, work: dist.Work | None, label: str = "collective") -> None:
        self._result = result
        self._work = work
        self.label = label

    def wait(self, host: bool = False) -> torch.Tensor:
        """Wait until the collective is complete and return its result; `host=True` when the host reads the
        result right after (the watchdog's timeout applies; it always does on the CPU)."""
        if self._work is not None:
            wait_work(self._work, self.label, host=host or self._result.device.type == "cpu")
            self._work = None
        return self._result


def start_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, what: str = "all-reduce", scoped: bool = True
) -> CollectiveHandle:
    """Start an in-place sum over ranks of `tensor` (no autograd); `wait()` returns `tensor`. `what` names it for
    the watchdog (prefixed by the current `scope` unless `scoped=False`)."""
    if _world(group) == 1:
        return CollectiveHandle(tensor, None)
    label = scoped_label(what) if scoped else what
    wait_for_graphs(group)
    return CollectiveHandle(tensor, _issued(label, dist.all_reduce(tensor, group=group, async_op=True)), label)


def start_all_gather(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, what: str = "all-gather"
) -> CollectiveHandle:
    """Start gathering `tensor` (same shape on every rank) from every rank (no autograd); `wait()` returns
    `[W, *shape]`, every rank's tensor in rank order."""
    W = _world(group)
    flat = tensor.new_empty(W * tensor.numel())  # gloo wants the flat concatenation
    if W == 1:
        flat.copy_(tensor.reshape(-1))
        return CollectiveHandle(flat.view(W, *tensor.shape), None)
    wait_for_graphs(group)
    work = _all_gather_single(flat, tensor.contiguous().reshape(-1), group=group, async_op=True)
    name = scoped_label(what)
    return CollectiveHandle(flat.view(W, *tensor.shape), _issued(name, work), name)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank of `group` reaches this point before any leaves it, on the group's own device: NCCL on the current
    GPU (torch's `barrier()` otherwise guesses the device and warns), gloo as a one-element CPU all-reduce."""
    if "nccl" in str(dist.get_backend(group)):  # "nccl", or a group of several backends ("cpu:gloo,cuda:nccl")
        wait_for_graphs(group)
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.all_reduce(torch.zeros(1), group=group)


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """torch.distributed's gather into one flat tensor: `all_gather_single` where torch has it (from 2.13, where
    `all_gather_into_tensor` is deprecated with a FutureWarning), else `all_gather_into_tensor` (the same call)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _world(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def world_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(world size, rank) of `group`, or (1, 0) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
