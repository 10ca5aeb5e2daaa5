"""Work-arounds for FBGEMM's TBE constructor that embshard applies while it builds its lookups.

`array_cache_state()`: FBGEMM builds the UVM cache's row -> table map (`cache_index_table_map`, one int32 per row
of every UVM-caching table of a TBE) as a Python list (`[-1] * rows`, filled by slices) and copies it to the GPU
with `torch.tensor(list)`: about 10 s per 100M rows on one CPU core (fbgemm-gpu 1.6.0 and 1.8.0), most of a
TBE's build time for large UVM-caching tables (a 2-GPU plan with two 100M-row UVM-caching tables on one rank
spent tens of seconds there). While the context is active, FBGEMM's training module builds the same map as a
numpy int32 array (`construct_cache_state`, same content: tests/lookup/test_fbgemm_fixes.py compares them), and
`torch.tensor` copies it in one go. Where FBGEMM has no such function (other versions), nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

import numpy as np

_TRAINING = "fbgemm_gpu.split_table_batched_embeddings_ops_training"


def construct_cache_state(row_list: Sequence[int], location_list: Sequence[Any], feature_table_map: Sequence[int]):
    """FBGEMM's `construct_cache_state` with `cache_index_table_map` a numpy int32 array instead of a list: for
    the rows of every UVM-caching table (tables in order, each its rows), the last feature that reads the table;
    -1 for rows of tables no feature reads. The other fields as FBGEMM's (lists)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheState, EmbeddingLocation

    cached = [loc == EmbeddingLocation.MANAGED_CACHING for loc in location_list]
    cumsum = [0, *accumulate(rows if c else 0 for rows, c in zip(row_list, cached))]
    total = cumsum[-1]
    table_map = np.empty(total, dtype=np.int32)
    last_feature = {t_: t for t, t_ in enumerate(feature_table_map)}
    for t_ in range(len(row_list)):
        table_map[cumsum[t_] : cumsum[t_ + 1]] = last_feature.get(t_, -1)
    hash_cumsum = [cumsum[t_] if cached[t_] else -1 for t_ in feature_table_map]
    hash_cumsum.append(total)
    # CacheState: a dataclass in fbgemm-gpu 1.6, a NamedTuple in 1.8; both take these keywords.
    return CacheState(cache_hash_size_cumsum=hash_cumsum, cache_index_table_map=table_map, total_cache_hash_size=total)


@contextmanager
def array_cache_state() -> Iterator[None]:
    """While active, FBGEMM's TBE constructor builds the UVM cache's row -> table map as an array (module
    docstring); restored on exit."""
    import importlib

    try:
        training = importlib.import_module(_TRAINING)
    except ImportError:
        yield
        return
    original = getattr(training, "construct_cache_state", None)
    if original is None:
        yield
        return
    training.construct_cache_state = construct_cache_state
    try:
        yield
    finally:
        training.construct_cache_state = original
