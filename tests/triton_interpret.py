"""Triton's interpreter (TRITON_INTERPRET=1, the CPU runs of the Triton kernels) without its repeated set-up.

Triton's interpreter points triton.language's builtins at their interpreted versions as a launch starts
(`interpreter._patch_lang`, undone as the launch ends), and again at every call of a `@triton.jit` device function
inside the kernel (every program's `bags_of`, `tl.sort`'s compare-and-swaps, ...): each time it walks the members of
triton.language, its tensor and math modules (inspect.getmembers), about a quarter of an interpreted kernel's CPU
time in the suite's kernels. The calls inside a launch find the modules already pointed at the interpreted versions
(the builtins are already wrapped: the walk wraps nothing again; the rest sets equivalent functions once more), so
`install` lets only the first set-up of a launch per set of language modules run (a device function whose module
sees triton.language.core, not triton.language, still gets its own); and numpy's dtype of a Triton type, which it
builds from a fresh table at every operation, is looked up once per type. Where Triton's interpreter is laid out
otherwise (another Triton version), `install` leaves it as it is: the kernels then run as slowly as before, never
differently.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading

_INSTALLED = False


def install() -> bool:
    """Under TRITON_INTERPRET=1 where Triton is installed: a launch sets triton.language up once per set of language
    modules (module docstring). Returns whether it did so (now or before)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid, patch, scope = (getattr(interpreter, n, None) for n in ("GridExecutor", "_patch_lang", "_LangPatchScope"))
    if grid is None or patch is None or scope is None or not isinstance(grid, type):
        return False
    if list(inspect.signature(patch).parameters) != ["fn"]:
        return False
    state = threading.local()  # the language-module sets already set up by the running launch (None: no launch)

    seen: dict[object, frozenset[int]] = {}  # per function: the language modules its module sees

    def langs(fn) -> frozenset[int]:
        key = seen.get(fn)
        if key is None:
            key = seen[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return key

    @functools.wraps(patch)
    def patch_once(fn):
        done = getattr(state, "done", None)
        if done is None:  # outside a launch: as Triton does
            return patch_once.__wrapped__(fn)
        key = langs(fn)
        if key in done:
            return scope()  # nothing to undo: the launch's own set-up stays until the launch ends
        done.add(key)
        return patch_once.__wrapped__(fn)

    run = grid.__call__

    @functools.wraps(run)
    def launch(self, *args, **kwargs):
        outer = getattr(state, "done", None)
        state.done = set()
        try:
            return run(self, *args, **kwargs)
        finally:
            state.done = outer

    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:  # numpy's dtype of a Triton type: built from a fresh table at every call of every op
        dtypes: dict[object, object] = {}

        @functools.wraps(np_dtype)
        def np_dtype_once(tt_dtype):
            try:
                return dtypes[tt_dtype]
            except KeyError:
                found = dtypes[tt_dtype] = np_dtype(tt_dtype)
                return found
            except TypeError:  # a type that is not hashable
                return np_dtype(tt_dtype)

        interpreter._get_np_dtype = np_dtype_once
    interpreter._patch_lang = patch_once
    grid.__call__ = launch
    _INSTALLED = True
    return True
