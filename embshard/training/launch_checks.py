"""What `embshard train` checks before any rank starts (in the launching process; under torchrun in every process,
before the process group), and what a run decides at its start from its checkpoint folder:

- the process count (`check_nproc`);
- the checkpoint folder: a run never replaces the checkpoints of an earlier run unless told to
  (`checkpoint_conflict`; `checkpoint.overwrite=true` deletes them as the run starts: `clear_checkpoints`);
- a notice where the config's tables or batch are sized for GPUs and the run would take very long on a CPU
  (`cpu_notice`);
- the modules a rank imports as it runs, which the fork server that `--nproc` ranks fork from on machines without
  CUDA imports once for all of them (`RANK_MODULES`).

The data sources are opened and checked before the ranks start too (embshard.data.check_source)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from embshard.config import TrainConfig
from embshard.config.run import CheckpointConfig
from embshard.spec.tables import ConfigError

CPU_TABLE_BYTES = 128 << 20
"""Tables larger than this in total (bytes of weights) get the CPU notice."""
CPU_BATCH_SIZE = 2048
"""A batch larger than this (samples per rank and step) gets the CPU notice."""
RANK_MODULES = (
    "tqdm",
    "torchrec",
    "fbgemm_gpu",
    "embshard.checkpoint",
    "embshard.data",
    "embshard.models.build",
    "embshard.training.pipeline",
    "torchmetrics.classification",  # the evaluation's AUC (0.7 s of imports, matplotlib's among them)
    "torch.utils.tensorboard",
)
"""What a rank of `embshard train` imports as it runs, beyond embshard.training.train (spawn_local's `preload`)."""


def check_nproc(nproc: int | None) -> None:
    """--nproc N: a positive number of local processes (None: not given)."""
    if nproc is not None and nproc < 1:
        raise ConfigError(
            f"--nproc {nproc} is invalid: it is the number of local processes to start (>= 1), e.g. --nproc 2; "
            "leave it out to train in this one process"
        )


def restarted() -> bool:
    """Whether this process is a restart of a torchrun job (its earlier attempt's checkpoints are this run's)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _steps_in(folder: str) -> list[int]:
    from embshard.checkpoint.storage import checkpoints

    return [step for step, _path, committed in checkpoints(folder) if committed]


def checkpoint_conflict(ck: CheckpointConfig) -> str | None:
    """The error message of a run that would replace an earlier run's checkpoints (checkpoint.dir holds complete
    ones, and the run neither resumes nor was told to overwrite them), else None. A torchrun restart's earlier
    attempt is the same run: no conflict."""
    if not ck.dir or ck.resume_from or ck.overwrite or restarted():
        return None
    steps = _steps_in(ck.dir)
    if not steps:
        return None
    n = 2
    while Path(f"{ck.dir.rstrip('/')}_{n}").exists():
        n += 1
    shown = steps if len(steps) <= 5 else [*steps[:2], "...", *steps[-2:]]
    return (
        f"checkpoint.dir {ck.dir!r} already holds the checkpoints of an earlier run (steps "
        f"{', '.join(map(str, shown))}), which this run would replace. Fix: checkpoint.resume_from=latest to go on "
        f"from step {steps[-1]}, checkpoint.overwrite=true to start again (deleting them), or "
        f"checkpoint.dir={ck.dir.rstrip('/')}_{n} to keep them"
    )


def clear_checkpoints(ck: CheckpointConfig, log: Callable[[str], None]) -> None:
    """checkpoint.overwrite: delete the checkpoints in checkpoint.dir (complete or not) as the run starts (call on
    rank 0 only, before the run's first save; a torchrun restart keeps its earlier attempt's)."""
    if not ck.overwrite or not ck.dir or restarted():
        return
    from embshard.checkpoint.storage import checkpoints, remove

    found = checkpoints(ck.dir)
    for _step, path, _committed in found:
        remove(path)
    if found:
        log(f"checkpoint.overwrite: deleted the {len(found)} earlier checkpoint(s) in {ck.dir}")


def cpu_notice(cfg: TrainConfig, config_path: str) -> str | None:
    """A one-line notice (else None) for a run on CPUs whose tables (over CPU_TABLE_BYTES of weights) or batch
    (over CPU_BATCH_SIZE samples per rank) are sized for GPUs: the numbers, and how to scale the config down."""
    tables = list(cfg.model.tables)
    total = sum(t.num_embeddings * t.embedding_dim * t.data_type.bytes for t in tables)
    batch = cfg.schedule.batch_size
    if total <= CPU_TABLE_BYTES and batch <= CPU_BATCH_SIZE:
        return None
    i, big = max(enumerate(tables), key=lambda it: it[1].num_embeddings * it[1].embedding_dim)
    rows = sum(t.num_embeddings for t in tables)
    length = f"{cfg.schedule.steps} steps" if cfg.schedule.steps is not None else f"{cfg.schedule.epochs} epochs"
    fixes = []
    if total > CPU_TABLE_BYTES:
        fixes.append(f"model.tables[{i}].num_embeddings={max(1000, big.num_embeddings // 50)}")
    if batch > CPU_BATCH_SIZE:
        fixes.append("schedule.batch_size=64")
    return (
        f"note: {config_path} is sized for GPUs: {rows:,} table rows ({total / 2**20:,.0f} MiB; the largest, "
        f"{big.name!r}, {big.num_embeddings:,} x {big.embedding_dim}) at {batch:,} samples per rank and step for "
        f"{length}; on CPUs it trains for a long time (minutes to hours). Train on GPUs, or scale it down, e.g. "
        + " ".join(fixes)
    )
