"""The sharded collection's training step as one CUDA graph, for a training loop of its own around
`ShardedEmbeddingBagCollection` (a model's whole training step, dense part included, is embshard/training/step_graph.py's).

An eager step of the collection is a few hundred launches of Python and dispatcher work (the id exchange per
sharding scheme, the lookups, the pooled exchange, the regroup, their backward with the fused sparse update, the
data-parallel all-reduce and update); on GPUs the host takes longer to launch them than the GPU to run them.
`EmbeddingStepGraph.step(kjt, counts)` runs the same step from one replay:

    padded batch    every batch is padded to a capacity per feature (embshard/collection/padding.py: filler ids of weight 0,
                    every lookup pooling with per-id weights), 10% over the largest counts seen on any rank, so the
                    exchanges, sized from the counts, have the same sizes in every step
    static inputs   the padded batch's values, lengths and weights, padded into them in each step
    graph           the id exchange, the lookups, the pooled exchange, the regroup, `loss_fn` of the pooled output,
                    and the backward: the pooled gradients' exchange, the lookups' backward with the fused sparse
                    update, the data-parallel tables' all-reduce and update
    output          the loss (copied out); every update is done

The first step of a capacity runs the body eagerly on the capture stream (the lazy initialisations happen there),
then captures it; the later steps replay. A batch over the capacity grows it (an eager step, then a new capture),
at most `max_captures` times. Every rank must call `step` with the same counts (the `host_counts` rows of every
rank, gathered on the host: `parse_counts`), so every rank replays, and runs the same collectives, together.

What it takes (`refusal`): table-wise, column-wise and data-parallel tables (their exchanges are sized from the host's
counts; column-wise row-wise Adagrad's exact update is sized from them too),
HBM or UVM tiers (not UVM-caching, whose prefetch runs on the host's schedule), static ids, out-of-range ids as an
error (drop mode drops on the device), and an update rule that leaves a row with a zero gradient as it is (the
fillers: sgd, adagrad, row-wise adagrad without weight decay; sum pooling). The sparse learning rate is a constant
of the captured launches. `capture=False` runs the padded step eagerly each call (any device: the step's
arithmetic checked against the eager step where CUDA graphs do not exist).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from embshard.collection import padding
from embshard.runtime import comm
from embshard.runtime.graphs import warm_up_and_capture
from embshard.sharding.exchange import BatchCounts
from embshard.spec.geometry import capacity
from embshard.spec.graph_rules import plan_refusal

__all__ = [
    "CapturedStep",
    "EmbeddingStepGraph",
    "backward_to_leaves",
    "collection_refusal",
    "leaves_of",
    "refusal",
    "static_kjt",
]


def collection_refusal(ebc) -> str | None:
    """Why the step of the sharded collection `ebc` cannot be captured with exchanges sized from the host's counts,
    or None if it can (the rules: embshard.spec.graph_rules.plan_refusal)."""
    why = plan_refusal(ebc.tables, ebc.plan, ebc.options.bounds_check)
    return None if why is None else why.reason


def refusal(ebc) -> str | None:
    """Why `EmbeddingStepGraph` cannot run the step of `ebc`, or None if it can."""
    return collection_refusal(ebc) or padding.refusal(ebc)


def leaves_of(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (AccumulateGrad nodes) that the autograd graphs of `ts` reach: the lookups' placeholders and
    replicas."""
    leaves, seen, stack = [], set(), [t.grad_fn for t in ts]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # an AccumulateGrad node
            leaves.append(fn.variable)
        else:
            stack.extend(f for f, _ in fn.next_functions)
    return leaves


