"""The CUDA graphs and the compiled dense forward of a RecModel's training step, owned by the training loop.

`build_model` (train.py) makes them from the `training:` settings and hands them to the pipeline
(`TrainPipeline(graphs=...)`), which asks them which steps replay; the model itself only computes its forward and
loss (embshard/models/build.py):

    ModelGraphs.capture_dense_step   the dense part's step as one CUDA graph (training.cuda_graph; dense_graph.py)
    ModelGraphs.capture_whole_step   the whole step as one CUDA graph (training.graph_scope step; step_graph.py)
    ModelGraphs.dense_step           a step that replays the dense graph (the embeddings' backward is left)
    ModelGraphs.summary              how many steps replayed each graph (printed at the end of `embshard train`)
    ModelGraphs.release              the graphs released, before the process group is destroyed
    compile_dense                    the dense forward compiled for the training batch size (training.compile)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from embshard.data.common import Batch
from embshard.models.registry import StepOutput
from embshard.training.dense_graph import DenseGraphStep, model_refusal
from embshard.training.step_graph import StepGraph, refusal

__all__ = ["ModelGraphs", "compile_dense"]


class ModelGraphs:
    """The CUDA graphs of `model`'s (a RecModel's) training step: `dense`, the dense step's (a DenseGraphStep, or
    None), and `whole`, the whole step's (a StepGraph, or None; only on top of `dense`: the steps that do not replay
    the whole step replay the dense step alone). Both None: every step runs eagerly."""

    def __init__(self, model) -> None:
        self.model = model
        self.dense: DenseGraphStep | None = None
        self.whole: StepGraph | None = None

    def capture_dense_step(
        self,
        optimizer: torch.optim.Optimizer,
        batch_size: int,
        bf16: bool,
        compile: str | None = None,
        alone: bool = False,
    ) -> str | None:
        """Replay the dense part's training step as one CUDA graph for batches of `batch_size` (training.cuda_graph,
        embshard/training/dense_graph.py), its forward and loss compiled in mode `compile` if given
        (training.compile). Returns None if it will, else why not (it then runs eagerly). `alone`: the dense
        step's graph is the step's only one (no `capture_whole_step`); where NCCL's graph mixing support is off
        (`init_distributed` turns it off for a job that asked for the whole-step graph, before its plan said the
        eager step is faster), its all-reduce then gets a communicator of its own (made here, collectively: every
        rank calls this in the same mode), so the embeddings' eager exchanges after a replay do not wait on the host
        for it (`comm.wait_for_graphs` waits only for replays holding the collective's communicator)."""
        model = self.model
        if model.ebc.device.type != "cuda":
            return "CUDA graphs need a CUDA GPU"
        why = model_refusal(model.cfg.kind, model.kind.sparse_input, model.catalog is not None)
        if why is not None:
            return why
        group = None  # the default group
        world = dist.get_world_size() if dist.is_initialized() else 1
        if alone and world > 1 and os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") == "0":
            group = dist.new_group(ranks=list(range(world)))  # the dense all-reduce's own communicator
        try:
            self.dense = DenseGraphStep(model.dense_module(), optimizer, batch_size, bf16, group=group, compile=compile)
        except ValueError as e:  # the optimizer has no capturable step
            return str(e)
        return None

    def capture_whole_step(self, overlap: bool = True) -> str | None:
        """Replay the whole training step as one CUDA graph where the batch counts repeat (training.graph_scope
        step, embshard/training/step_graph.py), on top of `capture_dense_step` (which must have succeeded).
        `overlap` (training.graph_overlap): the dense gradients' all-reduce and optimizer step run beside the
        embeddings' backward, the all-reduce on a communicator of its own (made here, collectively: every rank
        calls this with the same plan). Returns None if it will, else why not."""
        dense = self.dense
        if dense is None:
            return "the dense step has no graph"
        why = refusal(self.model)
        if why is None:
            if overlap and dense.world > 1:  # two collectives at once need two communicators
                ranks = dist.get_process_group_ranks(dense.group or dist.group.WORLD)
                dense.group = dist.new_group(ranks=ranks)
            self.whole = StepGraph(self.model, dense, overlap=overlap)
        return why

    def dense_step(self, batch: Batch) -> StepOutput:
        """The model's step on this rank's `batch` with the dense part's graph replayed (every rank must take it
        together: `dense.ready` says when): the returned output's dense update is done, the embeddings' backward
        is left (`loss.backward()`)."""
        if self.dense is None:
            raise ValueError("ModelGraphs.dense_step: the dense step has no graph (capture_dense_step first)")
        model = self.model
        loss, logits = self.dense.run(batch.dense, model.kind.sparse_input(model, batch), batch.labels)
        return StepOutput(loss, logits, batch.labels, dense_updated=True)

    def summary(self) -> str | None:
        """One line of how many steps replayed each graph (None: no graph), and why the whole step's graph was given
        up if it was."""
        if self.dense is None:
            return None
        text = f"CUDA graphs: {self.dense.replays} steps replayed the dense step's graph"
        whole = self.whole
        if whole is not None:
            text += f", {whole.replays} the whole step's ({whole.captures} captures)"
            if whole.given_up:
                text += f"; the whole step's graph was given up: {whole.given_up}"
        return text

    def release(self) -> None:
        """Release the captured graphs (before the process group is destroyed: a live graph holding NCCL
        collectives hangs the teardown, pytorch/pytorch#115388)."""
        for graph in (self.whole, self.dense):
            if graph is not None:
                graph.close()


def compile_dense(model, mode: str, batch_size: int) -> bool:
    """Compile `model`'s (a RecModel's) dense forward with torch.compile (`mode`: "default",
    "max-autotune-no-cudagraphs" or "reduce-overhead", which adds CUDA graphs) for training batches of `batch_size`
    samples; other shapes (the last partial batch, evaluation) and the CPU run eagerly. Parameters and checkpoints
    are unchanged (only the forward is swapped). Returns whether it compiled (False on the CPU)."""
    if model.ebc.device.type != "cuda":
        return False
    # One graph for the whole dense part, not one per DDP bucket (torch's DDP optimizer splits it so that each
    # bucket's all-reduce starts during the backward): the dense part is small, and every graph costs its
    # launch and Python wrapper on the host, which is what bounds a bf16 step.
    torch._dynamo.config.optimize_ddp = False
    inner = model.dense_module()
    inner.forward = CompiledForBatch(inner.forward, mode, batch_size)
    return True


class CompiledForBatch:
    """A module's forward compiled for training batches of one size; every other call runs the eager forward."""

    def __init__(self, forward, mode: str, batch_size: int) -> None:
        self._eager = forward
        self._compiled = torch.compile(forward, mode=mode, dynamic=False)
        self._batch = batch_size

    def __call__(self, first: torch.Tensor, *rest):
        if torch.is_grad_enabled() and first.shape[0] == self._batch:
            return self._compiled(first, *rest)
        return self._eager(first, *rest)
