"""What every suite shares: the machine the runner found, a command (Step), a suite (Suite), and the pieces of
commands and summaries several suites use."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parents[2]
E2E_CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
CKPT_DIR = "/tmp/embshard_ckpt_bench"
LOADER_DIR = "/tmp/embshard_loader"
TOPOLOGY_FILE = "/tmp/embshard_topology.yaml"
INTEROP_DIR = "/tmp/embshard_interop"
PYTEST_LINE = r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$"  # pytest's last line


@dataclass
class Machine:
    """What the runner found (or, for --dry-run, assumes): GPUs, their memory, host CPUs."""

    gpus: int = 0
    gpu: str = ""
    gpu_mib: int = 0
    cpus: int = 1

    @property
    def gpu_gib(self) -> int:
        """The card's memory, whole GiB (what TorchRec's planner is given as --hbm-gib)."""
        return int(self.gpu_mib / 1024)


@dataclass
class Step:
    """One command of a suite."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0
    needs_gpus: int = 0
    """GPUs the step needs (skipped with a note when the machine has fewer; 0: runs anywhere)."""
    epilogue: Callable[[], str] | None = None
    """Text written into the log after the command ends, stopped at its time limit or not."""
    exit_after_result_s: float = 0.0
    """If > 0: the command prints its RESULT line last, and is stopped if it has not exited this many seconds after
    it (a process hung in its teardown keeps its result but does not hold the suite's time)."""


@dataclass(frozen=True)
class Suite:
    """A named suite: what it measures, how it is run, the GPUs it needs and how long it typically takes (the
    columns of bench/README.md's table), its commands and its summary rows."""

    name: str
    what: str
    command: str
    gpus: str
    typical: str
    steps: Callable[[argparse.Namespace, Machine], list[Step]]
    summary: Callable[[str, argparse.Namespace], list[tuple[str, str]]]


def py() -> list[str]:
    return [sys.executable]


def pytest(*args: str) -> list[str]:
    """This Python's pytest, quiet, without its cache folder, on `args`."""
    return py() + ["-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]


def cuda_env(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.cpu else {"EMBSHARD_TEST_DEVICE": "cuda"}


def nproc(args: argparse.Namespace, m: Machine) -> int:
    return args.nproc or (2 if args.cpu else max(1, min(m.gpus, 2)))


def results(log: str, bench: str | None = None) -> list[dict[str, str]]:
    """The RESULT lines of a suite's log as dicts; with `bench`, only that benchmark's (its `bench=` field)."""
    found = [r for r in (report.parse_line(x) for x in log.splitlines()) if r is not None]
    return found if bench is None else [r for r in found if r.get("bench") == bench]


def bandwidth_step(args: argparse.Namespace) -> list[Step]:
    """`embshard calibrate` without the kernel fits: the bandwidths the physical floors divide by."""
    if args.cpu or args.no_bandwidth:
        return []
    argv = py() + ["-m", "embshard.cli", "calibrate", "--out", TOPOLOGY_FILE, "--iters", "5", "--no-kernels"]
    return [Step("bandwidth (embshard calibrate)", argv, timeout=150, needs_gpus=1)]


def last_match(log: str, pattern: str) -> str:
    found = re.findall(pattern, log, re.M)
    return found[-1] if found else ""


def step_blocks(log: str) -> list[tuple[str, str]]:
    """(step label, its output) for each command of a suite's log."""
    parts = re.split(r"^\+ \[\S+ \d+/\d+\] (.*?): .*$", log, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))
