"""The planner at scale: hot tables split so no rank's lookups grow with the world size, 2D sharding's group size,
the replica synchronization, the dense all-reduce and the plan's 2D fields."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from embshard.planner import Topology, plan_with_report
from embshard.planner.balance import balanced_ids, busy_shares, hot_tables, rank_ids
from embshard.planner.dense import dlrm_dense, ring_allreduce_s
from embshard.planner.settings import PlannerSettings
from embshard.planner.twod import group_sizes, plan_at_scale, replica_sync_s, sync_floor_s
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.plan import Shard, ShardingPlan, ShardingType, TablePlan
from embshard.spec.tables import ConfigError, TableConfig
from embshard.tools.plan_inputs import training_planner_input

MLPERF = "configs/dlrm_dcnv2_mlperf.yaml"


@pytest.fixture(scope="module")
def mlperf():
    # the planner free to split hot tables row-wise (a whole-step graph holds table-wise and data-parallel only)
    overrides = ["training.precision=bf16", "lookup.output_dtype=bf16", "training.cuda_graph=false"]
    inp, _ = training_planner_input(MLPERF, overrides)
    return inp


def test_hot_tables_are_split_so_the_busiest_rank_does_not_grow(mlperf) -> None:
    """Weak scaling on one host: the busiest rank's predicted lookups at 4 and 8 GPUs stay within 20% of the
    2-GPU plan's and of a balanced rank's, and the hot tables (t_cat_20: 100 ids a sample) are row-split."""
    tables, B = mlperf.tables, mlperf.batch_size
    busiest = {}
    for W in (2, 4, 8):
        topo = Topology.preset("h100", world_size=W)
        plan, _ = plan_with_report(tables, topo, B, mlperf.optimizer, mlperf.constraints, mlperf.settings)
        busiest[W] = max(rank_ids(plan, tables, B))
        for name in hot_tables(tables, W):
            assert plan[name].sharding_type in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL), (W, name)
        assert max(busy_shares(plan, tables, B)) < 1.2, W
    even = balanced_ids(tables, B)
    assert busiest[8] <= 1.2 * busiest[2] and busiest[4] <= 1.2 * busiest[2], busiest
    assert busiest[2] <= 1.2 * even
    assert hot_tables(tables, 8) == ["t_cat_20", "t_cat_21"] and hot_tables(tables, 2) == []
    # without the split, one block of the 100-id table alone is W x B x 100 ids: 3.7 balanced ranks at W=8
    tw_only = PlannerSettings(split_hot_tables=False, sharding_types=(ShardingType.TABLE_WISE,))
    topo = Topology.preset("h100", world_size=8)
    plan, _ = plan_with_report(tables, topo, B, mlperf.optimizer, mlperf.constraints, tw_only)
    assert max(rank_ids(plan, tables, B)) >= 8 * B * 100 > 3.5 * even


def test_rank_ids_counts_each_sharding_type() -> None:
    t = TableConfig("t", 100, 8, feature_names=("f", "g"), ids_per_bag=3)
    B, W = 10, 4
    shards_rw = tuple(Shard(r, 25 * r, 25, 0, 8) for r in range(W))
    cases = {
        ShardingType.TABLE_WISE: ((Shard(2, 0, 100, 0, 8),), [0, 0, W * B * 6, 0]),
        ShardingType.ROW_WISE: (shards_rw, [B * 6] * W),
        ShardingType.COLUMN_WISE: ((Shard(1, 0, 100, 0, 4), Shard(3, 0, 100, 4, 4)), [0, W * B * 3, 0, W * B * 3]),
        ShardingType.DATA_PARALLEL: (tuple(Shard(r, 0, 100, 0, 8) for r in range(W)), [B * 6] * W),
    }
    for st, (shards, want) in cases.items():
        plan = ShardingPlan(W, W, (TablePlan("t", st, "hbm", shards),))
        plan.check([t])
        assert rank_ids(plan, [t], B) == pytest.approx(want), st


def test_group_size_is_2d_when_the_network_binds(mlperf) -> None:
    """64 and 512 H100s (8 a host, 45 GB/s a GPU between hosts): a flat plan's exchanges cross the network, so the
    planner picks groups smaller than the world, and the flat plan predicts a step over 1.3 times as long; with a
    network faster than NVLink it keeps the flat plan at 64."""
    tables, B = mlperf.tables, mlperf.batch_size
    dense = dlrm_dense(13, 128, 26, [512, 256], [1024, 1024, 512, 256], 3, 512, "bf16")
    quick = replace(mlperf.settings, max_moves=0)  # greedy placement only: the group sizes differ far more
    args = (tables, None, B, mlperf.optimizer, mlperf.constraints, quick, dense, "periodic", 100)
    for W in (64, 512):
        topo = Topology.preset("h100", world_size=W)
        sp = plan_at_scale(*(args[:1] + (topo,) + args[2:]))
        g = sp.group_size
        assert g is not None and g < W and g % 8 == 0 and W % g == 0, sp.summary()
        assert sp.plan.sharding_group_size == g and sp.plan.world_size == W
        sp.plan.check(tables)
        flat = next(c for c in sp.candidates if c.group_size == W)
        assert flat.skipped or flat.step_s > 1.3 * sp.best.step_s
        assert max(sp.busy_shares(tables)) < 2  # no hot table whole on a rank; near-hot ones may share one
        assert sp.samples_per_s_per_gpu == pytest.approx(B / sp.best.step_s)
    fast = Topology.preset("h100", world_size=64)
    fast = replace(fast, inter_host_bw=4 * fast.intra_host_bw, inter_collective_latency_s=fast.collective_latency_s)
    sp = plan_at_scale(*(args[:1] + (fast,) + args[2:]))
    assert sp.group_size is None and sp.plan.sharding_group_size is None, sp.summary()


def test_group_sizes_and_bad_arguments() -> None:
    assert group_sizes(64, 8) == [8, 16, 32, 64]
    assert group_sizes(8, 8) == [8]
    assert group_sizes(24, 8) == [8, 24]
    t = [TableConfig("t", 1000, 16, feature_names=("f",))]
    topo = Topology.preset("h100", world_size=16)
    with pytest.raises(ConfigError, match="group size 4 is invalid for 16 ranks"):
        plan_at_scale(t, topo, 64, group_size=4)
    with pytest.raises(ConfigError, match="replica_sync='sometimes'"):
        plan_at_scale(t, topo, 64, replica_sync="sometimes")
    with pytest.raises(ConfigError, match="replica_sync_every=0"):
        plan_at_scale(t, topo, 64, replica_sync="periodic", replica_sync_every=0)


def test_groups_smaller_than_the_constraints_are_skipped() -> None:
    """2 hosts x 1 GPU, a table in 2 column blocks: a group of 1 rank cannot hold them, so that size is skipped and
    says why, and the flat plan is taken (a ConfigError only where the whole world cannot take the constraints)."""
    t = [TableConfig("t", 100_000, 64, feature_names=("f",)), TableConfig("u", 1000, 16, feature_names=("g",))]
    cons = {"t": {"sharding_types": ["column_wise"], "column_shards": [2]}}
    sp = plan_at_scale(t, Topology.preset("h100", world_size=2, local_world_size=1), 64, constraints=cons)
    assert sp.group_size is None and sp.plan["t"].sharding_type.value == "column_wise"
    [one] = [c for c in sp.candidates if c.group_size == 1]
    assert one.skipped.startswith("not planned: the constraints need more ranks than a group of 1") and one.plan is None
    assert "column_shards [2] exceed world_size=1" in one.skipped
    with pytest.raises(ConfigError, match=r"column_shards \[4\] exceed world_size=2"):
        plan_at_scale(t, Topology.preset("h100", world_size=2, local_world_size=1), 64,
                      constraints={"t": {"sharding_types": ["column_wise"], "column_shards": [4]}})  # fmt: skip


def test_ring_allreduce_prices_nvlink_and_the_network_apart() -> None:
    topo = Topology.preset("h100", world_size=64)
    S, bi, bx = 64e6, topo.intra_host_bw, topo.inter_host_bw
    li, lx = topo.collective_latency_s, topo.inter_collective_latency_s
    assert ring_allreduce_s(S, 8, 8, topo) == pytest.approx(2 * 7 / 8 * S / bi + li)
    assert ring_allreduce_s(S, 64, 8, topo) == pytest.approx(2 * 7 / 8 * S / bi + li + 2 * 7 / 8 * S / 8 / bx + lx)
    assert ring_allreduce_s(S, 8, 1, topo) == pytest.approx(2 * 7 / 8 * S / bx + lx)
    assert ring_allreduce_s(S, 1, 1, topo) == 0.0


def test_replica_sync_exact_and_periodic() -> None:
    """One table-wise table on rank 1 of groups of 8, 4 replicas (32 ranks, one replica a host): exact moves the
    touched rows (distinct among the 4 groups' ids) and their ids, periodic the weights and state once per N."""
    t = TableConfig("t", 1000, 16, feature_names=("f",), ids_per_bag=2)
    W, G, B = 32, 8, 4
    topo = Topology.preset("h100", world_size=W)
    opt = FusedOptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD)
    s = PlannerSettings()
    plan = ShardingPlan(
        W, 8, (TablePlan("t", "table_wise", "hbm", (Shard(1, 0, 1000, 0, 16),)),), sharding_group_size=G
    )
    plan.check([t])
    n = G * B * 2  # the group's ids of the table
    u = 1000 * -math.expm1(-4 * n / 1000)
    ring = 2 * 3 / 4 / topo.inter_host_bw
    exact = replica_sync_s(plan, [t], topo, B, opt, s, "exact")
    assert exact == pytest.approx(u * (16 * 4 + 8) * ring + topo.inter_collective_latency_s)
    periodic = replica_sync_s(plan, [t], topo, B, opt, s, "periodic", 10)
    assert periodic == pytest.approx(1000 * (16 * 4 + 4) / 10 * ring + topo.inter_collective_latency_s)
    flat = replace(plan, sharding_group_size=None)
    assert replica_sync_s(flat, [t], topo, B, opt, s, "exact") == 0.0
    # the floor the group-size search skips candidates by: the same bytes spread over the group's 8 ranks
    floor = sync_floor_s([t], topo, G, B, opt, s, 0.0, "exact")
    assert floor == pytest.approx(u * (16 * 4 + 8) / G * ring + topo.inter_collective_latency_s) and floor < exact
    assert sync_floor_s([t], topo, G, B, opt, s, 1e9, "exact") == 0.0  # it could be data-parallel
    half = sync_floor_s([t], topo, G, B, opt, s, 1000 * (16 * 4 + 4) / 2, "exact")  # half a replica fits: half
    assert half == pytest.approx(u * (16 * 4 + 8) / 2 / G * ring + topo.inter_collective_latency_s)
    assert sync_floor_s([t], topo, G, B, opt, s, 0.0, "periodic", 10) < periodic