def static_kjt(kjt):
    """A copy of `kjt` in tensors of its own: the device buffers a captured graph reads its batch from (each step's
    batch is copied in)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().clone(),
        lengths=kjt.lengths().clone(),
        weights=weights.clone() if weights is not None else None,
        stride=kjt.stride(),
    )


def backward_to_leaves(loss: torch.Tensor) -> None:
    """The backward of `loss` to the leaves its autograd graph reaches (`leaves_of`: the fused updates run in it),
    without running their AccumulateGrad nodes (a node an earlier eager step made belongs to that step's stream, and
    the engine would make a capture wait on it)."""
    leaves = leaves_of(loss)
    if leaves:
        torch.autograd.grad(loss, leaves, allow_unused=True)


class CapturedStep:
    """What a collection's step graph keeps from one call to the next and how it runs a step: the captured graph
    (None before a capture, or once the step's sizes changed), its side stream, the loss its replays write, and the
    captures and replays so far. A subclass gives `_body()` (the step: run eagerly, or captured) and `collection`
    (with `device`, `step`, `set_step`, `advance_step`), and may give `_undo_capture` (what a failed capture leaves
    behind). `capture=False` runs the body eagerly each call."""

    eager_hint = "the collection's forward"
    """How to train on if a capture fails (the error says it)."""

    def __init__(self, collection, why_not: str | None, capture: bool, max_captures: int) -> None:
        name = type(self).__name__
        if why_not is not None:
            raise ValueError(f"{name}: {why_not}")
        if capture and collection.device.type != "cuda":
            raise ValueError(f"{name}(capture=True) needs a CUDA collection; this one is on {collection.device}")
        self.collection, self.capture, self.max_captures = collection, capture, max_captures
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self.replays = 0
        self._loss: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    def _body(self) -> torch.Tensor:
        raise NotImplementedError

    def _run(self) -> torch.Tensor:
        """The step on the static inputs: the graph's replay if there is one (counted as the eager forward counts
        its step), else the body eagerly (capture=False), else the body eagerly on the capture stream (its updates
        are done) and then its capture (which computes nothing and counts no step). Returns the step's loss."""
        if self.graph is not None:
            self.graph.replay()
            comm.graph_launched()
            self.replays += 1
            self.collection.advance_step()
            return self._loss.clone()
        if not self.capture:
            return self._body()
        device = self.collection.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        loss, graph, self._loss = warm_up_and_capture(
            self._body, device, stream=self._stream, record_output=True, around=self._capturing
        )
        self.graph, self.captures = graph, self.captures + 1
        return loss

    def _undo_capture(self) -> Callable[[], None]:
        """Called before a capture; returns what undoes, after a failed capture, what it left behind."""
        return lambda: None

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        """Around the capture: the collection's step count as it was (the capture ran no step), `_undo_capture`'s
        undoing after a failure, which raises saying how to train on."""
        step, undo = self.collection.step, self._undo_capture()
        try:
            yield
        except Exception as e:
            undo()
            raise RuntimeError(
                f"{type(self).__name__}: capturing the step failed ({type(e).__name__}: {e}); this step's updates "
                f"are done (its eager run): train on with the eager step, {self.eager_hint} and its backward"
            ) from e
        finally:
            self.collection.set_step(step)

    def close(self) -> None:
        """Release the captured graph after the device finished its work; call it before
        `dist.destroy_process_group()` (a live graph holding NCCL collectives hangs the teardown)."""
        if self.graph is not None:
            torch.cuda.synchronize(self.collection.device)
        self.graph = None


class EmbeddingStepGraph(CapturedStep):
    """The training step of the sharded collection `ebc`, with the loss `loss_fn(output)` of its forward's output
    (a KeyedTensor, or the groups' dict), as one CUDA graph for ragged batches padded to a capacity (module
    docstring). `capture=False`: the same padded step eagerly, each call."""

    eager_hint = "`ebc(kjt)`"

    def __init__(
        self,
        ebc,
        loss_fn: Callable[[object], torch.Tensor],
        capture: bool = True,
        max_captures: int = 8,
    ) -> None:
        super().__init__(ebc, refusal(ebc), capture, max_captures)
        self.loss_fn = loss_fn
        self._padder = padding.BatchPadder(ebc)
        self.capacity: np.ndarray | None = None  # ids per canonical column, every rank's
        self._static: tuple | None = None  # (padded kjt of static tensors, its tensors)
        self._counts: BatchCounts | None = None

    @property
    def ebc(self):
        """The sharded collection whose step this is."""
        return self.collection

    def step(self, kjt, counts: BatchCounts) -> torch.Tensor:
        """One training step on this rank's batch `kjt` (on the collection's device) with every rank's agreed
        `counts`; returns the loss (a tensor of its own), every update done."""
        most = np.asarray(counts.ids, dtype=np.int64).max(0)
        if self.capacity is None or (most > self.capacity).any():
            if self.captures >= self.max_captures:
                raise RuntimeError(
                    f"EmbeddingStepGraph: the capacity grew {self.captures} times (max_captures) and batch counts "
                    f"{most.tolist()} exceed it again: the batches' sizes do not settle; raise max_captures or run "
                    "the eager step"
                )
            grown = most if self.capacity is None else np.maximum(self.capacity, most)
            self.capacity, self.graph = capacity(grown), None
        static = self._static
        n_ids, n_bags = int(self.capacity.sum()), kjt.lengths().numel()
        if static is not None and (static[1][0].numel(), static[1][1].numel()) == (n_ids, n_bags):
            values, lengths, weights = static[1]  # padded straight into the graph's inputs
            padded, full = self._padder.pad(kjt, counts, self.capacity, out=(values, weights, lengths))
            if padded.keys() != static[0].keys():
                raise RuntimeError(f"EmbeddingStepGraph: the padded batch's keys changed order: {padded.keys()[:4]}")
        else:
            padded, full = self._padder.pad(kjt, counts, self.capacity)
            self._make_static(padded)
            torch._foreach_copy_(self._static[1], [padded.values(), padded.lengths(), padded.weights()])
        self._counts = full
        return self._run()

    def _body(self) -> torch.Tensor:
        ebc, kjt = self.ebc, self._static[0]
        with ebc.weighing_every_id():
            handle = ebc.prefetch(kjt, counts=self._counts)  # the id exchange, sized from the padded counts
            loss = self.loss_fn(ebc(kjt, prefetched=handle))
            backward_to_leaves(loss)
        return loss.detach()

    def _undo_capture(self) -> Callable[[], None]:
        """A prefetch that a failed capture left unconsumed is dropped."""
        pending = self.ebc.pending_prefetches
        return lambda: self.ebc.drop_prefetches(keep=pending)

    def _make_static(self, padded) -> None:
        static = static_kjt(padded)
        self._static, self.graph = (static, [static.values(), static.lengths(), static.weights()]), None
