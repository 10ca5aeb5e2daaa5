"""embshard.runtime.heap: imports with Python's cyclic collector paused, what they made frozen out of its
collections, unfrozen at exit; runtime/preload.py, a fork server's one preload, imports the modules it is given."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import paths

from embshard.runtime.heap import PRELOAD_VAR, collector_paused


def test_the_block_runs_without_the_collector_and_what_it_made_is_frozen():
    enabled, kept = gc.isenabled(), []
    try:
        for start in (True, False):
            (gc.enable if start else gc.disable)()
            before = gc.get_freeze_count()
            with collector_paused():
                assert not gc.isenabled()
                kept.append([[i] for i in range(1000)])  # alive: a freed frozen object leaves the count
            assert gc.isenabled() is start  # as it was
            assert gc.get_freeze_count() >= before + 1000
    finally:
        (gc.enable if enabled else gc.disable)()


def _python(code: str, **env: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=paths.ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(paths.ROOT), **env})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_frozen_objects_are_unfrozen_at_exit_once():
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('at exit', gc.get_freeze_count()))\n"  # runs last (atexit is LIFO)
        "from embshard.runtime.heap import import_frozen\n"
        "import_frozen('json')\n"
        "import_frozen('csv')\n"
        "print('frozen', gc.get_freeze_count() > 0)\n"
    )
    assert _python(code).split("\n")[:2] == ["frozen True", "at exit 0"]


def test_preload_imports_the_named_modules_frozen_and_skips_the_missing():
    code = "import sys, gc\nimport embshard.runtime.preload\nprint('csv' in sys.modules, gc.get_freeze_count() > 0)\n"
    assert _python(code, **{PRELOAD_VAR: "csv,no_such_module_here"}).strip() == "True True"