def test_plan_2d_fields_check_and_round_trip(tmp_path) -> None:
    t = TableConfig("t", 100, 8, feature_names=("f",))
    rw = tuple(Shard(r, 50 * r, 50, 0, 8) for r in range(2))
    plan = ShardingPlan(8, 4, (TablePlan("t", "row_wise", "hbm", rw),), sharding_group_size=2, replica_sync="periodic",
                        replica_sync_every=50)  # fmt: skip
    plan.check([t])
    path = tmp_path / "plan.yaml"
    plan.save(path)
    back = ShardingPlan.load(path)
    assert back == plan and back.shard_world_size == 2
    assert "sharding_group_size=2" in str(plan)
    with pytest.raises(ConfigError, match="sharding_group_size=3 is invalid: it must divide world_size=8"):
        ShardingPlan(8, 4, plan.tables, sharding_group_size=3)
    with pytest.raises(ConfigError, match="replica_sync='never'"):
        ShardingPlan(8, 4, plan.tables, sharding_group_size=2, replica_sync="never")
    with pytest.raises(ConfigError, match="shard rank 2 is outside 0..1"):
        bad = (TablePlan("t", "table_wise", "hbm", (Shard(2, 0, 100, 0, 8),)),)
        ShardingPlan(8, 4, bad, sharding_group_size=2).check([t])


