"""2D sharding against the unsharded reference, at world 4 (2 hosts x 2 ranks; gloo on CPU, NCCL with
EMBSHARD_TEST_DEVICE=cuda): every sharding type in one collection, 2D exact (sharding groups of 2, of 1 and of 4 ranks)
and without 2D, with sgd, adagrad, row-wise Adagrad and Adam: outputs every step and weights after the steps equal
the reference trained on the whole world's batch, on every rank of every group, and the groups' optimizer states
are equal. Periodic mode: between averagings each group equals a reference trained on its own group's batch; at
the forward after `replica_sync_every` steps the weights and the optimizer state are the mean of those references,
and the outputs are computed with the averaged weights.

One call of 4 processes trains every run; the tests compare the collected results.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_harness import run_distributed
from parity import check_parity, random_batches, sharded_worker, to_kjt
from reference import ReferenceEBC
from twod_cases import DP, MIXED, TYPES, WORLD, twod_plan

from embshard import FusedOptimizerConfig
from embshard.spec.plan import MemoryTier

OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
}
BATCH_SIZES = [3, 0, 4, 2]  # unequal local batches, one empty
STEPS = 3
SEED = 11
# (name, sharding group size or None, optimizer): 2D exact with groups of 2 (a host each) and of 1, and without 2D
RUNS = [(f"g2_{o}", 2, o) for o in OPTIMIZERS] + [("g1_rowwise_adagrad", 1, "rowwise_adagrad")]
RUNS += [("g4_sgd", 4, "sgd")]  # one group of every rank: the plan's 2D fields with nothing to replicate
RUNS += [(f"flat_{o}", None, o) for o in ("sgd", "adam")]
# World 8 (4 hosts x 2): groups of 4 (2 hosts each) and of 2, in one call of 8 processes
WIDE_RUNS = [("w8_g4_rowwise_adagrad", 4, "rowwise_adagrad"), ("w8_g2_adam", 2, "adam")]
WIDE_BATCH_SIZES = [2, 1, 0, 3, 2, 2, 1, 3]
PERIODIC_TABLES = MIXED  # the data-parallel table m_dp sums its gradients over the whole world
PERIODIC_OPT = FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6)
PERIODIC_EVERY = 2
CLOSE = {"atol": 1e-4, "rtol": 1e-4}  # adagrad in fp32 against the fp64 reference, for a few steps


def _periodic(rank: int, device: torch.device, tier: MemoryTier) -> dict:
    """Train PERIODIC_EVERY steps under a periodic plan; the weights and states then, and after the next training
    forward (which averages the replicas first) its outputs, weights and states."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    plan = twod_plan(PERIODIC_TABLES, 2, tier, "periodic", PERIODIC_EVERY)
    ebc = ShardedEmbeddingBagCollection(PERIODIC_TABLES, plan, PERIODIC_OPT, device=device, seed=SEED)
    features = [f for t in PERIODIC_TABLES for f in t.feature_names]

    def states():
        return {
            (n, s.row_offset, s.col_offset): {k: v.detach().cpu().clone() for k, v in st.items()}
            for n, s, st in ebc.local_optimizer_states()
        }

    batches = random_batches(PERIODIC_TABLES, BATCH_SIZES, PERIODIC_EVERY + 1, SEED)
    for per_rank, upstream in batches[:PERIODIC_EVERY]:
        out = ebc(to_kjt(per_rank[rank], features, device)).to_dict()
        sum((out[f] * upstream[rank][f].to(device)).sum() for f in features).backward()
    before = (ebc.full_weights(), states())
    drift = ebc.replica_difference()
    out = ebc(to_kjt(batches[PERIODIC_EVERY][0][rank], features, device)).to_dict()
    return {
        "before": before,
        "differences": (drift, ebc.replica_difference()),
        "after": (ebc.full_weights(), states()),
        "outputs": {f: o.detach().cpu() for f, o in out.items()},
    }


def _train_all(rank: int, world_size: int, device: torch.device) -> dict:
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    out = {}
    for name, group_size, opt in RUNS:
        plan = twod_plan(MIXED, group_size, tier)
        out[name] = sharded_worker(rank, world_size, device, MIXED, plan, OPTIMIZERS[opt], BATCH_SIZES, STEPS, SEED)
    out["periodic"] = _periodic(rank, device, tier)
    return out


def _train_wide(rank: int, world_size: int, device: torch.device) -> dict:
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    out = {}
    for name, group_size, opt in WIDE_RUNS:
        plan = twod_plan(MIXED, group_size, tier, world=world_size)
        out[name] = sharded_worker(rank, world_size, device, MIXED, plan, OPTIMIZERS[opt], WIDE_BATCH_SIZES, 2, SEED)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_train_all, WORLD)


