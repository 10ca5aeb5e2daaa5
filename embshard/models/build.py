"""Build a configured model: the sharded embeddings (fused optimizer) and the dense part (DistributedDataParallel),
and compute its loss on a batch. Gets only the `model:` section; what differs between model kinds (the feature
groups, a retrieval catalog, the dense part, the loss) comes from the kind's file (registry.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.registry import StepOutput, model_kind
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import LookupOptions
from embshard.spec.plan import ShardingPlan

__all__ = ["RecModel", "StepOutput"]


class RecModel(nn.Module):
    """`ebc`: ShardedEmbeddingBagCollection (its optimizer is fused into backward; `options`: its LookupOptions);
    `catalog`: a retrieval catalog serving one table in a collection of its own, or None; `dense`: the dense part,
    wrapped in DistributedDataParallel when world_size > 1 (optimize `dense_parameters()` with torch.optim). Pass
    `dense` to use a dense module built elsewhere (e.g. a TorchRec model's, embshard.interop) instead of the kind's
    `build_dense`."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_dense: int,
        plan: ShardingPlan,
        sparse_optimizer: FusedOptimizerConfig,
        device: torch.device,
        world_size: int,
        seed: int = 0,
        options: LookupOptions | None = None,
        dense: nn.Module | None = None,
    ) -> None:
        super().__init__()
        from embshard.collection.sharded import ShardedEmbeddingBagCollection

        self.cfg = cfg
        self.num_dense = num_dense
        self.kind = model_kind(cfg.kind)
        tables = list(cfg.tables)
        build_catalog = self.kind.build_catalog
        self.catalog = build_catalog(cfg, plan, sparse_optimizer, device, seed) if build_catalog else None
        if self.catalog is not None:
            tables = [t for t in tables if t.name != self.catalog.table.name]
            plan = replace(plan, tables=tuple(plan[t.name] for t in tables))
        groups = self.kind.output_groups(cfg) if self.kind.output_groups else None
        self.ebc = ShardedEmbeddingBagCollection(
            tables, plan, sparse_optimizer, output_groups=groups, device=device, seed=seed, options=options
        )
        torch.manual_seed(seed)  # identical dense initialisation on every rank
        dense = (dense if dense is not None else self.kind.build_dense(cfg, num_dense)).to(device)
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets (no copy back after each
            # all-reduce, and no second copy of the gradients' memory)
            ids = [device.index] if device.type == "cuda" else None
            dense = DistributedDataParallel(dense, device_ids=ids, gradient_as_bucket_view=True)
        self.dense = dense
        self.dense_graph = None  # a DenseGraphStep (training.cuda_graph), set by `capture_dense_step`
        self.step_graph = None  # a StepGraph (training.graph_scope step), set by `capture_whole_step`

    def capture_whole_step(self, overlap: bool = True) -> str | None:
        """Replay the whole training step as one CUDA graph where the batch counts repeat (training.graph_scope step,
        embshard/training/step_graph.py), on top of `capture_dense_step` (which must have succeeded: the other steps replay
        the dense step alone). `overlap` (training.graph_overlap): the dense gradients' all-reduce and optimizer
        step run beside the embeddings' backward, the all-reduce on a communicator of its own (made here,
        collectively: every rank calls this with the same plan). Returns None if it will, else why not."""
        from embshard.training.step_graph import StepGraph, refusal

        if self.dense_graph is None:
            return "the dense step has no graph"
        why = refusal(self)
        if why is None:
            if overlap and self.dense_graph.world > 1:  # two collectives at once need two communicators
                group = self.dense_graph.group
                self.dense_graph.group = dist.new_group(ranks=dist.get_process_group_ranks(group or dist.group.WORLD))
            self.step_graph = StepGraph(self, self.dense_graph, overlap=overlap)
        return why

    def release_graphs(self) -> None:
        """Release the captured graphs (before the process group is destroyed: a live graph holding NCCL
        collectives hangs the teardown, pytorch/pytorch#115388)."""
        for graph in (self.step_graph, self.dense_graph):
            if graph is not None:
                graph.close()

    def capture_dense_step(
        self, optimizer: torch.optim.Optimizer, batch_size: int, bf16: bool, compile: str | None = None
    ) -> str | None:
        """Replay the dense part's training step as one CUDA graph for batches of `batch_size` (training.cuda_graph,
        embshard/training/dense_graph.py), its forward and loss compiled in mode `compile` if given (training.compile).
        Returns None if it will, else why not (it then runs eagerly)."""
        from embshard.training.dense_graph import DenseGraphStep

        if self.ebc.device.type != "cuda":
            return "CUDA graphs need a CUDA GPU"
        if self.kind.sparse_input is None:
            return f"model kind {self.cfg.kind!r} does not give its dense step's inputs (ModelKind.sparse_input)"
        if self.catalog is not None:
            return "a retrieval catalog's step is not a DLRM step"
        try:
            self.dense_graph = DenseGraphStep(self.dense_module(), optimizer, batch_size, bf16, compile=compile)
        except ValueError as e:  # the optimizer has no capturable step
            return str(e)
        return None

    def compile_dense(self, mode: str, batch_size: int) -> bool:
        """Compile the dense part's forward with torch.compile (`mode`: "default", "max-autotune-no-cudagraphs" or
        "reduce-overhead", which adds CUDA graphs) for training batches of `batch_size` samples; other shapes (the
        last partial batch, evaluation) and the CPU run eagerly. Parameters and checkpoints are unchanged (only the
        forward is swapped). Returns whether it compiled (False on the CPU)."""
        if self.ebc.device.type != "cuda":
            return False
        # One graph for the whole dense part, not one per DDP bucket (torch's DDP optimizer splits it so that each
        # bucket's all-reduce starts during the backward): the dense part is small, and every graph costs its
        # launch and Python wrapper on the host, which is what bounds a bf16 step.
        torch._dynamo.config.optimize_ddp = False
        inner = self.dense_module()
        inner.forward = _CompiledForBatch(inner.forward, mode, batch_size)
        return True

    def dense_module(self) -> nn.Module:
        """The dense part without its DistributedDataParallel wrapper (for checkpoints)."""
        return getattr(self.dense, "module", self.dense)

    def dense_parameters(self) -> list[nn.Parameter]:
        return list(self.dense.parameters())

    def collections(self) -> list[nn.Module]:
        """The sharded embedding collections (the catalog's last, in catalog mode), for checkpoints."""
        return [self.ebc] + ([self.catalog.ebc] if self.catalog is not None else [])

    def step(self, batch: Batch, check_finite: bool = False, graph: bool = False) -> StepOutput:
        """Forward and loss on this rank's batch. `check_finite`: raise `guard.NonFiniteError` on every rank
        (collective) if the loss or a pooled embedding is NaN or Inf, before any update (runtime.nan_check).
        `graph`: the dense step replays its CUDA graph (every rank must pass the same; `dense_graph.ready` says
        when): the returned output's dense update is done."""
        if graph:
            loss, logits = self.dense_graph.run(batch.dense, self.kind.sparse_input(self, batch), batch.labels)
            return StepOutput(loss, logits, batch.labels, dense_updated=True)
        if not check_finite:
            return self.kind.step(self, batch)
        from embshard.runtime.guard import check_finite as check

        step, seen = self.ebc.step, []
        hook = self.ebc.register_forward_hook(lambda _m, _i, out: seen.append(out))
        try:
            out = self.kind.step(self, batch)
        finally:
            hook.remove()
        check(step, out.loss, self.ebc, seen[-1])
        return out


class _CompiledForBatch:
    """A module's forward compiled for training batches of one size; every other call runs the eager forward."""

    def __init__(self, forward, mode: str, batch_size: int) -> None:
        self._eager = forward
        self._compiled = torch.compile(forward, mode=mode, dynamic=False)
        self._batch = batch_size

    def __call__(self, first: torch.Tensor, *rest):
        if torch.is_grad_enabled() and first.shape[0] == self._batch:
            return self._compiled(first, *rest)
        return self._eager(first, *rest)
