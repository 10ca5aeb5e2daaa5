"""The whole training step as one CUDA graph (YAML `training.cuda_graph` with `training.graph_scope: step`).

With the dense step alone in a graph (embshard/training/dense_graph.py) a bf16 step is still bound by the host: the
embeddings' side of the step (the id exchange, the lookups, the pooled exchange, the regroup and their backward)
is a few hundred launches of Python and dispatcher work around a few milliseconds of GPU work. When every rank's
batch has the same counts as at the step before (fixed bags: the MLPerf multi-hot sizes, any source whose bags
have fixed lengths), every buffer and every all-to-all of the step has the same size, so the whole step is
captured once and each later step with those counts replays it with one launch:

    static inputs   the batch (dense features, the ids' lengths and values, labels), copied in each step
    graph           the id exchange (sized from the captured counts), the lookups, the pooled exchange and the
                    regroup; the dense forward, loss and gradients (`DenseGraphStep.forward_backward`); the
                    embeddings' backward with the exchange's backward and the fused sparse update; the dense
                    gradients' all-reduce and the dense optimizer's step (`DenseGraphStep.reduce_and_update`)
    outputs         the loss and the logits (copied out), every update done

Which steps replay: the pipeline asks `ready(counts)` (a query; a step it turns down goes to `prepare(counts)`,
which sizes the graph for the steps to come) with the ranks' agreed counts of the batch (gathered on the
host a step ahead, the same on every rank), so every rank replays, and runs the same collectives, together. A step
whose counts differ from the step before's runs the other way (the dense graph or the eager step); the first step
whose counts repeat runs the graph's step eagerly on the capture stream (the lazy initialisations happen there),
then captures it; the later ones replay.

Ragged bags (counts that change from step to step): from the first change on, the graph is captured for a capacity
per feature (10% over the largest counts seen, `capacity`), and every batch whose counts fit is padded to it before
the replay: each feature's bags keep their ids and gain filler ids spread evenly over them up to the capacity (on the
first 1,024 rows of the feature's table, so that no bag is long and no row hot), every id with a weight (the
batch's own for weighted tables, 1 for the others, 0 for the fillers), and every lookup that meets fillers pools
with the weights (`ebc.weighing_every_id`; the data-parallel tables on the small-table kernels get none:
embshard/collection/padding.py). A filler adds nothing to its bag and gets a zero gradient, which leaves its row as it is
under sgd, adagrad and row-wise adagrad without weight decay. A batch over the capacity grows it (eager step, then
a new capture). Where padding does not apply (`padding_refusal`: mean pooling, adam or weight
decay), counts that keep changing are noticed after `max_changes` eligible steps and the graph is
given up (`given_up` says why): the pipeline then runs the id exchange ahead again.

What it takes (`refusal` says what is missing): table-wise, column-wise and data-parallel tables only (their
exchanges are sized from the host's counts; row-wise bucketing sizes its exchange on the device), HBM or UVM tiers (not
UVM-caching: its prefetch runs on the host's schedule), static ids (not raw ids), out-of-range ids as an error
(the host's counts check them; drop mode drops on the device), no retrieval catalog. The sparse optimizer's
learning rate is a constant of the captured TBE launches (embshard has no sparse schedule); a dense learning rate
that a fused optimizer holds as a constant drops the graph when it changes (captured again when counts repeat).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from embshard.collection import padding
from embshard.collection.emb_graph import collection_refusal, leaves_of, static_kjt
from embshard.models.registry import StepOutput
from embshard.runtime import comm
from embshard.runtime.graphs import warm_up_and_capture
from embshard.sharding.exchange import BatchCounts
from embshard.spec.geometry import capacity
from embshard.training.dense_graph import DenseGraphStep, model_refusal

__all__ = ["StepGraph", "capacity", "refusal"]


def refusal(model) -> str | None:
    """Why `model` (a RecModel) cannot run its whole step as one graph, or None if it can."""
    why = model_refusal(model.cfg.kind, model.kind.sparse_input, model.catalog is not None)
    return why or collection_refusal(model.ebc)


def padding_refusal(model) -> str | None:
    """Why `model`'s whole step cannot be captured for ragged bags by padding them (`StepGraph`, padded mode;
    embshard/collection/padding.py), or None if it can."""
    return padding.refusal(model.ebc)


class StepGraph:
    """The whole training step of `model` as one CUDA graph, for batches whose counts repeat, or (ragged bags,
    where `padding_refusal` allows) whose counts fit a capacity per feature that the batches are padded to.

    Args:
        model: the RecModel (its `ebc`, its kind's `sparse_input`); `refusal(model)` must be None.
        dense_step: the DenseGraphStep of its dense part (its optimizer, gradient buffer, autocast); the dense part's
            own graph (for the steps that do not replay this one) and this one share its gradient buffer.
        capture: False runs the same step without a graph, each call (on any device: a check of the step's
            arithmetic against the eager one where CUDA graphs do not exist).
        max_changes: eligible steps whose counts differ from the step before's, with no graph captured yet, after
            which the graph is given up (the bags are ragged and cannot be padded); also the most captures.
        pad: capture ragged batches padded to a capacity (where `padding_refusal` allows).
        overlap: on CUDA, the dense gradients' all-reduce runs on a stream of its own, beside the embeddings'
            backward (the dense step's process group must then be a communicator of its own: two NCCL collectives of
            one communicator at once may wait on each other); the dense optimizer's step follows on the step's stream.
    """

    def __init__(
        self,
        model,
        dense_step: DenseGraphStep,
        capture: bool = True,
        max_changes: int = 8,
        pad: bool = True,
        overlap: bool = False,
    ) -> None:
        why = refusal(model)
        if why is not None:
            raise ValueError(why)
        self.model, self.dense_step, self.capture, self.max_changes = model, dense_step, capture, max_changes
        cuda = model.ebc.device.type == "cuda"
        self._side = torch.cuda.Stream(model.ebc.device) if overlap and cuda else None  # the dense update's
        self.padding_refused = padding_refusal(model) if pad else "padding is off"
        self.capacity: np.ndarray | None = None  # padded mode: ids per feature (canonical columns) of every rank
        self._padder = padding.BatchPadder(model.ebc)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.given_up: str | None = None  # why the graph was given up
        self.replays = 0  # steps the captured graph ran
        self.captures = 0
        self.changes = 0  # eligible steps whose counts differed from the step before's
        self._key: tuple | None = None  # the counts of the last eligible step
        self._counts: BatchCounts | None = None  # the counts the static buffers (and the graph) are sized for
        self._captured_lrs: list[float] = []
        self._stream: torch.cuda.Stream | None = None
        self.backward_parts = 0  # the last step's embedding backward: in 2 parts (the exchange's, the lookups') or 1

    # ---- when ------------------------------------------------------------------------------------------------
    def ready(self, counts: BatchCounts) -> bool:
        """Whether the step with the ranks' agreed `counts` runs the whole-step graph (`run`): it is eligible (the
        graph is not given up, gradients are on, no rank has out-of-range ids, every rank's batch has the training
        batch size) and the graph is sized for its counts: equal to the last eligible step's, or (padded mode)
        within the capacity. A query: it changes nothing. A step it turns down goes to `prepare`."""
        if not self._eligible(counts):
            return False
        ids = np.asarray(counts.ids, dtype=np.int64)
        if self.capacity is not None:  # padded mode: any counts that fit
            return bool((ids <= self.capacity).all())
        return (tuple(counts.batch_sizes), ids.tobytes()) == self._key

    def prepare(self, counts: BatchCounts) -> None:
        """After `ready(counts)` turned an eligible step down (the step then runs another way): size the graph for
        the steps to come. The first of a run of equal counts is remembered (the next step with them captures);
        once the counts have changed (padded mode, where `padding_refusal` allows), the capacity covers them (grown
        for a batch over it: captured again). Counts that keep changing without padding, or a capacity that keeps
        growing, give the graph up (`given_up` says why). Nothing for a step `ready` accepts or that is not
        eligible."""
        if not self._eligible(counts) or self.ready(counts):
            return
        ids = np.asarray(counts.ids, dtype=np.int64)
        if self.capacity is not None:  # padded mode: a batch over the capacity grows it
            self.capacity, self.graph = capacity(np.maximum(self.capacity, ids.max(0))), None  # capture again
            self.changes += 1
            if self.captures >= self.max_changes:
                self.given_up = f"captured {self.captures} times for a growing capacity: the counts do not settle"
            return
        key = (tuple(counts.batch_sizes), ids.tobytes())
        if self._key is not None and self.padding_refused is None:  # counts changed: pad from now on
            previous = np.frombuffer(self._key[1], dtype=np.int64).reshape(ids.shape)
            self.capacity, self.graph = capacity(np.maximum(previous, ids).max(0)), None
            self.changes += 1
            return
        self._key, self.graph = key, None  # other counts: the graph's sizes no longer apply
        self.changes += 1
        if self.changes > self.max_changes and self.captures == 0:
            self.given_up = (
                f"the batch counts changed at {self.changes} of the eligible steps (ragged bags), and they cannot be "
                f"padded: {self.padding_refused}"
            )
        elif self.captures >= self.max_changes:
            self.given_up = f"captured {self.captures} times for changing counts: the counts do not settle"

    def _eligible(self, counts: BatchCounts) -> bool:
        """Whether a step with `counts` may run the graph at all (`ready`'s first conditions)."""
        if self.given_up is not None or not torch.is_grad_enabled() or counts.bad_ranks:
            return False
        return len(set(counts.batch_sizes)) == 1 and counts.batch_sizes[0] == self.dense_step.batch_size

    # ---- the step ----------------------------------------------------------------------------------------------
    def run(self, batch, counts: BatchCounts) -> StepOutput:
        """The step on `batch` (this rank's, on the device) with every update done; `counts` are the ones `ready`
        accepted. Replays the graph, or (first call for these counts, or a dense learning rate that the captured
        step holds has changed since) runs the step eagerly and captures it."""
        if self.graph is not None and self.dense_step.rates_changed(self._captured_lrs):
            self.graph = None  # a changed rate the captured step holds: warm up and capture again
        if self.capacity is not None:
            batch, counts = self._padded(batch, counts)
        inputs = _inputs_of(batch)
        if self._counts is None or not _same_shapes(self._inputs, inputs):
            self._make_static(batch)
        self._counts = counts
        torch._foreach_copy_(self._inputs, inputs)
        self.dense_step.before_update()
        if self.capture and self.graph is not None:
            self.graph.replay()
            comm.graph_launched()
            self.replays += 1
            loss, logits_B = self._graph_outputs
        elif self.capture:
            loss, logits_B = self._warm_up_and_capture()
        else:  # the eager steps between may have dropped the dense gradients (zero_grad): the optimizer reads these
            self.dense_step.make_grads(self._labels_B.device)
            loss, logits_B = self._body()
        self.dense_step.after_update()
        return StepOutput(loss.clone(), logits_B.clone(), batch.labels, updated=True)

    def _body(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self.model.ebc.weighing_every_id() if self.capacity is not None else nullcontext():
            return self._step()

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        model, ebc = self.model, self.model.ebc
        ebc.prefetch(self._batch.sparse, counts=self._counts)  # the id exchange, sized from the counts
        ebc.lookup_outputs = []  # the lookups' outputs, where the backward's second part starts
        try:
            sparse_BS = model.kind.sparse_input(model, self._batch)  # lookups, pooled exchange, regroup
            looked_up = [t for t in ebc.lookup_outputs if t.requires_grad]
        finally:
            ebc.lookup_outputs = None
        loss, logits_B, grad_BS = self.dense_step.forward_backward(self._dense_BN, sparse_BS, self._labels_B)
        # The embeddings' backward in two parts: (1) the regroup's and the pooled exchange's backward, to the lookups'
        # outputs (the pooled gradients' all-to-all); (2) the lookups' backward with the fused sparse update. With a
        # side stream, the dense gradients' all-reduce starts there after part (1), so that it shares the link with
        # nothing and runs beside the lookups' backward, and the dense optimizer's step follows part (2) on the compute
        # stream (beside the backward's kernels it would hold the SMs they wait for). Both parts end at tensors of
        # this step (the lookups' outputs, then the graph's leaves), without running the leaves' AccumulateGrad nodes:
        # a node made by an earlier eager step (kept alive by that step's loss, which the caller may hold) belongs to
        # that step's stream, and the engine would make the capture wait on it.
        leaves = leaves_of(sparse_BS)
        if {id(t) for t in leaves_of(*looked_up)} != {id(t) for t in leaves}:
            looked_up = []  # a leaf the lookups' outputs do not reach: the backward in one part
        two_parts = bool(looked_up and leaves)
        pooled_grads: list = []
        if two_parts:
            grads = torch.autograd.grad(sparse_BS, looked_up, grad_BS, allow_unused=True)
            pooled_grads = [(t, g) for t, g in zip(looked_up, grads) if g is not None]
        side = self._side
        if side is not None:  # a fork here and a join before the optimizer's step, in the graph
            current = torch.cuda.current_stream(side.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self.dense_step.reduce()
        self.backward_parts = 2 if two_parts else 1
        if pooled_grads:
            outs, grads = zip(*pooled_grads)
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        elif leaves and not two_parts:  # no lookup outputs to stop at (or a leaf they do not reach): in one part
            torch.autograd.grad(sparse_BS, leaves, grad_BS, allow_unused=True)
        if side is not None:
            current.wait_stream(side)
            self.dense_step.update()
        else:
            self.dense_step.reduce_and_update()
        return loss, logits_B

    def _warm_up_and_capture(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step, eagerly, on the capture stream (lazy initialisations of that stream happen here: cuBLAS
        workspaces, the lookups' constants), then the capture of the same step for the steps that follow (the
        capture computes nothing). Returns this step's loss and logits."""
        device = self._labels_B.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self.dense_step.make_grads(device)
        outputs, graph, self._graph_outputs = warm_up_and_capture(
            self._body, device, stream=self._stream, around=self._capturing
        )
        self.graph, self.captures = graph, self.captures + 1
        return outputs

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        """Around the capture: the dense optimizer's step capturable (whose learning rates the graph then holds); a
        failure gives the graph up and raises naming the settings that avoid it."""
        try:
            with self.dense_step.optimizer_captured() as self._captured_lrs:
                yield
        except Exception as e:
            self.given_up = f"capturing the whole step failed ({type(e).__name__}: {e})"
            raise RuntimeError(
                f"training.cuda_graph: {self.given_up}; set training.graph_scope dense (or cuda_graph false)"
            ) from e

    def _padded(self, batch, counts: BatchCounts):
        """`batch` padded to the capacity (embshard/collection/padding.py), and the counts of such a batch on every rank, which
        size the captured exchanges."""
        from embshard.data.common import Batch

        sparse, full = self._padder.pad(batch.sparse, counts, self.capacity)
        return Batch(batch.dense, sparse, batch.labels, batch.position), full

    def _make_static(self, batch) -> None:
        """Device buffers the graph reads its batch from, and a batch made of them."""
        from embshard.data.common import Batch

        self._dense_BN, self._labels_B = batch.dense.clone(), batch.labels.clone()
        self._batch = Batch(self._dense_BN, static_kjt(batch.sparse), self._labels_B)
        self._inputs = _inputs_of(self._batch)
        self.graph = None

    def reset(self) -> None:
        """Forget the captured graph (after the optimizers' state tensors were replaced, e.g. a checkpoint's load):
        the next steps with repeating counts warm up and capture again."""
        self.graph, self._key, self.capacity = None, None, None

    def close(self) -> None:
        """Release the captured graph after the device finished its work; call it before
        `dist.destroy_process_group()` (a live graph holding NCCL collectives hangs the teardown)."""
        if self.graph is not None:
            torch.cuda.synchronize(self._labels_B.device)
        self.reset()


def _inputs_of(batch) -> list[torch.Tensor]:
    kjt = batch.sparse
    weights = kjt.weights_or_none()
    return [batch.dense, kjt.values(), kjt.lengths(), batch.labels] + ([weights] if weights is not None else [])


def _same_shapes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
