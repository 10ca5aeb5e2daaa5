"""embshard.runtime.heap: imports with Python's cyclic collector paused, what they made frozen out of its
collections, unfrozen at exit; a process that ends without its modules' teardown (`skip_teardown`: the command line,
a fork server) runs its exit handlers, flushes its output and ends with its status; runtime/preload.py, a fork
server's one preload, imports the modules it is given."""

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


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=paths.ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(paths.ROOT), **env})  # fmt: skip


def _python(code: str, **env: str) -> str:
    res = _run(code, **env)
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


# A module-level object whose finalizer speaks at the interpreter's teardown, an exit handler registered after
# skip_teardown's (so it runs before it), output left in Python's and C's buffers (a pipe: both fully buffered).
_ENDING = (
    "import atexit, ctypes, logging, sys\n"
    "from embshard.runtime.heap import skip_teardown\n"
    "skip_teardown()\n"
    "class Torn:\n"
    "    def __del__(self):\n"
    "        sys.__stderr__.write('torn down\\n')\n"
    "torn = Torn()\n"
    "atexit.register(lambda: print('handler ran', flush=False))\n"
    "logging.basicConfig(stream=sys.stderr)\n"
    "logging.getLogger('x').warning('logged')\n"
    "ctypes.CDLL(None).printf(b'from C\\n')\n"
    "print('from Python', end='')\n"
)


def test_skip_teardown_ends_with_the_status_after_the_handlers_and_the_output():
    res = _run(_ENDING + "skip_teardown(3)\nsys.exit(0)  # the status given to skip_teardown wins\n")
    assert res.returncode == 3, res.stderr
    assert "from C" in res.stdout and "from Python" in res.stdout and "handler ran" in res.stdout, res.stdout
    assert "logged" in res.stderr and "torn down" not in res.stderr, res.stderr


def test_without_a_status_the_process_ends_as_any_does():
    res = _run(_ENDING + "raise ValueError('escaped')\n")
    assert res.returncode == 1 and "ValueError: escaped" in res.stderr, res.stderr
    assert "torn down" in res.stderr  # the interpreter's own teardown
    assert "from C" in res.stdout and "from Python" in res.stdout and "handler ran" in res.stdout, res.stdout


def test_the_command_line_ends_with_its_commands_status():
    """`python -m embshard.cli` (as the `embshard` program) ends with its command's status: a refusal's 2 and its
    one line (a command that succeeds: 0, every command-line run of tests/test_train.py)."""
    res = subprocess.run([sys.executable, "-m", "embshard.cli", "plan", "configs/dlrm_criteo.yaml", "--world-size",
                          "0"], cwd=paths.ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and "--world-size 0 is invalid" in res.stderr, res.stderr


def test_preload_imports_the_named_modules_frozen_and_skips_the_missing():
    code = "import sys, gc\nimport embshard.runtime.preload\nprint('csv' in sys.modules, gc.get_freeze_count() > 0)\n"
    assert _python(code, **{PRELOAD_VAR: "csv,no_such_module_here"}).strip() == "True True"
