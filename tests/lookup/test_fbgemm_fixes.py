"""embshard/lookup/fbgemm_fixes.py: the UVM cache's row -> table map built as an array holds exactly what
FBGEMM's own list holds (UVM-caching and other tables mixed, tables read by several features, a table no feature
reads), and the constructor uses it only inside `array_cache_state()`."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("fbgemm_gpu")

from fbgemm_gpu import split_table_batched_embeddings_ops_training as training  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation  # noqa: E402

from embshard.lookup.fbgemm_fixes import array_cache_state, construct_cache_state  # noqa: E402

CACHING, DEVICE, MANAGED = EmbeddingLocation.MANAGED_CACHING, EmbeddingLocation.DEVICE, EmbeddingLocation.MANAGED


def _cases():
    yield [1000], [CACHING], [0]
    yield [30, 50, 20], [CACHING, DEVICE, CACHING], [0, 1, 2]
    yield [30, 50, 20, 7], [CACHING, CACHING, MANAGED, CACHING], [0, 0, 1, 2, 3, 3, 3]  # shared tables
    yield [30, 50], [CACHING, CACHING], [1]  # table 0 read by no feature
    yield [10, 20], [DEVICE, MANAGED], [0, 1]  # no cache at all
    rng = random.Random(0)
    for _ in range(20):
        T = rng.randint(1, 8)
        rows = [rng.randint(1, 300) for _ in range(T)]
        locs = [rng.choice([CACHING, CACHING, DEVICE, MANAGED]) for _ in range(T)]
        features = sorted(rng.choice(range(T)) for _ in range(rng.randint(1, 12)))
        yield rows, locs, features


@pytest.mark.parametrize("case", list(_cases()))
def test_same_cache_state_as_fbgemm(case):
    rows, locs, features = case
    want = training.construct_cache_state(rows, locs, features)
    got = construct_cache_state(rows, locs, features)
    assert isinstance(got.cache_index_table_map, np.ndarray) and got.cache_index_table_map.dtype == np.int32
    assert got.cache_index_table_map.tolist() == list(want.cache_index_table_map)
    assert got.cache_hash_size_cumsum == list(want.cache_hash_size_cumsum)
    assert got.total_cache_hash_size == want.total_cache_hash_size


def test_applied_only_inside_the_context():
    original = training.construct_cache_state
    with array_cache_state():
        assert training.construct_cache_state is construct_cache_state
    assert training.construct_cache_state is original
    with pytest.raises(RuntimeError), array_cache_state():
        raise RuntimeError("a failing constructor")
    assert training.construct_cache_state is original
