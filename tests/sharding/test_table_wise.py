"""Table-wise sharding: forward outputs and weights after several fused-optimizer steps match the unsharded
reference, for world sizes 1, 2 and 3 (gloo on CPU; NCCL with EMBSHARD_TEST_DEVICE=cuda)."""

from __future__ import annotations

import pytest
import reference
import torch
from dist_harness import device_kind, run_distributed
from parity import check_parity, sharded_worker

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.spec.plan import MemoryTier

TABLES = [
    TableConfig("t_big", 97, 16, ("f_a", "f_b"), ids_per_bag=2),  # shared by two features
    TableConfig("t_mean", 50, 8, ("f_c",), pooling="mean", ids_per_bag=3),
    TableConfig("t_weighted", 40, 12, ("f_d",), weighted=True, ids_per_bag=2),
    TableConfig("t_wmean", 30, 4, ("f_e",), pooling="mean", weighted=True, ids_per_bag=1),
    TableConfig("t_small", 11, 20, ("f_f",), ids_per_bag=1),
]

OPTIMIZERS = dict(reference.OPTIMIZERS)
if device_kind() == "cpu":  # FBGEMM's GPU kernels ignore weight decay except for rowwise_adagrad: refused there
    OPTIMIZERS["adagrad_wd"] = FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6, weight_decay=0.05)
    OPTIMIZERS["adam_wd"] = FusedOptimizerConfig("adam", lr=0.05, eps=1e-6, weight_decay=0.05)

WORLD_SIZES = [1, 2, 3] if device_kind() == "cpu" else [n for n in (1, 2) if n <= torch.cuda.device_count()]


# f_b and f_e are in no group (their tables' rows must not move under SGD); f_a and f_c are in two groups.
GROUPS = {"user": ["f_a", "f_c"], "cross": ["f_c", "f_d", "f_a"], "item": ["f_f"]}


def _all_optimizers_worker(rank, world_size, device, batch_sizes, steps):
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    plan = simple_plan(TABLES, world_size, tier=tier)
    results = {
        name: sharded_worker(rank, world_size, device, TABLES, plan, opt, batch_sizes, steps, seed=7 + i)
        for i, (name, opt) in enumerate(OPTIMIZERS.items())
    }
    results["groups"] = sharded_worker(
        rank, world_size, device, TABLES, plan, OPTIMIZERS["sgd"], batch_sizes, steps, seed=3, groups=GROUPS
    )
    return results


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def trained(request):
    world_size = request.param
    batch_sizes = [5 + r for r in range(world_size)]  # uneven local batches
    steps = 3
    results = run_distributed(_all_optimizers_worker, world_size, batch_sizes, steps)
    return world_size, batch_sizes, steps, results


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_table_wise_parity(trained, opt_name):
    world_size, batch_sizes, steps, results = trained
    per_rank = [r[opt_name] for r in results]
    check_parity(per_rank, TABLES, OPTIMIZERS[opt_name], batch_sizes, steps, seed=7 + list(OPTIMIZERS).index(opt_name))


def test_output_groups_with_repeated_and_unused_features(trained):
    world_size, batch_sizes, steps, results = trained
    per_rank = [r["groups"] for r in results]
    check_parity(per_rank, TABLES, OPTIMIZERS["sgd"], batch_sizes, steps, seed=3, groups=GROUPS)
    # The table read only by unused features keeps its initial weights exactly.
    from embshard.lookup import init_rows

    t = TABLES[3]
    assert torch.equal(per_rank[0]["weights"][t.name], init_rows(t, 3, 0, t.num_embeddings, 0, t.embedding_dim, 3))
