"""The run sections: schedule, training (pipeline and precision), dense optimizer, checkpoint and logging; the
planner section is the planner's own (embshard.planner.policy.PlannerConfig), as its constraints and settings
are, and the lookup section is embshard.spec.options.LookupOptions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard.config.schema import FieldError
from embshard.planner.constraints import ParameterConstraints


@dataclass(frozen=True)
class ScheduleConfig:
    """How long to train and when to evaluate."""

    batch_size: int
    """Samples per rank per step (the global batch is batch_size x world size)."""
    steps: int | None = None
    """Training steps (optimizer updates); give steps or epochs, not both."""
    epochs: int | None = None
    """Passes over each rank's training rows (file sources only); give steps or epochs, not both."""
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps; 0: only after the last step."""
    eval_at_start: bool = False
    """Also evaluate once before the first step (the baseline of the untrained model)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise FieldError("batch_size", self.batch_size, "it must be a positive number of samples")
        if (self.steps is None) == (self.epochs is None):
            raise FieldError("steps", self.steps, f"give exactly one of steps and epochs (epochs={self.epochs!r})")
        if self.steps is not None and self.steps < 1:
            raise FieldError("steps", self.steps, "it must be >= 1")
        if self.epochs is not None and self.epochs < 1:
            raise FieldError("epochs", self.epochs, "it must be >= 1")
        if self.eval_every < 0:
            raise FieldError("eval_every", self.eval_every, "it must be >= 0 (0: evaluate at the end only)")


