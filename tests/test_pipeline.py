"""The training pipeline (embshard/training/pipeline.py) on 2 processes (gloo; NCCL with EMBSHARD_TEST_DEVICE=cuda), on a
DLRM-DCNv2 over a mixed plan (table-wise, column-wise, row-wise, table-row-wise, data-parallel; weighted and
mean-pooled features):

- a hand-written plain loop, mode none and mode sparse_dist give the same losses step for step and the same
  weights (bitwise on the CPU), also when one rank's data ends two batches before the other's (it feeds empty
  batches, every rank stops at the same step, `progress` returns None everywhere);
- semi_sync: the lookup of batch i+1 reads exactly the tables before batch i's sparse update (checked against
  eval-mode lookups of a plain run), and the loss falls;
- evaluation with a different number of held-out batches per rank (`even_batches`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
from dist_harness import device_kind, run_distributed

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.config.data import SyntheticConfig
from embshard.config.model import DCNConfig, DLRMConfig, ModelConfig
from embshard.spec.plan import MemoryTier, ShardingType

TABLES = (
    TableConfig("m_tw", 300, 8, ("g_a",)),
    TableConfig("m_cw", 200, 16, ("g_b", "g_c"), pooling="mean", ids_per_bag=2),
    TableConfig("m_rw", 611, 12, ("g_d",), weighted=True, ids_per_bag=2),
    TableConfig("m_twrw", 450, 4, ("g_e",), pooling="mean", ids_per_bag=3),
    TableConfig("m_dp", 10, 8, ("g_f",), ids_per_bag=2),
)
TYPES = {
    "m_tw": ShardingType.TABLE_WISE,
    "m_cw": ShardingType.COLUMN_WISE,
    "m_rw": ShardingType.ROW_WISE,
    "m_twrw": ShardingType.TABLE_ROW_WISE,
    "m_dp": ShardingType.DATA_PARALLEL,
}
MODEL = ModelConfig("dlrm_dcnv2", TABLES, dlrm=DLRMConfig((16,), (16,)), dcn=DCNConfig(num_layers=2, low_rank=4))
DATA = SyntheticConfig(num_dense=4, zipf_exponent=0.5)
BATCH = 32
UNEVEN = [5, 3]  # batches of rank 0 and rank 1


def _build(rank, world, device, tables=TABLES, types=TYPES):
    """The DLRM-DCNv2 of `tables` (default: this file's mixed plan) planned with `types`, and its dense Adagrad."""
    from embshard.config.run import DenseOptimizerConfig
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    plan = simple_plan(list(tables), world, world, types, tier=tier, column_shards=2)
    torch.manual_seed(77 + rank)  # must not matter: every weight is seeded
    cfg = MODEL if tables is TABLES else replace(MODEL, tables=tuple(tables))
    model = RecModel(cfg, DATA.num_dense, plan, FusedOptimizerConfig("rowwise_adagrad", lr=0.1), device, world, 5)
    return model, make_dense_optimizer(DenseOptimizerConfig("adagrad", lr=0.05), model.dense_parameters())


def _batches(rank, n, tables=TABLES, bags=None):
    """This rank's first n synthetic batches of `tables` (bag lengths: DATA's, or `bags`)."""
    from embshard.data.synthetic import SyntheticSource

    data = DATA if bags is None else replace(DATA, bag_lengths=bags)
    return itertools.islice(SyntheticSource(data, tables, BATCH, seed=3, rank=rank).train_batches(0), n)


def _plain(rank, world, device, n):
    """The loop without a pipeline: each batch copied, stepped, backward, optimizer; empty batches at the end."""
    from embshard.training.pipeline import empty_batch

    model, opt = _build(rank, world, device)
    batches = list(_batches(rank, n[rank])) + [empty_batch(model)] * (max(n) - n[rank])
    losses = []
    for step, batch in enumerate(batches, 1):
        model.ebc.set_step(step)
        out = model.step(batch.to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.detach().cpu())
    return losses, model


def _piped(rank, world, device, mode, n, hook=None):
    from embshard.training.pipeline import TrainPipeline

    model, opt = _build(rank, world, device)
    if hook is not None:
        model.ebc.register_forward_hook(hook)
    pipe = TrainPipeline(model, opt, mode)
    batches = _batches(rank, n[rank])
    losses, sizes = [], []
    while (done := pipe.progress(batches)) is not None:
        losses.append(done.output.loss.detach().cpu())
        sizes.append(done.size)
    assert pipe.progress(batches) is None  # stays ended
    pipe.close()
    return losses, sizes, model


def _state(model):
    return {
        "tables": model.ebc.full_weights(),
        "dense": {k: v.cpu() for k, v in model.dense_module().state_dict().items()},
    }


def _pooled(out):
    return out.values().detach().cpu().clone() if hasattr(out, "values") and callable(out.values) else out


def _worker(rank, world, device):
    res = {}
    model, _ = _build(rank, world, device)  # the initial tables of every sharding type, and the replicas
    res["init"] = (
        model.ebc.full_weights(),
        {n: w.cpu().clone() for n, _, w in model.ebc.local_shards() if n == "m_dp"},
    )
    losses, model = _plain(rank, world, device, UNEVEN)
    res["plain"] = (losses, _state(model))
    for mode in ("none", "sparse_dist"):
        losses, sizes, model = _piped(rank, world, device, mode, UNEVEN)
        res[mode] = (losses, _state(model), sizes)

    # semi_sync staleness: the pooled embeddings it trains steps 2 and 3 on ...
    seen = []
    _, _, _ = _piped(rank, world, device, "semi_sync", [4, 4], hook=lambda _m, _i, out: seen.append(_pooled(out)))
    res["semi_seen"] = seen[1:3]
    # ... are those of the tables before step 1's update (batch 2) and after step 1's only (batch 3).
    from embshard.training.pipeline import TrainPipeline

    model, opt = _build(rank, world, device)
    b = [x.to(device) for x in _batches(rank, 3)]
    with torch.no_grad():
        want2 = _pooled(model.ebc(b[1].sparse))
    pipe = TrainPipeline(model, opt, "none")
    pipe.progress(iter(b[:1]))
    pipe.close()
    with torch.no_grad():
        want3 = _pooled(model.ebc(b[2].sparse))
    res["semi_want"] = [want2, want3]

    # semi_sync trains
    losses, _, _ = _piped(rank, world, device, "semi_sync", [60, 60])
    res["semi_losses"] = losses

    # evaluation with 3 held-out batches on rank 0 and 1 on rank 1
    from embshard.training.train import evaluate

    class Held:
        def eval_batches(self):
            return _batches(rank + 10, 3 if rank == 0 else 1)

    res["eval"] = evaluate(model, Held(), device)
    return res


def test_pipeline_modes_on_two_ranks():
    from embshard.lookup import init_rows

    results = run_distributed(_worker, 2)
    exact = device_kind() == "cpu"
    for t, i in zip(TABLES, range(len(TABLES))):  # every sharding type starts with the rows of the full table
        full = init_rows(t, i, 0, t.num_embeddings, 0, t.embedding_dim, 5)
        for rank, res in enumerate(results):
            assert torch.equal(res["init"][0][t.name], full), f"rank {rank}: initial {t.name} ({TYPES[t.name].value})"
    assert torch.equal(results[0]["init"][1]["m_dp"], results[1]["init"][1]["m_dp"])
    for rank, res in enumerate(results):
        plain_losses, plain_state = res["plain"]
        assert len(plain_losses) == max(UNEVEN)
        for mode in ("none", "sparse_dist"):
            losses, state, sizes = res[mode]
            assert sizes == [BATCH] * UNEVEN[rank] + [0] * (max(UNEVEN) - UNEVEN[rank]), (mode, sizes)
            assert len(losses) == len(plain_losses)
            for step, (a, b) in enumerate(zip(losses, plain_losses), 1):
                if exact:
                    assert torch.equal(a, b), f"rank {rank} {mode} step {step}: loss {a} vs plain {b}"
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for kind in ("tables", "dense"):
                for name, w in plain_state[kind].items():
                    if exact:
                        assert torch.equal(state[kind][name], w), f"rank {rank} {mode}: {kind} {name} differs"
                    else:
                        torch.testing.assert_close(state[kind][name], w, rtol=1e-5, atol=1e-6)
        assert all(torch.isfinite(x) for x in plain_losses)
        for step, (got, want) in enumerate(zip(res["semi_seen"], res["semi_want"]), 2):
            assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=1e-6), (
                f"rank {rank}: semi_sync step {step} did not read the tables before step {step - 1}'s update"
            )
        semi = torch.stack(res["semi_losses"])
        assert semi[-10:].mean() < semi[:10].mean() - 0.02, semi.tolist()
    # both ranks see the same global metrics; every held-out sample counted once
    assert results[0]["eval"] == results[1]["eval"]
    assert results[0]["eval"]["samples"] == 4 * BATCH and 0.0 <= results[0]["eval"]["auc"] <= 1.0


def _stopped_early(rank, world, device):
    """Train 3 of 6 batches (a schedule that ends before the data, as `embshard train` does), then close: the
    next batch's agreement, started on every rank with the last training batch, is waited for by close()."""
    from embshard.training.pipeline import TrainPipeline

    model, opt = _build(rank, world, device)
    pipe = TrainPipeline(model, opt, "sparse_dist")
    batches = _batches(rank, 6)
    for _ in range(3):
        assert pipe.progress(batches) is not None
    handle = pipe._agreement.handle
    waited = []
    wait = handle.wait
    handle.wait = lambda host=False: waited.append(host) or wait(host)
    pipe.close()
    return waited, pipe._agreement, handle._work


def test_close_waits_for_the_agreement_in_flight():
    """No all-gather outlives the training loop: a gloo work still referenced at interpreter shutdown aborted the
    process after a finished job (about one run in thirty under load)."""
    for waited, agreement, work in run_distributed(_stopped_early, 2):
        assert waited == [True] and agreement is None and work is None
