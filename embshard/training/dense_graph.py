"""The dense part's whole training step as one CUDA graph (YAML `training.cuda_graph`).

A bf16 step of a DLRM-class model is bound by the host: the dense part's forward, loss, backward, the gradient
all-reduce and the optimizer are a few hundred small launches, each with its Python and dispatcher cost, while the GPU
work behind them takes a few milliseconds. Here they are captured once, for the training batch size, and each step
replays them with one launch:

    static inputs   dense features [B, N], pooled embeddings [B, S] (a leaf that requires grad), labels [B]
    graph           forward and BCE loss (under bf16 autocast if asked), the gradients (torch.autograd.grad)
                    copied into one flat buffer, one all-reduce of it (summed, then divided by the world size:
                    DDP's average), the optimizer's step (`graph_optimizer_step`)
    outputs         the loss, the logits, the pooled embeddings' gradient

`run` returns a loss whose backward hands the captured gradient of the pooled embeddings to the embeddings'
backward (the exchange's and the fused sparse optimizer's, eager as before). The dense update has then already
happened: the pipeline only calls `loss.backward()` (`StepOutput.dense_updated`).

Which steps use it: the pipeline asks for it only when every rank's batch has the training batch size (the
ranks' agreed counts), so every rank replays (and so all-reduces) together; other steps (the last partial batch,
empty batches, evaluation) run the eager path with DistributedDataParallel. The first eligible step runs eagerly too
(optimizer state, cuBLAS handles, compiled kernels come into being), the second captures. The captured kernels
read and write fixed addresses: the parameters, the optimizer's state tensors and the gradient buffer, which the
eager path leaves in place (it reads the parameters and updates the same state tensors), so both paths can follow
each other in any order. Loading a checkpoint replaces optimizer state tensors: load before training (as
`embshard train` does), or call `reset()`. A learning rate changed between steps applies at the next step
(`GraphOptimizer`: a device tensor the graph reads, or a new capture where the captured step holds the rate).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from embshard.runtime import comm
from embshard.runtime.graphs import warm_up_and_capture

__all__ = ["DenseGraphStep", "GraphOptimizer", "graph_optimizer_step", "model_refusal"]


def model_refusal(kind: str, sparse_input: Callable | None, catalog: bool) -> str | None:
    """Why a model of kind `kind` (its ModelKind's `sparse_input`; `catalog`: it has a retrieval catalog) has no
    dense step a CUDA graph can hold, or None if it has: the graph takes the dense step's inputs from
    ModelKind.sparse_input, and a retrieval catalog's step runs its own exchange (not a DLRM step)."""
    if catalog:
        return "a retrieval catalog's step runs its own exchange (not a DLRM step)"
    if sparse_input is None:
        return f"model kind {kind!r} does not give its dense step's inputs (ModelKind.sparse_input)"
    return None


@dataclass
class GraphOptimizer:
    """The dense optimizer's step as the graph captures it (`graph_optimizer_step`)."""

    step: Callable[[], None]
    """The update, captured into the graph."""
    before: Callable[[], None] | None = None
    """Host work before each replay: the learning rates, kept in device tensors the graph reads."""
    after: Callable[[], None] | None = None
    """Host work after each replay: the step counters torch keeps on the host."""
    lr_in_graph: bool = False
    """The captured step holds the learning rates as constants: a changed rate needs a new capture."""
    warm_up: Callable[[], None] | None = None
    """Compiles the step (where it is compiled) on copies of the tensors it updates: a step's first call, outside a
    capture, without updating anything."""


def _adagrad_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    sums: list[torch.Tensor],
    minus_lr: torch.Tensor,
    eps: float,
    weight_decay: float,
) -> None:
    """One group's Adagrad arithmetic, written out as torch's foreach Adagrad does it (in place on `params` and
    `sums`; `grads` unchanged)."""
    if weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_addcmul_(sums, grads, grads, value=1)
    std = torch._foreach_sqrt(sums)
    torch._foreach_add_(std, eps)
    numerator = torch._foreach_mul(grads, minus_lr)
    torch._foreach_addcdiv_(params, numerator, std)


