"""Python's cyclic garbage collector and the libraries a process imports once.

Importing torch, torchrec and FBGEMM makes about a million objects that live as long as the process. The
collector walks every one of them at each full collection: during the imports themselves (about 1 s of CPU of a
rank's 4-5 s start) and again through training. `collector_paused` runs a block of imports with the collector off
and then freezes every object that exists (`gc.freeze`): the collector leaves them alone from then on, and a
process forked afterwards inherits that. At exit they are unfrozen, so that the interpreter's last collection frees
them as it would have (extensions such as Triton's report objects still alive then as leaks).

Tearing those modules down at exit costs again: about 1 s of CPU for an interpreter with torch and torchrec, after
its work is done. A program that ends where nothing is left to finalize (the command line, a fork server) ends
without it (`skip_teardown`): its exit handlers run, its output is flushed, and then the process ends with its
status. Torch-free: the command line imports it before anything else."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

PRELOAD_VAR = "EMBSHARD_PRELOAD"
"""The modules runtime/preload.py imports in a fork server (comma-separated), set by `preload_frozen`."""


def preload_frozen(context: Any, modules: Sequence[str]) -> None:
    """Have `context`'s fork server (a multiprocessing context, or the module itself) import `modules` before its
    first fork under `collector_paused`, through its one preload, runtime/preload.py (a module that cannot be
    imported is left to the forks)."""
    os.environ[PRELOAD_VAR] = ",".join(dict.fromkeys(modules))
    context.set_forkserver_preload(["embshard.runtime.preload"])


def freeze() -> None:
    """Freeze every object now alive out of the collector's generations, unfrozen at exit (once, however many
    times this runs)."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block (imports) runs with the cyclic collector off; at its end every object then alive is frozen
    (`freeze`) and the collector is back as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        freeze()
        if enabled:
            gc.enable()


def import_frozen(*modules: str, skip_missing: bool = False) -> None:
    """Import `modules` under `collector_paused`; `skip_missing`: a module that cannot be imported is skipped."""
    with collector_paused():
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                if not skip_missing:
                    raise


_exit_status: list[int] = []  # the status skip_teardown ends the process with (none: the interpreter's own exit)
_armed: list[bool] = []


def skip_teardown(status: int | None = None) -> None:
    """The first call registers an exit handler that runs after every one registered later (a library's, imported
    afterwards): call it before the imports. With a `status`, the process then ends with it right after its exit
    handlers, its Python and C output flushed and its logging shut down, without the interpreter's teardown of its
    modules and their objects (files are closed by their owners before that). Without one it ends as any process
    does (an exception that escaped: the interpreter reports it and ends)."""
    if not _armed:
        atexit.register(_end_now)
        _armed.append(True)
    if status is not None:
        _exit_status[:] = [status]


def _end_now() -> None:
    if not _exit_status:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a pipe whose reader is gone: nothing left to keep
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # no C library to find (not Linux or macOS)
        ctypes.CDLL(None).fflush(None)  # the C libraries' buffered stdout and files
    os._exit(_exit_status[0])
