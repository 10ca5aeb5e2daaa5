"""pytest's hooks for the whole suite. Tests run on the CPU (gloo, several processes) by default and on GPUs with
EMBSHARD_TEST_DEVICE=cuda (NCCL, one process per GPU); a distributed test needing more GPUs than are visible skips
itself (dist_harness.run_distributed).

Here: what the controller of a pytest-xdist run needs as well (the markers, the phases' times file, the scheduling
of work units), kept free of torch. Every process that runs tests (a worker, or pytest without workers) also loads
tests/suite_plugin.py: torch, the harness, the fixtures (`device`, `run`) and the `cpu_only` / `cuda_only` marks.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest

# The suite starts dozens of Python processes (command-line runs, launchers, fork servers, pytest-xdist workers):
# each would compile embshard's ~200 modules from source again (0.4 s of CPU) where the environment asks Python not
# to write bytecode (PYTHONDONTWRITEBYTECODE). The first writes them (__pycache__/, ignored by git), the rest read.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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


def _runs_tests(config) -> bool:
    """Whether this process runs tests: a pytest-xdist worker, or pytest without workers (not the controller of
    an xdist run, which collects nothing)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return True
    return not getattr(config.option, "numprocesses", None) or getattr(config.option, "dist", "no") == "no"


def pytest_configure(config) -> None:
    # pytest-xdist registers it where it is installed; without it (plain `pytest tests`) the mark is a no-op
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's --dist loadgroup runs a group on one worker")
    # pytest-timeout's, where installed (the GPU suite's per-test limit); without it the mark is a no-op
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit for this test")
    if _runs_tests(config):
        sys.path.insert(0, str(Path(__file__).parent))  # the helpers (dist_harness, parity, ...) for every test
        config.pluginmanager.import_plugin("suite_plugin")


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