def test_dlrm_dense_counts_the_mlperf_model() -> None:
    spec = dlrm_dense(13, 128, 26, [512, 256], [1024, 1024, 512, 256], 3, 512, "bf16")
    bottom = 13 * 512 + 512 * 256 + 256 * 128
    cross = 3 * 2 * 3456 * 512
    top = 3456 * 1024 + 1024 * 1024 + 1024 * 512 + 512 * 256 + 256
    assert spec.flops_per_sample == 6 * (bottom + cross + top)
    assert spec.parameters == bottom + 512 + 256 + 128 + 3 * (2 * 3456 * 512 + 3456) + top + 1024 + 1024 + 512 + 256 + 1


def test_cli_prints_the_group_size_and_writes_the_2d_plan(tmp_path, capsys) -> None:
    from embshard.tools.plan import main

    out = tmp_path / "plan.yaml"
    argv = [MLPERF, "--world-size", "64", "--local-world-size", "8", "--device", "h100", "--group-size", "16",
            "--replica-sync", "periodic", "--replica-sync-every", "50", "--out", str(out), "planner.settings.max_moves=0"]  # fmt: skip
    main(argv)
    text = capsys.readouterr().out
    assert "chosen sharding_group_size: 16; predicted step" in text and "M samples/s per GPU" in text, text[-2000:]
    assert "lookups per rank of a group over a balanced rank's: busiest" in text
    plan = ShardingPlan.load(out)
    assert (plan.world_size, plan.sharding_group_size, plan.replica_sync, plan.replica_sync_every) == (
        64, 16, "periodic", 50)  # fmt: skip
    with pytest.raises(SystemExit):
        main([MLPERF, "--world-size", "64", "--device", "h100", "--group-size", "12"])
    err = capsys.readouterr().err
    assert "--group-size 12 is invalid with --world-size 64 and 8 ranks per host" in err and "--group-size 8" in err


def test_embedding_floor_bounds_every_plan_from_below() -> None:
    """The group-size search skips a group whose replica sync floor plus its embedding step's floor reaches the
    best step: the floor (no placement) must stay under the planned step of every model and group."""
    from bench.planner_scale import mixed_tables
    from embshard.planner.twod import embedding_floor_s

    opt, s = FusedOptimizerConfig(), PlannerSettings()
    for n, W, L, seed in ((40, 8, 8, 0), (60, 16, 8, 1), (30, 4, 2, 2)):
        tables = mixed_tables(n, seed=seed, world_size=W)
        for G in group_sizes(W, L):
            topo = Topology.preset("h100", G, min(L, G))
            _, rep = plan_with_report(tables, topo, 512, opt, None, s)
            floor = embedding_floor_s(tables, topo, 512, opt, None, s)
            assert 0 < floor <= rep.step_time_s, (n, W, G, floor, rep.step_time_s)
            assert floor <= rep.search_step_time_s or rep.search_step_time_s is None
