"""Python's cyclic garbage collector and the libraries a process imports once.

Importing torch, torchrec and FBGEMM makes about a million objects that live as long as the process. The
collector walks every one of them at each full collection: during the imports themselves (about 1 s of CPU of a
rank's 4-5 s start) and again through training. `collector_paused` runs a block of imports with the collector off
and then freezes every object that exists (`gc.freeze`): the collector leaves them alone from then on, and a
process forked afterwards inherits that. At exit they are unfrozen, so that the interpreter's last collection frees
them as it would have (extensions such as Triton's report objects still alive then as leaks). Torch-free: the
command line imports it before anything else."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
from collections.abc import Iterator

PRELOAD_VAR = "EMBSHARD_PRELOAD"
"""The modules runtime/preload.py imports in a fork server (comma-separated), set by `spawn_local`."""


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