@functools.cache
def _wide_results() -> list[dict]:
    return run_distributed(_train_wide, 8)


@pytest.mark.parametrize("name,group_size,opt", WIDE_RUNS)
def test_exact_matches_reference_at_world_8(name, group_size, opt):
    results = [r[name] for r in _wide_results()]
    check_parity(results, MIXED, OPTIMIZERS[opt], WIDE_BATCH_SIZES, 2, SEED)


@pytest.mark.parametrize("name,group_size,opt", RUNS)
def test_exact_matches_reference(name, group_size, opt):
    results = [r[name] for r in _results()]
    check_parity(results, MIXED, OPTIMIZERS[opt], BATCH_SIZES, STEPS, SEED)
    if group_size is not None:  # rank i of every group holds the same shards with the same optimizer state
        for r in range(group_size, WORLD):
            mine, peer = results[r]["states"], results[r % group_size]["states"]
            assert mine.keys() == peer.keys()
            for key in mine:
                for k in mine[key]:
                    torch.testing.assert_close(mine[key][k], peer[key][k], msg=f"{name}: state {key} {k} rank {r}")


def _reference(ranks: list[int], steps: int) -> ReferenceEBC:
    """The reference trained on the batches of `ranks` alone."""
    ref = ReferenceEBC(PERIODIC_TABLES, PERIODIC_OPT, SEED)
    for per_rank, upstream in random_batches(PERIODIC_TABLES, BATCH_SIZES, steps, SEED)[:steps]:
        glob = {
            f: tuple(
                torch.cat([per_rank[r][f][i] for r in ranks]) if per_rank[0][f][i] is not None else None
                for i in range(3)
            )
            for f in per_rank[0]
        }
        ref.step(glob, {f: torch.cat([upstream[r][f] for r in ranks]) for f in upstream[0]})
    return ref


def _state_of(ref: ReferenceEBC, name: str, r0: int, rows: int, c0: int, cols: int | None, key: str) -> torch.Tensor:
    return ref.optimizer_state(name, r0, rows, c0, cols)[key]


def test_periodic_drifts_then_averages():
    """Model-parallel tables: before the averaging each group equals the reference trained on its group's batches
    (ranks 0-1, 2-3), after it the mean of those; the data-parallel table equals the reference trained on the whole
    world's batches throughout; the averaging forward looks up the averaged weights."""
    results = [r["periodic"] for r in _results()]
    groups = [_reference([2 * g, 2 * g + 1], PERIODIC_EVERY) for g in range(WORLD // 2)]
    world = _reference(list(range(WORLD)), PERIODIC_EVERY)
    dp = {t.name for t in PERIODIC_TABLES if TYPES[t.name] is DP}

    def want(name: str, group: int | None, of=lambda r, n: r.weights[n]) -> torch.Tensor:
        if name in dp:
            return of(world, name)
        return of(groups[group], name) if group is not None else sum(of(r, name) for r in groups) / len(groups)

    assert all(r["differences"][0] > 1e-4 and r["differences"][1] == 0.0 for r in results), [
        r["differences"] for r in results
    ]
    for rank, res in enumerate(results):
        for when, group in (("before", rank // 2), ("after", None)):
            weights, states = res[when]
            for t in PERIODIC_TABLES:
                torch.testing.assert_close(
                    weights[t.name].double(), want(t.name, group), **CLOSE, msg=f"rank {rank} {when}: {t.name}"
                )
            for (name, r0, c0), st in states.items():
                for k, v in st.items():
                    rows, cols = v.shape[0], (v.shape[1] if v.dim() == 2 else None)
                    of = functools.partial(_state_of, r0=r0, rows=rows, c0=c0, cols=cols, key=k)
                    state = want(name, group, of)
                    torch.testing.assert_close(v.double(), state.double(), **CLOSE, msg=f"{when}: {name} {k}")
    avg = ReferenceEBC(PERIODIC_TABLES, PERIODIC_OPT, SEED)
    for t in PERIODIC_TABLES:
        avg.weights[t.name] = want(t.name, None)
    per_rank, _ = random_batches(PERIODIC_TABLES, BATCH_SIZES, PERIODIC_EVERY + 1, SEED)[PERIODIC_EVERY]
    for rank, res in enumerate(results):
        for f, w in avg.forward(per_rank[rank]).items():
            torch.testing.assert_close(res["outputs"][f].double(), w.detach(), **CLOSE, msg=f"rank {rank} {f}")
