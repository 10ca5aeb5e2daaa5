"""Timing helpers shared by the benchmark scripts: wall time of synchronized steps, interleaved runs of several
kinds (A B A B ...), CUDA-event timing, median and spread, and the `RESULT key=value ...` line bench/report.py
reads."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping


def timed_ms(step: Callable[[int], None], steps: int, sync: Callable[[], None]) -> float:
    """Wall milliseconds per step of `step(0)` ... `step(steps - 1)`, synchronized (`sync`) before and after."""
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def host_bound(step: Callable[[int], None], n: int, sync: Callable[[], None]) -> tuple[float, float] | None:
    """(median ms the host takes to launch one step, median ms until it has run), over `n` steps each started
    on an idle GPU (synchronized before); None when n is 0."""
    if n <= 0:
        return None
    launch, whole = [], []
    for i in range(n):
        sync()
        t0 = time.perf_counter()
        step(i)
        launch.append((time.perf_counter() - t0) * 1e3)
        sync()
        whole.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(launch), statistics.median(whole)


def interleaved_ms(
    kinds: Iterable[str],
    rounds: int,
    steps: int,
    step: Callable[[str, int], None],
    sync: Callable[[], None],
    before: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """`timed_ms` of every kind in turn, `rounds` times (A B A B ...; `before` ahead of each run, e.g. a barrier):
    each kind's ms/step per round."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in times:
            before()
            times[kind].append(timed_ms(lambda i, kind=kind: step(kind, i), steps, sync))
    return times


def event_ms(fn: Callable[[], object], warmup: int, reps: int, device) -> float:
    """Median milliseconds of fn() over `reps` runs after `warmup` runs: CUDA events on a GPU, wall time on the
    CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type != "cuda":
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of `values` (at least one)."""
    vals = list(values)
    if not vals:
        raise ValueError("median_spread of no values: time at least one run")
    return statistics.median(vals), min(vals), max(vals)


def result_line(fields: Mapping[str, object] | Iterable[str]) -> str:
    """`RESULT k=v ...` from a mapping, or from already formatted `k=v` parts (bench/report.py reads the line)."""
    parts = [f"{k}={v}" for k, v in fields.items()] if isinstance(fields, Mapping) else list(fields)
    return "RESULT " + " ".join(parts)
