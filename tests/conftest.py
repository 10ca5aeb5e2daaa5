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

import functools
import gc
import os
import re
import sys
from pathlib import Path

# Python's cyclic collector would walk torch's, torchrec's and the test modules' million objects again and again
# as they are imported: off until the tests are collected, then those objects are frozen out of its collections
# (pytest_collection_finish; embshard/runtime/heap.py does the same for the command line and the ranks).
gc.disable()

from embshard.runtime.heap import freeze, skip_teardown  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A pytest-xdist worker's status is not the run's (its results went to the controller before it exits), and the
    # controller waits for it: once its exit handlers (the harness's pools and fork server) ran, it ends without
    # tearing torch's modules and the tests' objects down (embshard/runtime/heap.py). Armed before the imports, so
    # that it runs after their handlers.
    skip_teardown(0)

import torch  # noqa: E402

# The suite starts dozens of Python processes (command-line runs, launchers, fork servers, pytest-xdist workers):
# each would compile embshard's ~200 modules from source again (0.4 s of CPU) where the environment asks Python not
# to write bytecode (PYTHONDONTWRITEBYTECODE). The first writes them (__pycache__/, ignored by git), the rest read.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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

sys.path.insert(0, str(Path(__file__).parent))  # the helpers (dist_harness, parity, reference, ...) for every test

from dist_harness import device_kind, run_distributed  # noqa: E402

cpu_only = pytest.mark.skipif(device_kind() != "cpu", reason="CPU-only behaviour (EMBSHARD_TEST_DEVICE=cpu)")
cuda_only = pytest.mark.skipif(
    device_kind() != "cuda" or not torch.cuda.is_available(), reason="needs EMBSHARD_TEST_DEVICE=cuda and a GPU"
)


FAILURE_CHARS = 3000  # the end of a failure's text kept in the failures file (its last lines say why)


def pytest_runtest_logreport(report) -> None:
    """EMBSHARD_TEST_TIMES=FILE: every test phase's duration appended to FILE as it ends (seconds, phase, test), and
    every failed phase's text (its last FAILURE_CHARS characters) to FILE.failures, so that a run stopped at a time
    limit still says where its time went and why a test failed (pytest's --durations and failure reports print at
    the end, pytest-xdist's too)."""
    path = os.environ.get("EMBSHARD_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: its controller writes
        return
    if report.duration >= 0.5:
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8} {report.nodeid} {report.outcome}\n")
    if report.failed:
        text = report.longreprtext
        if len(text) > FAILURE_CHARS:
            text = f"[... its first {len(text) - FAILURE_CHARS} characters left out]\n" + text[-FAILURE_CHARS:]
        kind = "FAILED" if report.when == "call" else "ERROR"  # as pytest's short summary names them
        with open(f"{path}.failures", "a") as f:
            f.write(f"{kind} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{text.rstrip()}\n\n")


def pytest_configure(config) -> None:
    # pytest-xdist registers it where it is installed; without it (plain `pytest tests`) the mark is a no-op
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's --dist loadgroup runs a group on one worker")
    # pytest-timeout's, where installed (the GPU suite's per-test limit); without it the mark is a no-op
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit for this test")


# ---- pytest-xdist, --dist loadgroup: work units of shared set-up, longest first ---------------------------------
_MODULE_FIXTURE = re.compile(r"scope\s*=\s*[\"']module[\"']")


@functools.cache
def _defines_module_fixture(module: str) -> bool:
    """Whether a test module defines a module-scoped fixture (read from its source: the controller of an xdist run
    collects nothing)."""
    path = Path(__file__).resolve().parent.parent / module
    return path.suffix == ".py" and path.exists() and bool(_MODULE_FIXTURE.search(path.read_text()))


def work_unit(nodeid: str) -> str:
    """A test's work unit under `--dist loadgroup`, the tests one worker runs together: its xdist_group where xdist
    named it (`nodeid@group`), else its module where the module defines a module-scoped fixture (often processes
    trained once for all its tests: set up once, on one worker, instead of on every worker that gets one of its
    tests), else the test alone."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's own rule (LoadGroupScheduling._split_scope)
        return nodeid.split("@")[-1]
    module = nodeid.split("::")[0]
    return module if _defines_module_fixture(module) else nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; a hook of xdist's, optional without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` hands out work_unit()s in the collection's order (pytest_collection_modifyitems sorts
    them, longest first; before xdist 3.8 the groups come first, by size). xdist's own loadgroup marks a group in
    its tests' node ids, which pytest 9.2 no longer reads (xdist 3.8 sets the old attribute): work_unit() groups by
    module too."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedSetupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return SharedSetupScheduling(config, log)


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
