"""The suite's set-up in every process that runs tests (a pytest-xdist worker, or pytest without workers), loaded by
tests/conftest.py: torch and the harness imported with Python's collector paused, the Triton interpreter on
machines without CUDA, each worker's share of the cores, the work units' order, and the fixtures:

- `device`: the device a single-process test computes on.
- `run`: `run(fn, world_size, *args)` calls fn(rank, world_size, device, *args) on that many processes and returns
  every rank's result (dist_harness.run_distributed; on the CPU the processes of a world size are started once and
  serve every test: a test that leaves a process in a state no other test should inherit passes `fresh=True`).

A test that only makes sense on one kind of device says so with `cpu_only` / `cuda_only` (from this module).
The controller of a pytest-xdist run collects and runs nothing: it does not load this module (it would spend 2-3 s
importing torch before it starts its workers, and again tearing it down at the end)."""

from __future__ import annotations

import gc
import os

# Python's cyclic collector would walk torch's, torchrec's and the test modules' million objects again and again
# as they are imported: off until the tests are collected, then those objects are frozen out of its collections
# (pytest_collection_finish below; embshard/runtime/heap.py does the same for the command line and the ranks).
gc.disable()

from embshard.runtime.heap import freeze, skip_teardown  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A pytest-xdist worker's status is not the run's (its results went to the controller before it exits), and the
    # controller waits for it: once its exit handlers (the harness's pools and fork server) ran, it ends without
    # tearing torch's modules and the tests' objects down (embshard/runtime/heap.py). Armed before the imports, so
    # that it runs after their handlers.
    skip_teardown(0)

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Before anything imports Triton (its interpreter mode is fixed at the first import): on a machine without CUDA
    # the Triton kernels run under the interpreter in every test, whichever test files are collected, and the
    # processes the tests spawn inherit it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def worker_threads() -> int | None:
    """In a pytest-xdist worker: each worker's share of the CPU cores (at least 1), the threads its torch and the
    processes it starts compute with; elsewhere None (torch's default, every core). Workers running side by side
    with torch's default of a thread per core each oversubscribe the cores: OpenMP's threads then wait on each
    other (on 2 cores and 2 busy workers the Triton interpreter's tests took 88 s with 2 threads a worker, 50 s
    with 1)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers or not workers.isdigit():
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


if worker_threads() is not None:
    torch.set_num_threads(worker_threads())
    # the processes the tests start (command-line runs, launchers; spawn_local's ranks set their own share)
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads()))

import pytest  # noqa: E402
from conftest import work_unit  # noqa: E402
from dist_harness import device_kind, run_distributed  # noqa: E402

cpu_only = pytest.mark.skipif(device_kind() != "cpu", reason="CPU-only behaviour (EMBSHARD_TEST_DEVICE=cpu)")
cuda_only = pytest.mark.skipif(
    device_kind() != "cuda" or not torch.cuda.is_available(), reason="needs EMBSHARD_TEST_DEVICE=cuda and a GPU"
)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (parametrized module fixtures) and xdist's groups
def pytest_collection_modifyitems(config, items) -> None:
    """In a worker of `--dist loadgroup`: the work units (their tests in pytest's order) longest first by
    tests/durations_gpu.txt (on machines without CUDA tests/durations_cpu.txt), so that the slowest do not start
    near the end; ties in collection order: the same order in every worker, as xdist requires. Elsewhere the order
    stays pytest's."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "loadgroup", False)):
        return
    from durations import default_file, load, test_id

    seconds = load(default_file(cpu=device_kind() == "cpu" and not torch.cuda.is_available()))
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(work_unit(item.nodeid), []).append(item)
    weight = {key: sum(seconds.get(test_id(i.nodeid), 0.0) for i in unit) for key, unit in units.items()}
    order = sorted(units, key=lambda key: -weight[key])  # stable: ties keep the collection's order
    items[:] = [item for key in order for item in units[key]]


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


def pytest_collection_finish(session) -> None:
    """The imports are done: freeze what they made out of the collector's generations and turn it back on (unfrozen
    at exit, so that the interpreter's last collection frees them)."""
    freeze()
    gc.enable()
