"""The per-step id check (error mode) on every sharding scheme: one bad id on one rank stops every rank, the rank
that has it names the feature, table and value, nothing is updated, and the module keeps training afterwards.

The values at the edges matter: FBGEMM's own check lets -1 through (its "pruned" id) and `rows` is the first id
past a table, so both are tried, on a table-wise, a row-wise, a column-wise and a data-parallel table at once.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind, run_distributed
from parity import random_batches, to_kjt

from embshard import simple_plan
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.tables import TableConfig

TABLES = [
    TableConfig("t_tw", 50, 8, ("f_tw",), ids_per_bag=2),
    TableConfig("t_rw", 30, 4, ("f_rw",), ids_per_bag=2),
    TableConfig("t_cw", 40, 8, ("f_cw",), ids_per_bag=2),
    TableConfig("t_dp", 20, 4, ("f_dp",), ids_per_bag=3),
]
TYPES = {"t_rw": "row_wise", "t_cw": "column_wise", "t_dp": "data_parallel"}
FEATURES = ["f_dp", "f_cw", "f_tw", "f_rw"]  # not the tables' order: the check must follow the batch's keys
CASES = [("f_tw", -1), ("f_rw", 30), ("f_cw", -7), ("f_dp", 20), ("f_tw", 50 + 10**9)]


def _worker(rank, world_size, device):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.sharding.exchange import IdsOutOfRange

    tier = "host" if device.type == "cpu" else "hbm"
    plan = simple_plan(TABLES, world_size, sharding_types=TYPES, tier=tier)
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, FusedOptimizerConfig("sgd", lr=0.1), device=device, seed=3)
    batches = random_batches(TABLES, [6] * world_size, len(CASES) + 1, seed=7)
    before = ebc.full_weights()
    outcome = []
    for step, (feature, bad_value) in enumerate(CASES):
        batch = dict(batches[step][0][rank])
        if rank == world_size - 1:  # only the last rank has the bad id
            lengths, ids, w = batch[feature]
            ids = ids.clone()
            ids[ids.numel() // 2] = bad_value
            batch[feature] = (lengths, ids, w)
        try:
            ebc(to_kjt(batch, FEATURES, device)).values().sum().backward()
            outcome.append(("ran", ""))
        except IdsOutOfRange as e:
            outcome.append(("stopped", str(e.ranks)))
        except ValueError as e:
            outcome.append(("named", str(e)))
    unchanged = all(torch.equal(before[k], v) for k, v in ebc.full_weights().items())
    clean = batches[-1][0][rank]
    ebc(to_kjt(clean, FEATURES, device)).values().sum().backward()  # still trains
    changed = any(not torch.equal(before[k], v) for k, v in ebc.full_weights().items())
    return outcome, unchanged, changed


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_bad_id_stops_every_rank_and_is_named(world_size):
    if device_kind() == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip("needs more GPUs")
    results = run_distributed(_worker, world_size)
    for rank, (outcome, unchanged, changed) in enumerate(results):
        assert unchanged and changed, (rank, unchanged, changed)
        for (kind, text), (feature, value) in zip(outcome, CASES):
            if rank == world_size - 1:
                table = feature.replace("f_", "t_")
                assert kind == "named", (rank, feature, kind, text)
                assert text.startswith(f"feature {feature!r}: id {value} is outside table {table!r}"), text
            else:
                assert (kind, text) == ("stopped", f"[{world_size - 1}]"), (rank, feature, kind, text)


def test_bad_id_count_matches_a_direct_count(device):
    """`count_bad_ids` (the host's min/max per feature on the CPU, FBGEMM's check on the device) counts exactly the
    ids outside their feature's table, with empty features between and int32 or int64 ids."""
    from embshard.collection.bounds import count_bad_ids

    F = 7
    tables = {f"f{i}": TableConfig(f"t{i}", 3 + 41 * i, 4, (f"f{i}",)) for i in range(F)}
    keys = list(tables)
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        lengths = torch.randint(0, 4, (F, int(torch.randint(1, 6, (1,), generator=g))), generator=g)
        lengths[torch.randint(0, F, (2,), generator=g)] = 0
        rows = torch.tensor([t.num_embeddings for t in tables.values()]).repeat_interleave(lengths.sum(1))
        ids = (torch.rand(rows.numel(), generator=g) * rows).long()
        if trial % 2 and ids.numel():
            pos = torch.randperm(ids.numel(), generator=g)[: int(torch.randint(1, ids.numel() + 1, (1,), generator=g))]
            ids[pos] = torch.where(torch.rand(pos.numel(), generator=g) < 0.5, -1 - pos, rows[pos] + pos)
        want = int(((ids < 0) | (ids >= rows)).sum())
        for dtype in (torch.int64, torch.int32):
            got = count_bad_ids(lengths.to(device), ids.to(device, dtype), keys, tables)
            assert int(got) == want, f"trial {trial} {dtype}: counted {int(got)} bad ids, want {want}"
