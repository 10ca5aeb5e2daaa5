"""Raw-id tables in the training pipeline (embshard/training/pipeline.py) on 2 processes: a DLRM whose raw-id tables hold
fewer ids than the data has (table-wise LRU, row-wise LFU: admitting and evicting every step) trains the same under
mode sparse_dist (the next batch's input exchange before this batch's backward) as without a pipeline: the same
losses, tables and maps, bit for bit on the CPU; semi_sync (the next batch's lookup before this batch's backward)
runs with them too, evicting (that it never evicts the previous step's rows is test_idmap's)."""

from __future__ import annotations

import itertools

import torch
from dist_harness import device_kind

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.config.data import SyntheticConfig
from embshard.config.model import DLRMConfig, ModelConfig
from embshard.spec.plan import MemoryTier

MODEL_TABLES = (
    TableConfig("a", 40, 8, ("fa",), ids="raw", ids_per_bag=2),
    TableConfig("b", 60, 8, ("fb",), ids="raw", eviction="lfu", ids_per_bag=2),
    TableConfig("c", 50, 8, ("fc",)),
)
# the data's id space: 5x the raw tables' rows (ids drawn below these)
DATA_TABLES = (
    TableConfig("a", 200, 8, ("fa",), ids_per_bag=2),
    TableConfig("b", 300, 8, ("fb",), ids_per_bag=2),
    TableConfig("c", 50, 8, ("fc",)),
)
MODEL = ModelConfig("dlrm", MODEL_TABLES, dlrm=DLRMConfig((8,), (8,)))
DATA = SyntheticConfig(num_dense=4, zipf_exponent=0.8)
STEPS = 8


def _build(world, device):
    from embshard.config.run import DenseOptimizerConfig
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    plan = simple_plan(list(MODEL_TABLES), world, sharding_types={"b": "row_wise"}, tier=tier)
    model = RecModel(MODEL, DATA.num_dense, plan, FusedOptimizerConfig("rowwise_adagrad", lr=0.1), device, world, 5)
    return model, make_dense_optimizer(DenseOptimizerConfig("adagrad", lr=0.05), model.dense_parameters())


def _batches(rank):
    from embshard.data.synthetic import SyntheticSource

    return itertools.islice(SyntheticSource(DATA, DATA_TABLES, 16, seed=3, rank=rank).train_batches(0), STEPS)


def _state(model):
    maps = {(n, s.row_offset): {k: v.cpu().clone() for k, v in st.items()} for n, s, st in model.ebc.local_id_maps()}
    return model.ebc.full_weights(), maps, model.ebc.raw_id_stats(gather=True)


def _worker(rank, world, device):
    from embshard.training.pipeline import TrainPipeline

    out = {}
    model, opt = _build(world, device)  # no pipeline
    losses = []
    for step, batch in enumerate(_batches(rank), 1):
        model.ebc.set_step(step)
        o = model.step(batch.to(device))
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        opt.step()
        losses.append(o.loss.detach().cpu())
    out["plain"] = (losses, *_state(model))
    for mode in ("sparse_dist", "semi_sync"):
        model, opt = _build(world, device)
        pipe = TrainPipeline(model, opt, mode)
        batches, losses = _batches(rank), []
        while (done := pipe.progress(batches)) is not None:
            losses.append(done.output.loss.detach().cpu())
        pipe.close()
        out[mode] = (losses, *_state(model))
    return out


def test_raw_id_tables_in_the_pipeline(run):
    exact = device_kind() == "cpu"
    for res in run(_worker, 2):
        plain_losses, plain_w, plain_maps, stats = res["plain"]
        assert stats["a"]["evicted"] > 0 and stats["b"]["evicted"] > 0  # the tables were full
        losses, w, maps, _ = res["sparse_dist"]
        tol = {"atol": 0, "rtol": 0} if exact else {}
        torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), **tol)
        for name in plain_w:
            torch.testing.assert_close(w[name], plain_w[name], **tol)
        assert maps.keys() == plain_maps.keys()
        for key, st in maps.items():
            for k, v in st.items():
                assert torch.equal(v, plain_maps[key][k]), (key, k)
        semi_losses, _, semi_maps, semi_stats = res["semi_sync"]
        assert len(semi_losses) == STEPS and all(torch.isfinite(x) for x in semi_losses)
        assert semi_stats["a"]["evicted"] > 0
