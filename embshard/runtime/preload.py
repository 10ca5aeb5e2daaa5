"""The module a fork server imports before its first fork (`heap.preload_frozen`: `spawn_local`'s in
runtime/distributed.py, the test harness's): the modules named in EMBSHARD_PRELOAD (comma-separated) under
`heap.collector_paused`, so that every process forked from the server starts with them imported, and the collector
never walks them. A module that cannot be imported is left to the forks (a fork server skips its preloads' import
errors the same way). The server ends, once its parent has, without tearing those modules down
(`heap.skip_teardown`; its forks end with os._exit as every multiprocessing child does)."""

from __future__ import annotations

import os

from embshard.runtime.heap import PRELOAD_VAR, import_frozen, skip_teardown

skip_teardown(0)  # before the imports: its handler runs after theirs
import_frozen(*filter(None, os.environ.get(PRELOAD_VAR, "").split(",")), skip_missing=True)
