"""Deterministic initial rows (embshard.lookup.init_rows): a counter-based hash of (seed, table, element), drawn on
the weights' device. Checked against an independent scalar splitmix64 written here, block by block (any rows and
columns of a table equal the full table's), and on the test device against the CPU (bitwise). The sharded tables of
every sharding type start equal to the full table: tests/test_pipeline.py checks a mixed plan on 2 ranks."""

from __future__ import annotations

import random

import torch

from embshard.lookup import init_rows
from embshard.spec.tables import TableConfig

M64 = (1 << 64) - 1


def mix(x: int) -> int:
    """splitmix64's output function (Steele, Lea, Flood), written out independently of embshard's."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def expected(t: TableConfig, table_index: int, seed: int, r: int, c: int) -> float:
    key = mix((mix(seed) + 0x9E3779B97F4A7C15 * (table_index + 1)) & M64)
    z = mix((key + 0x9E3779B97F4A7C15 * (r * t.embedding_dim + c)) & M64)
    u = torch.tensor(float(z >> 40), dtype=torch.float32)  # 24 bits, exact
    b = torch.tensor(t.init_bound, dtype=torch.float32)
    return float(u * torch.tensor(2 * t.init_bound / (1 << 24), dtype=torch.float32) - b)


def test_values_are_the_hash_and_any_block_is_the_tables():
    t = TableConfig("t", 5000, 20, ("f",))
    full = init_rows(t, 3, 0, t.num_embeddings, 0, t.embedding_dim, seed=11)
    assert full.dtype == torch.float32 and full.shape == (5000, 20)
    rng = random.Random(0)
    for _ in range(50):
        r, c = rng.randrange(5000), rng.randrange(20)
        assert full[r, c].item() == expected(t, 3, 11, r, c), (r, c)
    assert full.abs().max() <= t.init_bound and abs(full.mean().item()) < 0.02 * t.init_bound
    assert abs(full.std().item() - t.init_bound / 3**0.5) < 0.01 * t.init_bound  # uniform on [-b, b]
    for r0, n, c0, w in [(0, 1, 0, 20), (4999, 1, 19, 1), (1234, 777, 4, 12), (2500, 2500, 8, 12)]:
        assert torch.equal(init_rows(t, 3, r0, n, c0, w, 11), full[r0 : r0 + n, c0 : c0 + w])
    assert not torch.equal(init_rows(t, 4, 0, 10, 0, 20, 11), full[:10])  # another table
    assert not torch.equal(init_rows(t, 3, 0, 10, 0, 20, 12), full[:10])  # another seed


def test_device_draw_equals_the_cpu_draw(monkeypatch, device):
    from embshard.lookup import shards

    t = TableConfig("t", 70_001, 12, ("f",))
    cpu = init_rows(t, 0, 3, 70_000, 4, 8, seed=5)
    dev = init_rows(t, 0, 3, 70_000, 4, 8, seed=5, device=device)
    assert dev.device.type == device.type and torch.equal(dev.cpu(), cpu)
    monkeypatch.setattr(shards, "INIT_BLOCK_ELEMENTS", 1000)  # many passes: the same rows
    assert torch.equal(init_rows(t, 0, 3, 70_000, 4, 8, seed=5, device=device).cpu(), cpu)
