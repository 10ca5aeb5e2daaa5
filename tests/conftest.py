"""Shared fixtures. Tests run on the CPU (gloo, several processes) by default and on GPUs with
EMBSHARD_TEST_DEVICE=cuda (NCCL, one process per GPU); a test that only makes sense on one kind says so with
`cpu_only` / `cuda_only`, and a distributed test needing more GPUs than are visible skips itself
(dist_harness.run_distributed).

- `device`: the device a single-process test computes on.
- `run`: `run(fn, world_size, *args)` calls fn(rank, world_size, device, *args) on that many processes and returns
  every rank's result (dist_harness.run_distributed; on the CPU the processes of a world size are started once and
  serve every test: a test that leaves a process in a state no other test should inherit passes `fresh=True`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Before anything imports Triton (its interpreter mode is fixed at the first import): on a machine without CUDA
    # the Triton kernels run under the interpreter in every test, whichever test files are collected, and the
    # processes the tests spawn inherit it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the helpers (dist_harness, parity, reference, ...) for every test

from dist_harness import device_kind, run_distributed  # noqa: E402

cpu_only = pytest.mark.skipif(device_kind() != "cpu", reason="CPU-only behaviour (EMBSHARD_TEST_DEVICE=cpu)")
cuda_only = pytest.mark.skipif(
    device_kind() != "cuda" or not torch.cuda.is_available(), reason="needs EMBSHARD_TEST_DEVICE=cuda and a GPU"
)


def pytest_runtest_logreport(report) -> None:
    """EMBSHARD_TEST_TIMES=FILE: every test phase's duration appended to FILE as it ends (seconds, phase, test), so
    that a run stopped at a time limit still says where its time went (pytest's --durations prints at the end)."""
    path = os.environ.get("EMBSHARD_TEST_TIMES")
    if path and report.duration >= 0.5 and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: its controller writes
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8} {report.nodeid} {report.outcome}\n")


@pytest.fixture
def device() -> torch.device:
    """The device of a single-process test: cuda:0 under EMBSHARD_TEST_DEVICE=cuda, else the CPU."""
    return torch.device("cuda", 0) if device_kind() == "cuda" else torch.device("cpu")


@pytest.fixture
def torch_kernels_on_cpu(monkeypatch):
    """The kernels' impl 'auto' picks what CPU training gets, the torch path (TRITON_INTERPRET, set above for the
    interpreter's tests, unset for the test). For the tests of the device's own path (tests/kernels)."""
    if device_kind() == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def run():
    """run(fn, world_size, *args, pg_timeout_s=..., fresh=...) -> every rank's result (dist_harness.run_distributed)."""
    return run_distributed
