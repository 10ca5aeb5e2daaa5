"""No hangs on uneven batches, and a watchdog instead of a hang.

- A hang seen on GPUs: 2 ranks, row-wise tables among others, a step where one rank's local batch is
  empty. Every rank must enter every collective whatever its local data; the result must match the unsharded
  reference (batches of 0 on one rank, on every rank, and back to normal).
- Ranks out of step (one skipped a batch, its step counter says so): every rank raises at once, naming the steps.
- A rank that stalls: the others raise `CollectiveTimeout` within the timeout, naming the step and the exchange,
  and the stalled rank errors too when it comes back.
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_harness import device_kind, run_distributed
from parity import check_parity, random_batches, sharded_worker, to_kjt

from embshard import FusedOptimizerConfig, ShardingType, TableConfig, simple_plan
from embshard.spec.plan import MemoryTier

RW, TW, DP = ShardingType.ROW_WISE, ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL
# The hang's reproduction: one feature per table, row-wise Adagrad, simple_plan with these types.
HANG_TABLES = [
    (TableConfig("t0", 4099, 64, ("f0",)), DP),
    (TableConfig("t1", 1000, 4, ("f1",), pooling="mean"), TW),
    (TableConfig("t2", 5, 8, ("f2",)), DP),
    (TableConfig("t3", 17, 64, ("f3",)), RW),
    (TableConfig("t4", 300, 4, ("f4",), weighted=True), TW),
    (TableConfig("t5", 64, 32, ("f5",)), RW),
    (TableConfig("t6", 1000, 12, ("f6",), pooling="mean", weighted=True), TW),
]
ROWWISE = FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6)


def _tier() -> MemoryTier:
    return MemoryTier.HOST if device_kind() == "cpu" else MemoryTier.HBM


def _plan(world_size: int):
    tables = [t for t, _ in HANG_TABLES]
    return tables, simple_plan(tables, world_size, sharding_types={t.name: st for t, st in HANG_TABLES}, tier=_tier())


@pytest.mark.parametrize(
    "batch_sizes",
    [
        [[5, 2], [5, 0]],  # the report: step 1 hung on NCCL
        [[5, 2], [0, 3], [0, 0], [4, 4]],  # either rank empty, both empty, then normal again
    ],
    ids=["one-rank-empty", "empty-either-both"],
)
def test_empty_local_batch_with_row_wise_tables(batch_sizes):
    world_size, steps = 2, len(batch_sizes)
    tables, plan = _plan(world_size)
    results = run_distributed(sharded_worker, world_size, tables, plan, ROWWISE, batch_sizes, steps, 5)
    check_parity(results, tables, ROWWISE, batch_sizes, steps, 5)


def _out_of_step_worker(rank, world_size, device, tables, plan):
    """Rank 1 skips step 1 (its data loader moved on): at its next forward it is at step 2, rank 0 at step 1."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.sharding.exchange import RanksOutOfStep

    ebc = ShardedEmbeddingBagCollection(tables, plan, ROWWISE, device=device)
    batches = random_batches(tables, [3, 3], 4, seed=9)
    keys = [f for t in tables for f in t.feature_names]
    try:
        for step, (per_rank, _) in enumerate(batches):
            if rank == 1 and step == 1:
                continue
            ebc.set_step(step)
            sum(v.sum() for v in ebc(to_kjt(per_rank[rank], keys, device)).to_dict().values()).backward()
    except RanksOutOfStep as e:
        return {"error": str(e), "step": step}
    return {"error": None}


def test_a_rank_out_of_step_stops_every_rank():
    world_size = 2
    tables, plan = _plan(world_size)
    results = run_distributed(_out_of_step_worker, world_size, tables, plan)
    for r, res in enumerate(results):
        assert res["error"] is not None, f"rank {r} did not notice"
        assert "different steps" in res["error"] and "{0: 1, 1: 2}" in res["error"], res["error"]


