"""A run's schedule in steps, where it starts from a checkpoint: `run_schedule` (the step to go on from, the
step to end at, the samples already trained, the data position) and `past_schedule` (what to say when the schedule
ends at or before the checkpoint's step).

A run's step count always stands for its samples: step s of a run of W ranks x B samples has trained s x W x B
samples. A checkpoint saved under another world size (or batch size) is therefore resumed at the step of this run
that holds its samples (rounded down: at most one step's samples are trained again), and schedule.steps and
schedule.epochs end where they would have without the change: the schedule is kept in samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embshard.config import ScheduleConfig


@dataclass(frozen=True)
class RunSchedule:
    """Where a run starts and ends."""

    start: int
    """The step the run goes on from (0, the checkpoint's, or this run's step holding the checkpoint's samples)."""
    total: int
    """The step it ends at (may be below start: the schedule ended before the checkpoint, `past_schedule`)."""
    samples_done: int
    """Samples (all ranks) trained before `start`."""
    samples_per_step: int
    """Samples (all ranks) of each of this run's steps."""
    position: Any
    """The data position to go on from (a source's position, a batch count of this run's batches, or None)."""
    note: str | None = None
    """One log line where the checkpoint's steps held another number of samples than this run's."""

    @property
    def samples_total(self) -> int:
        """Samples trained when the run ends (what the progress bar counts to)."""
        return self.samples_done + max(0, self.total - self.start) * self.samples_per_step


def run_schedule(
    sched: ScheduleConfig,
    steps_per_epoch: int | None,
    world: int,
    start: int = 0,
    position: Any = None,
    saved_samples_per_step: int | None = None,
) -> RunSchedule:
    """The run's schedule on `world` ranks of sched.batch_size, resumed at the checkpoint's step `start` (0: not
    resumed), whose steps held `saved_samples_per_step` samples (None: this run's), with its data `position` (a
    step count where the world size changed)."""
    per_step = sched.batch_size * world
    saved = saved_samples_per_step or per_step
    done = start * saved
    total = sched.steps if sched.steps is not None else sched.epochs * (steps_per_epoch or 0)
    if start == 0 or saved == per_step:
        return RunSchedule(start, total, done, per_step, position if position is not None else start)
    here = done // per_step  # this run's step that holds the checkpoint's samples
    if not isinstance(position, dict):  # a batch count: this run's batches, after the samples trained
        position = here
    length = f"schedule.steps={sched.steps}" if sched.steps is not None else f"schedule.epochs={sched.epochs}"
    note = (
        f"schedule: the checkpoint's {start} steps of {saved:,} samples ({done:,} samples) are step {here} of "
        f"this run's steps of {per_step:,} ({world} ranks x {sched.batch_size}); {length} ends at step {total} "
        f"({total * per_step:,} samples); the data go on after {here * per_step:,} samples"
    )
    return RunSchedule(here, total, done, per_step, position, note)


def past_schedule(
    s: RunSchedule, sched: ScheduleConfig, steps_per_epoch: int | None, world: int, resumed: Any
) -> str | None:
    """What to say when a resumed run's schedule ends at or before its checkpoint's step (None: it does not):
    an error when it ends before (the run would train nothing and end on an earlier step than it started), a
    notice when it ends at that step (nothing left to train: the run only evaluates)."""
    start, total = s.start, s.total
    if start == 0 or start < total:
        return None
    where = f"the checkpoint is at step {start}"
    if resumed:
        where = f"checkpoint {resumed.path!r} was saved after step {resumed.step}"
        where += f" (step {start} of this run's steps)" if resumed.step != start else ""
    if sched.steps is not None:
        ends = f"schedule.steps={sched.steps}"
        fix = f"schedule.steps={start + max(start // 2, 1)}"
    else:
        ends = f"schedule.epochs={sched.epochs} x {steps_per_epoch} steps per epoch on {world} ranks"
        more = s.samples_done // max(1, (steps_per_epoch or 1) * s.samples_per_step) + 1
        fix = f"schedule.epochs={more} or more (or schedule.epochs=null schedule.steps=N with N > {start})"
    if start == total:
        return (
            f"checkpoint.resume_from: {where}, the last step of this run's schedule ({ends}): nothing left to train, "
            f"the run only evaluates. To train further: {fix}"
        )
    return (
        f"checkpoint.resume_from: {where}, but this run's schedule ends at step {total} ({ends}): it would train no "
        f"step. Fix: a schedule past step {start}, e.g. {fix}; or resume from an earlier checkpoint, or start "
        "afresh (checkpoint.resume_from=null or another checkpoint.dir)"
    )
