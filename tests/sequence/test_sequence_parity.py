"""Sharded sequence tables (ShardedEmbeddingCollection) against the unsharded reference in plain PyTorch: every
step's outputs (lengths and rows, in the ids' order) and the weights after 2 optimizer steps (which carry the
gradients: sgd moves a row by exactly lr x its gradient), for every sharding type (each table takes each type
over the rotations), dedup on and off, every fused optimizer, at world sizes 1, 2 and 3 (one distributed call per
world size), on fresh random batches (the seed is in the failure message), with empty histories and unequal local
batch sizes (an empty local batch included)."""

from __future__ import annotations

import os

import pytest
import torch
from seq_cases import OPTIMIZERS, TABLES, plan_for, random_batches, reference_run

NAMES = list(OPTIMIZERS)
# (rotation, dedup, optimizer): every sharding type for every table, dedup both ways, every optimizer; dedup for
# some tables only
CASES = [(r, d, NAMES[(2 * r + d) % len(NAMES)]) for r in range(5) for d in (False, True)]
CASES += [(1, ["s_a", "s_d"], "adagrad"), (3, ["s_b", "s_c"], "sgd")]  # dedup for some tables only
SIZES = {1: [5], 2: [4, 0], 3: [3, 5, 2]}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sequence_parity(run, world):
    from seq_cases import parity_worker

    seed = int.from_bytes(os.urandom(3), "little")
    ranks = run(parity_worker, world, CASES, SIZES[world], seed)
    for k, (rotation, dedup, opt) in enumerate(CASES):
        plan = plan_for(world, rotation)
        steps = random_batches(TABLES, SIZES[world], 2, seed + k)
        want_out, want_w = reference_run(TABLES, plan, OPTIMIZERS[opt], steps)
        types = {t.name: plan[t.name].sharding_type.value for t in TABLES}
        where = f"world {world}, seed {seed}, {types}, dedup={dedup}, {opt}"
        for r in range(world):
            outs, weights = ranks[r][k]
            for s, (got, want) in enumerate(zip(outs, want_out)):
                for f, (lengths, rows) in want[r].items():
                    assert torch.equal(got[f][0].long(), lengths.long()), f"{where}: rank {r} step {s} {f} lengths"
                    _close(got[f][1], rows, f"{where}: rank {r} step {s} feature {f} rows")
            for t in TABLES:
                _close(weights[t.name], want_w[t.name], f"{where}: rank {r} table {t.name} weights after 2 steps")