def _copy_as(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that a compiled function's guards take for `x`: same type, shape, strides, dtype, device and
    requires_grad."""
    c = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x.detach())
    return nn.Parameter(c, requires_grad=x.requires_grad) if isinstance(x, nn.Parameter) else c


def graph_optimizer_step(optimizer: torch.optim.Optimizer, compile: str | None = None) -> GraphOptimizer | str:
    """The step of `optimizer` that a graph can capture, or a string saying why there is none. torch's fused
    optimizers keep their step counters on the device: their own step is captured (with its learning rates as
    constants). Adagrad without a fused kernel in this torch (and without lr_decay, whose rate depends on the step
    count on the host): its foreach arithmetic, written out as torch's Adagrad does it, on its own state tensors,
    with each group's learning rate in a device tensor (`before` refreshes it from the param group, so a changed
    rate applies at the next replay), and its step counters (host tensors) advanced by one foreach add after each
    replay. `compile` (a torch.compile mode, as the dense step's): the arithmetic compiled, which fuses its five
    passes over every parameter into one kernel per group of tensors (`warm_up` compiles it on copies)."""
    groups = optimizer.param_groups
    if all(g.get("fused") for g in groups):
        return GraphOptimizer(optimizer.step, lr_in_graph=True)
    if not isinstance(optimizer, torch.optim.Adagrad):
        return f"the dense optimizer ({type(optimizer).__name__}) has no fused implementation in this torch"
    if any(g["lr_decay"] or g["maximize"] or g["differentiable"] or isinstance(g["lr"], torch.Tensor) for g in groups):
        return "Adagrad with lr_decay, maximize, differentiable or a tensor learning rate has no capturable step here"
    device = groups[0]["params"][0].device
    minus_lr = [torch.tensor(-float(g["lr"]), device=device) for g in groups]  # what the graph reads
    lrs = [float(g["lr"]) for g in groups]  # the rates in `minus_lr` now
    update = torch.compile(_adagrad_update, mode=compile, dynamic=False) if compile else _adagrad_update
    # The groups and the state are looked up at each call: a checkpoint's load replaces both (load_state_dict),
    # and a graph captured after it holds the loaded state tensors.

    def lists(g: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        params = list(g["params"])
        return params, [p.grad for p in params], [optimizer.state[p]["sum"] for p in params]

    @torch.no_grad()
    def step() -> None:
        for g, m_lr in zip(optimizer.param_groups, minus_lr):
            update(*lists(g), m_lr, g["eps"], g["weight_decay"])

    @torch.no_grad()
    def warm_up() -> None:  # the compiled update's first call, on copies (nothing is updated)
        for g, m_lr in zip(optimizer.param_groups, minus_lr):
            params, grads, sums = lists(g)
            if any(x is None for x in grads):
                continue  # no gradients yet: compiled at the step's first call
            # the copies as dynamo's guards see the tensors: the same types (parameters), requires_grad and strides
            copies = [[_copy_as(x) for x in xs] for xs in (params, grads, sums)]
            update(*copies, m_lr.clone(), g["eps"], g["weight_decay"])

    def before() -> None:  # a copy only when a rate changed
        for i, g in enumerate(optimizer.param_groups):
            if float(g["lr"]) != lrs[i]:
                lrs[i] = float(g["lr"])
                minus_lr[i].fill_(-lrs[i])

    def after() -> None:  # the counters as they are now (a checkpoint's load may have replaced them)
        state = optimizer.state
        torch._foreach_add_([state[p]["step"] for g in optimizer.param_groups for p in g["params"]], 1)

    return GraphOptimizer(step, before, after, warm_up=warm_up if compile else None)


class _CapturedLoss(torch.autograd.Function):
    """The loss of a replayed step: its backward is the captured gradient of the pooled embeddings."""

    @staticmethod
    def forward(ctx, sparse_BS: torch.Tensor, loss: torch.Tensor, grad_BS: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(grad_BS)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        (grad_BS,) = ctx.saved_tensors
        return grad_BS * grad_loss.to(grad_BS.dtype), None, None


class DenseGraphStep:
    """One CUDA graph of the dense part's training step for batches of `batch_size` samples.

    Args:
        dense: the dense module, without its DistributedDataParallel wrapper: `dense(dense_BN, sparse_BS)` -> logits
            `[B]`, scored by binary cross-entropy (the DLRM kinds).
        optimizer: the dense parameters' torch optimizer, stepped inside the graph (`graph_optimizer_step`; one
            without a capturable step raises ValueError with the reason).
        batch_size: the samples per rank of the steps that replay.
        autocast_bf16: the forward and loss under bf16 autocast (training.precision bf16).
        group: the process group the gradients are averaged over (None: the default group; one process: none).
        capture: False runs the same step without a graph, each call (on any device: a check of the step's
            arithmetic against the eager one where CUDA graphs do not exist).
        compile: a torch.compile mode without CUDA graphs of its own ("default", "max-autotune-no-cudagraphs") for
            the forward and loss (and so their backward), whose kernels the graph then holds; None: eager kernels.
    """

    def __init__(
        self,
        dense: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch_size: int,
        autocast_bf16: bool,
        group: dist.ProcessGroup | None = None,
        capture: bool = True,
        compile: str | None = None,
    ) -> None:
        if compile not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(
                f"compile mode {compile!r} cannot be held by the step's CUDA graph: use default or "
                "max-autotune-no-cudagraphs (reduce-overhead makes CUDA graphs of its own)"
            )
        self.dense, self.optimizer, self.batch_size = dense, optimizer, batch_size
        self._forward_loss = (
            torch.compile(self._eager_forward_loss, mode=compile, dynamic=False)
            if compile
            else self._eager_forward_loss
        )
        self.autocast_bf16, self.group = autocast_bf16, group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.names, self.params = zip(*[(n, p) for n, p in dense.named_parameters() if p.requires_grad])
        opt = graph_optimizer_step(optimizer, compile)
        if isinstance(opt, str):
            raise ValueError(opt)
        self._opt = opt
        self._captured_lrs: list[float] = []  # the learning rates a captured fused step holds
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static = False  # the static buffers exist
        self._grads: torch.Tensor | None = None  # the gradients' flat buffer (`make_grads`)
        self.eligible_steps = 0  # steps offered so far: the first runs eagerly
        self.replays = 0

    def reset(self) -> None:
        """Forget the captured graph (after the optimizer's state tensors were replaced): the next eligible step
        runs eagerly, the one after captures again."""
        self.graph, self.eligible_steps, self._static = None, 0, False

    def close(self) -> None:
        """Release the captured graph, after the device finished its work. Call it before
        `dist.destroy_process_group()`: a live graph that holds an NCCL collective makes the process group's teardown
        hang (pytorch/pytorch#115388). Training may go on afterwards: the next eligible step captures again."""
        if self.graph is not None:
            torch.cuda.synchronize(self._sparse_BS.device)
        self.reset()

    def ready(self, batch_size: int) -> bool:
        """Whether this step (every rank's batch has `batch_size` samples, as agreed) replays the graph; the
        first eligible step returns False (it runs eagerly) and counts itself."""
        if batch_size != self.batch_size or not torch.is_grad_enabled():
            return False
        if self.graph is not None and self.rates_changed(self._captured_lrs):
            self.reset()  # a changed learning rate: this step runs eagerly, the next eligible one captures again
        self.eligible_steps += 1
        return self.eligible_steps > 1

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def run(self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor, labels_B: torch.Tensor):
        """The step: (loss with the embeddings' backward attached, logits `[B]`). Captures at the first call."""
        if not self._static:
            self._make_static(dense_BN, sparse_BS, labels_B)
        if self.capture and self.graph is None:
            self._capture()
        with torch.no_grad():  # into the static inputs (one of them a leaf that requires grad)
            self._dense_BN.copy_(dense_BN)
            self._sparse_BS.copy_(sparse_BS.detach())
            self._labels_B.copy_(labels_B)
        self.before_update()
        if self.capture:
            self.graph.replay()
            comm.graph_launched([self.group])
        else:  # the eager steps between may have dropped the gradients (zero_grad): the optimizer reads these
            for p, grad in zip(self.params, self._grad_views):
                p.grad = grad
            self._body()
        self.after_update()
        self.replays += 1
        loss = _CapturedLoss.apply(sparse_BS, self._loss, self._sparse_grad)
        return loss, self._logits_B.detach().clone()

    # ---- capture ---------------------------------------------------------------------------------------------
    def forward_backward(
        self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor, labels_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward, loss and gradients of one batch: (loss, logits `[B]`, gradient of `sparse_BS`), the parameters'
        gradients written into the flat buffer that `p.grad` views (`make_grads` first). The forward reads the
        parameters through leaves of their own (detached aliases of the same memory, `torch.func.functional_call`),
        and the gradients come from `torch.autograd.grad`: the parameters' own AccumulateGrad nodes belong to the
        stream the eager steps ran on (DistributedDataParallel keeps them), which a capture on its own stream must
        not wait on. Nothing of the dense part's autograd graph is kept (its nodes would carry the warm-up's stream
        into the capture); `sparse_BS` is read through a leaf of its own, so the embeddings' graph behind it is left
        as it is (the caller runs its backward with the returned gradient)."""
        sparse_leaf = sparse_BS.detach().requires_grad_(True)
        loss, logits_B = self._forward_loss(self._leaves, dense_BN, sparse_leaf, labels_B)
        inputs = [*self._leaves.values(), sparse_leaf]
        *grads, grad_BS = torch.autograd.grad(loss, inputs, materialize_grads=True)  # unused: zeros
        torch._foreach_copy_(self._grad_views, grads)
        return loss.detach(), logits_B.detach(), grad_BS

    def _eager_forward_loss(
        self, leaves: dict[str, torch.Tensor], dense_BN: torch.Tensor, sparse_BS: torch.Tensor, labels_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits `[B]`) of the dense part read through `leaves` (compiled when the step is)."""
        # no autocast cache under capture (torch's advice for graphs): the casts are captured kernels either way
        ctx = torch.autocast(
            sparse_BS.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16, cache_enabled=False
        )
        with ctx:
            logits_B = torch.func.functional_call(self.dense, leaves, (dense_BN, sparse_BS))
            loss = nn.functional.binary_cross_entropy_with_logits(logits_B, labels_B)
        return loss, logits_B

    def reduce_and_update(self) -> None:
        """The gradients' average over the ranks (`reduce`) and the optimizer's step (`update`)."""
        self.reduce()
        self.update()

    def reduce(self) -> None:
        """The gradients' average over the ranks: one all-reduce of the flat buffer (under a capture, the graph's)."""
        if self.world > 1:
            comm.wait_for_graphs(self.group)  # no-op under a capture
            dist.all_reduce(self._grads, group=self.group)
            self._grads.div_(self.world)

    def update(self) -> None:
        """The dense optimizer's step on the averaged gradients."""
        self._opt.step()

    def before_update(self) -> None:
        """Host work before a step that holds `update` (a replay, or the step run without a graph): the learning
        rates copied into the device tensors the captured update reads, where they changed."""
        if self._opt.before is not None:
            self._opt.before()

    def after_update(self) -> None:
        """Host work after a step that held `update`: the step counters torch keeps on the host, advanced."""
        if self._opt.after is not None:
            self._opt.after()

    def _body(self) -> None:
        """What the graph holds: forward, loss, gradients, their average over the ranks, the optimizer's step."""
        self._loss, self._logits_B, self._sparse_grad = self.forward_backward(
            self._dense_BN, self._sparse_BS, self._labels_B
        )
        self.reduce_and_update()

    def _make_static(self, dense_BN: torch.Tensor, sparse_BS: torch.Tensor, labels_B: torch.Tensor) -> None:
        self._dense_BN = dense_BN.detach().clone()
        self._sparse_BS = sparse_BS.detach().clone()
        self._labels_B = labels_B.detach().clone()
        self.make_grads(sparse_BS.device)
        self._static = True

    def make_grads(self, device: torch.device) -> None:
        """The parameters' leaves and their gradients' flat buffer, which `p.grad` views (once: the graphs that
        hold this step, the dense one and a whole step's, write the same buffer)."""
        if self._grads is not None:
            for p, grad in zip(self.params, self._grad_views):
                p.grad = grad
            return
        self._leaves = {n: p.detach().requires_grad_(True) for n, p in zip(self.names, self.params)}
        # every gradient a view of one flat buffer, which one all-reduce averages over the ranks
        numel = sum(p.numel() for p in self.params)
        self._grads = torch.zeros(numel, dtype=self.params[0].dtype, device=device)
        offset, self._grad_views = 0, []
        for p in self.params:
            self._grad_views.append(self._grads[offset : offset + p.numel()].view_as(p))
            p.grad = self._grad_views[-1]  # what the optimizer's step reads (under capture: these addresses)
            offset += p.numel()

    def _capture(self) -> None:
        """The warm-up (forward and gradients, no update; the compiled optimizer's first call on copies) on a side
        stream, then the capture of the whole step (`_body`)."""

        def warm() -> None:
            self.forward_backward(self._dense_BN, self._sparse_BS, self._labels_B)
            if self._opt.warm_up is not None:
                self._opt.warm_up()

        _, self.graph, _ = warm_up_and_capture(self._body, self._sparse_BS.device, warm=warm, around=self._capturing)

    @contextmanager
    def _capturing(self) -> Iterator[None]:
        """Around the capture: the optimizer's step capturable (`optimizer_captured`, whose learning rates the
        graph then holds); a failure raises naming the setting that turns the graph off (no graph is kept)."""
        try:
            with self.optimizer_captured() as self._captured_lrs:
                yield
        except Exception as e:
            raise RuntimeError(
                f"training.cuda_graph: capturing the dense step failed ({type(e).__name__}: {e}); set "
                "training.cuda_graph false to train without it"
            ) from e

    @contextmanager
    def optimizer_captured(self) -> Iterator[list[float]]:
        """Around a capture that holds the optimizer's step; gives the learning rates the capture holds (compare
        them with `rates_changed`). torch's optimizers with a `capturable` flag check it under capture; their fused
        step is the same kernel either way (device-side step counters), so the flag is set for the capture only."""
        flags = [(g, g["capturable"]) for g in self.optimizer.param_groups if "capturable" in g]
        for g, _ in flags:
            g["capturable"] = True
        try:
            yield self._lrs()
        finally:
            for g, flag in flags:
                g["capturable"] = flag

    def rates_changed(self, captured: list[float]) -> bool:
        """Whether a learning rate changed since a capture that holds the rates as constants (a fused step's)."""
        return self._opt.lr_in_graph and self._lrs() != captured
