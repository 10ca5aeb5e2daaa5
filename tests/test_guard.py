"""The numeric guard (embshard/runtime/guard.py): NaN/Inf in a pooled embedding or the loss stops every rank before the
update, naming the step, the feature and its table; finite steps pass and train as usual."""

from __future__ import annotations

import torch
from parity import random_batches, to_kjt

from embshard import FusedOptimizerConfig, ShardingType, TableConfig, simple_plan

TABLES = [
    TableConfig("t_w", 50, 8, ("f_w",), weighted=True, ids_per_bag=2),
    TableConfig("t_rw", 40, 4, ("f_rw",), ids_per_bag=2),
]
GROUPS = {"a": ["f_w", "f_rw"], "b": ["f_rw"]}


def _worker(rank, world, device, poison_rank):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.runtime.guard import NonFiniteError, check_finite

    tier = "host" if device.type == "cpu" else "hbm"
    plan = simple_plan(TABLES, world, sharding_types={"t_rw": ShardingType.ROW_WISE}, tier=tier)
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, FusedOptimizerConfig("sgd", lr=0.5), GROUPS, device=device)
    keys = ["f_w", "f_rw"]
    (per_rank, _), (next_rank, _) = random_batches(TABLES, [4] * world, 2, seed=3)
    # a finite step passes and trains
    out = ebc(to_kjt(per_rank[rank], keys, device))
    loss = sum(v.sum() for v in out.values())
    check_finite(0, loss, ebc, out)
    loss.backward()
    before = ebc.full_weights()
    # a NaN per-id weight on one rank: every rank stops before backward, the poisoned one names the feature
    lengths, ids, w = next_rank[rank]["f_w"]
    if rank == poison_rank and w.numel():
        w = w.clone()
        w[0] = float("nan")
    next_rank[rank]["f_w"] = (lengths, ids, w)
    out = ebc(to_kjt(next_rank[rank], keys, device))
    loss = sum(v.sum() for v in out.values())
    try:
        check_finite(1, loss, ebc, out)
        loss.backward()
        error = None
    except NonFiniteError as e:
        error = str(e)
    after = ebc.full_weights()
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_nan_in_one_rank_stops_every_rank_before_the_update(run):
    res = run(_worker, 2, 1)
    assert all(r["error"] is not None and r["unchanged"] for r in res), res
    assert "step 1" in res[1]["error"] and "feature 'f_w' (table 't_w')" in res[1]["error"], res[1]["error"]
    assert "another rank" in res[0]["error"]


def test_a_nan_loss_is_named():
    from embshard.runtime.guard import NonFiniteError, check_finite

    class FakeEBC:
        tables, groups, group = TABLES, {"a": ["f_w"]}, None

    import pytest

    with pytest.raises(NonFiniteError, match=r"step 7: .*the loss is \[nan\]"):
        check_finite(7, torch.tensor(float("nan")), FakeEBC(), {"a": torch.ones(2, 8)})
    check_finite(8, torch.tensor(1.0), FakeEBC(), {"a": torch.ones(2, 8)})  # finite: returns