@dataclass(frozen=True)
class TrainingConfig:
    """How each training step runs: the pipeline that overlaps consecutive batches, and the dense model's precision
    (embshard/training/pipeline.py, docs/architecture.md "Training pipeline")."""

    pipeline: Literal["none", "sparse_dist", "semi_sync"] = "sparse_dist"
    """none: one batch at a time (copy, id exchange, lookup, dense model in sequence); sparse_dist: batch i+1's
    copy to the device and id exchange run while batch i trains (the same losses as none, bit for bit);
    semi_sync: also batch i+1's embedding lookup, before batch i's backward: it misses batch i's sparse update
    (one step stale, docs/architecture.md)."""
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    """Dense model arithmetic: fp32; tf32 (fp32 values, TensorFloat-32 matrix products on CUDA GPUs); bf16
    (autocast: matrix products in bfloat16, weights, gradients and optimizer in fp32). Tables: their data_type;
    pooled embeddings: lookup.output_dtype."""
    compile: Literal["auto", "none", "default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "auto"
    """torch.compile of the dense part's forward (and so its backward) for the training batch size, on CUDA GPUs:
    default fuses its elementwise work into fewer kernels; reduce-overhead also replays it as CUDA graphs; none: the
    eager forward; auto: default with training.precision bf16 on CUDA GPUs, else none (embshard/training/mode.py).
    Other batch shapes (the last partial batch, evaluation) and the CPU run eagerly. Costs a compile at the first
    step (tens of seconds). With training.cuda_graph (default or max-autotune-no-cudagraphs): the graph holds the
    compiled kernels."""
    cuda_graph: bool | Literal["auto"] = "auto"
    """Replay the dense part's whole training step (forward, loss, backward, gradient all-reduce, optimizer) as one
    CUDA graph, captured at the second step of the training batch size (embshard/training/dense_graph.py), and with
    graph_scope step the whole step where the plan allows: DLRM kinds on CUDA GPUs, with a fused dense optimizer or
    Adagrad; steps of other sizes and evaluation run eagerly, and the CPU always does. auto: on with
    training.precision bf16 on CUDA GPUs (the step mode `embshard train` prints names what it chose, and why a
    faster one was not taken), else off; false: the eager step (for debugging). With training.compile default or
    max-autotune-no-cudagraphs, the graph holds the compiled forward's and backward's kernels."""
    graph_scope: Literal["step", "dense"] = "step"
    """What training.cuda_graph captures: step, the whole step (id exchange, lookups, pooled exchange, dense step,
    embedding backward with the fused update) where the plan is table-wise, column-wise and data-parallel in HBM/UVM, for fixed
    bags as they are and for ragged bags padded to a capacity (sum pooling, sgd/adagrad/rowwise_adagrad without
    weight decay; embshard/training/step_graph.py), else the dense step alone; dense, the dense step alone. The step scope on
    GPUs sets NCCL_GRAPH_MIXING_SUPPORT=0 (unless the environment sets it): its two communicators' captured
    collectives then do not wait on each other."""
    graph_overlap: bool = True
    """With the whole step as one CUDA graph: the dense gradients' all-reduce (on an NCCL communicator of its own) runs
    beside the lookups' backward, the dense optimizer's step after it; false: both after the embeddings' backward."""
    prefetch_batches: int = 2
    """Batches the training process prepares ahead in a background thread (count): taken from the data source,
    counted on the host and pinned, ready for their copy to the device."""

    def __post_init__(self) -> None:
        if self.prefetch_batches < 1:
            raise FieldError("prefetch_batches", self.prefetch_batches, "it must be >= 1 batch")
        if self.cuda_graph is True and self.compile == "reduce-overhead":
            raise FieldError(
                "compile", self.compile,
                "reduce-overhead makes CUDA graphs of its own, which training.cuda_graph's graph cannot hold: use "
                "compile default (or max-autotune-no-cudagraphs) with cuda_graph, or cuda_graph false",
            )  # fmt: skip


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """The optimizer of the dense (data-parallel) parameters: a torch.optim optimizer."""

    kind: Literal["adam", "adagrad", "sgd"] = "adam"
    """torch.optim.Adam, torch.optim.Adagrad or torch.optim.SGD."""
    lr: float = 0.001
    """Learning rate (dimensionless step scale)."""
    weight_decay: float = 0.0
    """L2 penalty coefficient."""
    momentum: float = 0.0
    """SGD only: momentum factor in [0, 1)."""
    beta1: float = 0.9
    """Adam only: decay of the first moment, in [0, 1)."""
    beta2: float = 0.999
    """Adam only: decay of the second moment, in [0, 1)."""
    eps: float = 1e-8
    """Adam/Adagrad: added to the denominator."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise FieldError("lr", self.lr, "the learning rate must be > 0")
        if not self.weight_decay >= 0:
            raise FieldError("weight_decay", self.weight_decay, "it must be >= 0")
        for key in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise FieldError(key, getattr(self, key), "it must be in [0, 1)")
        if not self.eps > 0:
            raise FieldError("eps", self.eps, "it must be > 0")


TableConstraint = ParameterConstraints  # the planner's per-table constraints, used as they are (one dataclass)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming (docs/checkpoints.md): every rank writes its own shards of the tables with the fused
    optimizer's state, plus the dense model and optimizer, data position and RNG states; loads under any world
    size or plan."""

    dir: str | None = None
    """Folder of the checkpoints (step_<N>/ folders); unset: none are written. Must be shared by all hosts."""
    every: int = 0
    """Save every this many steps; 0: only after the last step."""
    resume_from: str | None = None
    """Checkpoint folder to load before training, or 'latest' for the newest complete one in dir. Unset, a run
    refuses to start where dir already holds checkpoints (of an earlier run) unless overwrite is true."""
    overwrite: bool = False
    """Start afresh where dir already holds checkpoints: they are deleted as the run starts. false: such a run
    refuses to start (go on from them with resume_from=latest, or pick another dir)."""
    keep_last: int = 3
    """Keep this many newest complete checkpoints in dir (older ones are deleted after a save); 0: keep all."""
    async_save: bool = True
    """Write in the background: training waits only for the copy to host memory (one copy of the rank's shards)."""
    chunk_mib: float = 64.0
    """Largest piece of a table copied, written or read at once (MiB): bounds host memory of loads and sync saves."""
    io_threads: int = 2
    """Threads writing each rank's files."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise FieldError("every", self.every, "it must be >= 0 (0: save after the last step only)")
        if self.keep_last < 0:
            raise FieldError("keep_last", self.keep_last, "it must be >= 0 (0: keep every checkpoint)")
        if not self.chunk_mib > 0:
            raise FieldError("chunk_mib", self.chunk_mib, "it must be > 0 MiB")
        if self.io_threads < 1:
            raise FieldError("io_threads", self.io_threads, "it must be >= 1")
        if self.resume_from == "latest" and not self.dir:
            raise FieldError("resume_from", self.resume_from, "'latest' looks in checkpoint.dir: set dir too")
        if self.overwrite and self.resume_from:
            raise FieldError(
                "overwrite", self.overwrite,
                f"overwrite starts afresh, deleting the checkpoints that resume_from={self.resume_from!r} goes on "
                "from: give one of them",
            )  # fmt: skip
        if self.overwrite and not self.dir:
            raise FieldError("overwrite", self.overwrite, "it replaces the checkpoints in checkpoint.dir: set dir too")


@dataclass(frozen=True)
class LoggingConfig:
    """Console, progress bar, TensorBoard and metrics-file output (rank 0 writes)."""

    log_every: int = 50
    """Print the mean training loss (over ranks and steps) every this many steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar with samples/s on rank 0."""
    tensorboard_dir: str | None = "runs/embshard"
    """TensorBoard event-file folder; unset (null): no event files."""
    metrics_file: str | None = None
    """Append one JSON line per evaluation ({step, loss, auc, samples}) to this file; unset: none."""

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise FieldError("log_every", self.log_every, "it must be >= 1 step")