def _stall_worker(rank, world_size, device, tables, plan, timeout_s):
    """Rank 1 stalls for longer than the timeout before its second step; rank 0 waits for it."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.runtime import comm

    ebc = ShardedEmbeddingBagCollection(tables, plan, ROWWISE, device=device)
    batches = random_batches(tables, [3, 3], 3, seed=9)
    keys = [f for t in tables for f in t.feature_names]
    try:
        for step, (per_rank, _) in enumerate(batches):
            if step == 1:  # from step 1: step 0 may wait seconds for a rank started late on a loaded machine
                comm.set_timeout(timeout_s)
            if rank == 1 and step == 1:
                time.sleep(timeout_s * 3)
            t0 = time.monotonic()
            sum(v.sum() for v in ebc(to_kjt(per_rank[rank], keys, device)).to_dict().values()).backward()
    except Exception as e:  # the stalled rank gets whatever the backend says once its peer has left
        return {"type": type(e).__name__, "error": str(e), "after_s": time.monotonic() - t0, "step": step}
    return {"type": None}


def test_a_stalled_rank_makes_the_others_raise_within_the_timeout(monkeypatch):
    world_size, timeout_s = 2, 1.0  # short: the test waits 3 timeouts (the stall) in real time
    # On CPU process groups (gloo) on every machine: embshard's timeout is the same host-side wait for every backend,
    # while this test leaves a collective pending on purpose, and NCCL's own watchdog then takes the process down
    # (TORCH_NCCL_ASYNC_ERROR_HANDLING) whatever embshard does.
    monkeypatch.setenv("EMBSHARD_TEST_DEVICE", "cpu")
    tables, plan = _plan(world_size)
    # fresh processes: the watchdog's timeout stays set in them, and rank 0 leaves a collective pending
    results = run_distributed(
        _stall_worker, world_size, tables, plan, timeout_s, pg_timeout_s=3 * timeout_s, fresh=True
    )
    waiting, stalled = results
    assert waiting["type"] == "CollectiveTimeout", waiting
    assert f"step 1: batch counts all-gather did not complete within {timeout_s:g} s" in waiting["error"], waiting
    # raised from the step's start, after the timeout and before the stalled rank came back (3 timeouts: a loaded
    # machine, e.g. the GPU suite's parallel workers, may be slow to schedule the raising thread)
    assert timeout_s <= waiting["after_s"] < timeout_s * 3, waiting
    assert stalled["type"] is not None, "the stalled rank went on as if nothing happened"


def test_collective_timeout_names_pending_collectives():
    """Unit: the watchdog's message lists the collectives issued earlier that are still pending."""
    from embshard.runtime import comm

    class Never:
        def is_completed(self):
            return False

        def wait(self):
            raise AssertionError("never waited on")

    comm.set_timeout(0.05)
    try:
        comm._ISSUED.clear()
        earlier = Never()
        comm._issued("step 3: table_wise pooled all-to-all (backward)", earlier)
        with pytest.raises(comm.CollectiveTimeout, match=r"step 4: batch counts.*within 0.05 s.*table_wise pooled"):
            comm.wait_work(Never(), "step 4: batch counts all-gather")
    finally:
        comm.set_timeout(None)
        comm._ISSUED.clear()


def test_scope_labels_nest_and_unwind():
    from embshard.runtime import comm

    assert comm.scoped_label("x") == "x"
    with comm.scope("step 7"):
        assert comm.scoped_label("ids all-to-all") == "step 7: ids all-to-all"
        with pytest.raises(ValueError), comm.scope("step 8"):
            raise ValueError
        assert comm.scoped_label("y") == "step 7: y"
    assert comm.scoped_label("z") == "z"


def test_reference_handles_an_empty_global_batch():
    """The reference itself: a global batch of 0 gives [0, D] outputs and changes no weight."""
    from reference import ReferenceEBC

    tables = [t for t, _ in HANG_TABLES]
    ref = ReferenceEBC(tables, ROWWISE, seed=1)
    before = {k: v.clone() for k, v in ref.weights.items()}
    empty = {
        f: (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None)
        for t in tables
        for f in t.feature_names
    }
    out = ref.step(empty, {f: torch.zeros(0, t.embedding_dim) for t in tables for f in t.feature_names})
    assert all(o.shape[0] == 0 for o in out.values())
    assert all(torch.equal(before[k], v) for k, v in ref.weights.items())
