"""Sequence tables (`pooling: none`) in YAML models: RecModel serves them with a ShardedEmbeddingCollection beside the
embedding bags (model.ec, `RecModel.sequences`), a registered kind reads them (outputs and SGD updates against a
plain lookup of the full tables at 1 and 2 ranks, a history over an error-mode max_length refused naming the
feature, the training pipeline running the exchanges in the forward, semi_sync refused), kind hstu adds its side features to the item vectors (empty histories, empty batches, the side ids
changing the loss, only the side rows of the batch updated), config errors name the key, and
configs/sequential_side.yaml trains on 2 processes like on 1 and resumes on 1 process from a 2-process checkpoint
(the sequence collection saved and loaded)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import paths
import pytest
import torch
from dist_harness import run_distributed
from train_job import embshard_train

from embshard.config import load_config
from embshard.config.model import ModelConfig
from embshard.models.registry import ModelKind, StepOutput, register_model
from embshard.spec.tables import ConfigError, TableConfig

SIDE = paths.ROOT / "configs" / "sequential_side.yaml"
TINY = [
    "model.tables[0].num_embeddings=300",
    "model.tables[0].embedding_dim=16",
    "model.tables[1].num_embeddings=50",
    "model.tables[2].embedding_dim=16",
    "model.tables[2].max_length=11",
    "model.sequential.max_length=10",
    "data.sequences.max_length=10",
    "data.sequences.min_length=4",
    "schedule.eval_every=0",
    "schedule.eval_at_start=false",
    "logging.log_every=1",
    "logging.progress_bar=false",
]


class ProbeDense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def probe_step(model, batch) -> StepOutput:
    """Sum of the pooled rows plus 2 x the sum of the sequence rows (every row's gradient: 1 or 2 per id)."""
    pooled = model.ebc(model.pooled(batch.sparse)).values()
    seq = model.sequences(batch.sparse)
    return StepOutput(model.dense(pooled.sum() + 2.0 * seq["hist"].values().sum()), None, None)


register_model("sequence_probe", ModelKind(build_dense=lambda cfg, n: ProbeDense(), step=probe_step))

PROBE_TABLES = (
    TableConfig(name="t_user", num_embeddings=20, embedding_dim=4, feature_names=("user",)),
    TableConfig(
        name="t_hist",
        num_embeddings=30,
        embedding_dim=8,
        feature_names=("hist",),
        pooling="none",
        max_length=5,
        length_overflow="error",
    ),
)


def _kjt(keys, lengths_per_key, values_per_key):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor([v for vs in values_per_key for v in vs], dtype=torch.int64),
        lengths=torch.tensor([n for ns in lengths_per_key for n in ns], dtype=torch.int32),
    )


def _probe(rank: int, world: int, device: torch.device) -> dict:
    from embshard.data.common import Batch
    from embshard.models.build import RecModel
    from embshard.planner.simple import simple_plan
    from embshard.spec.optim import FusedOptimizerConfig

    cfg = ModelConfig(kind="sequence_probe", tables=PROBE_TABLES)
    types = {"t_user": "table_wise", "t_hist": "row_wise" if world > 1 else "table_wise"}
    plan = simple_plan(list(cfg.tables), world, sharding_types=types, tier="hbm" if device.type == "cuda" else "host")
    model = RecModel(cfg, 0, plan, FusedOptimizerConfig(kind="sgd", lr=0.1), device, world, seed=1)
    out = {"ec_tables": [t.name for t in model.ec.tables], "ebc_tables": [t.name for t in model.ebc.tables]}
    g = torch.Generator().manual_seed(100 + rank)
    B = 3
    hist_len = torch.randint(0, 6, (B,), generator=g).tolist()  # empty histories included
    hist_len[0] = 0
    hist = torch.randint(0, 30, (sum(hist_len),), generator=g).tolist()
    users = torch.randint(0, 20, (B,), generator=g).tolist()
    kjt = _kjt(["hist", "user"], [hist_len, [1] * B], [hist, users]).to(device)  # the sequence feature first
    before = {k: v.clone() for k, v in model.ec.full_weights().items()}
    seq = model.sequences(kjt)["hist"]
    ref = before["t_hist"][torch.tensor(hist, dtype=torch.int64)]
    out["rows_equal"] = torch.equal(seq.values().detach().cpu(), ref.cpu())
    out["lengths_equal"] = seq.lengths().tolist() == hist_len
    loss = model.step(Batch(torch.zeros(B, 0), kjt, torch.ones(B))).loss
    loss.backward()
    after = model.ec.full_weights()["t_hist"]
    counts = torch.bincount(torch.tensor(hist, dtype=torch.int64), minlength=30).float().to(device)
    if world > 1:
        torch.distributed.all_reduce(counts)
    expected = before["t_hist"] - 0.1 * 2.0 * counts.unsqueeze(1).cpu()  # SGD: 2 per id over the global batch
    out["sgd_equal"] = torch.allclose(after.cpu(), expected, atol=1e-6)
    too_long = _kjt(["user", "hist"], [[1] * 2, [2, 6 if rank == world - 1 else 1]], [[1, 2], list(range(2 + 6))])
    if rank != world - 1:
        too_long = _kjt(["user", "hist"], [[1] * 2, [2, 1]], [[1, 2], [3, 4, 5]])
    try:
        model.sequences(too_long.to(device))
        out["error"] = ""
    except ValueError as e:
        out["error"] = str(e)
    from embshard.training.pipeline import TrainPipeline

    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    try:
        TrainPipeline(model, opt, "semi_sync")
        out["semi_sync"] = ""
    except ConfigError as e:
        out["semi_sync"] = str(e)
    pipe = TrainPipeline(model, opt, "sparse_dist")
    out["ahead"] = [pipe.dist_ahead, pipe.host_counts]
    batches = iter([Batch(torch.zeros(B, 0), kjt, torch.ones(B))] * (2 + rank))  # rank 1 has one batch more
    steps = [pipe.progress(batches) for _ in range(4)]
    out["pipeline_steps"] = [s is not None for s in steps]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_registered_kind_reads_sequence_tables_like_a_plain_lookup(world):
    for rank, r in enumerate(run_distributed(_probe, world)):
        assert r["ec_tables"] == ["t_hist"] and r["ebc_tables"] == ["t_user"]
        assert r["rows_equal"] and r["lengths_equal"] and r["sgd_equal"], (rank, r)
        if rank == world - 1:  # the rank with the long history names the feature, the table and the fix
            assert re.search(r"feature 'hist': sample 1 has 6 ids, more than table 't_hist'.s max_length=5", r["error"])
        else:
            assert "every rank stops here" in r["error"]
        assert "semi_sync" in r["semi_sync"] and "sequence tables (looked up in the forward)" in r["semi_sync"]
        assert r["ahead"] == [False, False]  # the exchanges run in the forward, the counts gathered there
        assert r["pipeline_steps"] == [True] * (1 + world) + [False] * (3 - world), r["pipeline_steps"]


def _hstu(rank: int, world: int, device: torch.device) -> dict:
    from embshard.checkpoint.state import TrainState
    from embshard.data.common import Batch
    from embshard.models.build import RecModel
    from embshard.planner.simple import simple_plan
    from embshard.training.pipeline import empty_batch

    cfg = load_config(SIDE, TINY)
    plan = simple_plan(list(cfg.model.tables), world, tier="hbm" if device.type == "cuda" else "host")
    model = RecModel(cfg.model, 0, plan, cfg.sparse_optimizer, device, world, cfg.seed, cfg.lookup)
    out = {
        "collections": len(model.collections()),
        "state": sorted(TrainState.of_model(model, None).collections),
    }
    lengths = [3, 1, 0, 4]  # an empty history, and one whose single item predicts nothing
    items = [5, 17, 250, 9, 1, 2, 3, 77]
    cats = [i % 50 for i in items]

    def batch(categories):
        kjt = _kjt(["item", "user", "category"], [lengths, [1] * 4, lengths], [items, [1, 2, 3, 4], categories])
        return Batch(torch.zeros(4, 0), kjt.to(device), torch.ones(4))

    model.train()
    with torch.no_grad():
        a = float(model.step(batch(cats)).loss)
        b = float(model.step(batch([(c + 1) % 50 for c in cats])).loss)
    out["side_changes_loss"] = abs(a - b) > 1e-6
    before = model.ec.full_weights()["t_category"].clone()
    loss = model.step(batch(cats)).loss
    loss.backward()
    changed = (model.ec.full_weights()["t_category"] != before).any(1).nonzero().flatten().tolist()
    # the categories of every position but a user's last (a last item's query predicts nothing, and no earlier
    # position sees it): their rows have a gradient
    out["changed_rows"], out["used_rows"] = changed, sorted({5, 17, 1, 2, 3})
    out["finite"] = bool(torch.isfinite(loss))
    empty = model.step(empty_batch(model)).loss  # a rank whose data has ended
    empty.backward()
    out["empty"] = float(empty)
    short = _kjt(["item", "user", "category"], [lengths, [1] * 4, [3, 1, 0, 3]], [items, [1, 2, 3, 4], cats[:7]])
    try:
        model.step(Batch(torch.zeros(4, 0), short.to(device), torch.ones(4)))
        out["short"] = ""
    except ValueError as e:
        out["short"] = str(e)
    return out


def test_hstu_side_features_come_from_the_sequence_collection():
    (r,) = run_distributed(_hstu, 1)
    assert r["collections"] == 3 and r["state"] == ["catalog", "ebc", "sequences"]
    assert r["side_changes_loss"] and r["finite"] and r["empty"] == 0.0
    assert r["changed_rows"] == r["used_rows"], r  # the side rows of the batch, and only those, are updated
    assert "side feature 'category' has 7 ids in this batch but 'item' has 8" in r["short"]


def test_sequence_table_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model kind 'dlrm' pools every feature.*pooling: none"):
        load_config(paths.ROOT / "configs" / "dlrm_synthetic.yaml", ["model.tables[0].pooling=none"])
    with pytest.raises(ConfigError, match=r"tables\[2\].pooling.*side feature 'category'.*pooling: none"):
        pooled = ["model.tables[2].pooling=sum", "model.tables[2].max_length=null"]
        load_config(SIDE, [*TINY, *pooled, "model.tables[2].length_overflow=truncate"])
    with pytest.raises(ConfigError, match=r"tables\[2\].embedding_dim=8.*catalog's width 16"):
        load_config(SIDE, [*TINY, "model.tables[2].embedding_dim=8"])
    with pytest.raises(ConfigError, match=r"tables\[2\].max_length=5.*'category'.*max_length \+ 1 = 11"):
        load_config(SIDE, [*TINY, "model.tables[2].max_length=5"])
    with pytest.raises(ConfigError, match=r"feature 'category' is already looked up by table 't_user'"):
        load_config(SIDE, [*TINY, "model.tables[1].feature_names=[category]"])
    with pytest.raises(ConfigError, match=r"side_features.*no table lists this feature"):
        load_config(SIDE, [*TINY, "model.sequential.side_features=[action]"])


def test_step_mode_falls_back_from_cuda_graphs_with_sequence_tables():
    from embshard.training.mode import resolve_step_mode

    register_model(
        "sequence_probe_graph",
        ModelKind(build_dense=lambda cfg, n: ProbeDense(), step=probe_step, sparse_input=lambda m, b: b.dense),
    )
    base = paths.ROOT / "configs" / "dlrm_synthetic.yaml"
    over = ["model.kind=sequence_probe_graph", "training.precision=bf16"]
    pooled = resolve_step_mode(load_config(base, over), "cuda")
    assert pooled.scope == "step", pooled.line()
    cfg = load_config(base, [*over, "model.tables[0].pooling=none"])
    mode = resolve_step_mode(cfg, "cuda")
    assert mode.scope == "eager" and cfg.batch_counts == "device"
    assert re.search(
        r"CUDA graphs off: sequence tables \['\w+'\] \(pooling: none\) are looked up in the forward", mode.line()
    )


def _losses(out: str) -> tuple[dict[int, float], dict[str, float]]:
    train = {int(s): float(x) for s, x in re.findall(r"train step +(\d+)  loss (\S+)", out)}
    last = out[out.rindex("eval  step") :]
    return train, {k: float(v) for k, v in re.findall(r"(\S+@10|loss) ([0-9.]+)", last)}


@pytest.mark.timeout(300)
def test_side_features_train_on_two_processes_like_one_and_resume_on_one(tmp_path):
    """The global batch of every step is the same for 1 x 16 and 2 x 8 users: equal training losses, held-out loss
    and metrics. One process resumed from the 2-process run's step-3 checkpoint (every collection resharded: the
    catalog, the context bags, the sequence collection's side rows, the optimizer states, the popularity counts)
    trains steps 4-6 with the same losses and evaluates the same as the run that never stopped; 2 processes resumed
    from the 1-process run's checkpoint likewise."""
    run = ["configs/sequential_side.yaml", *TINY, "schedule.steps=6", "data.sequences.eval_batches=1"]
    ck = ["checkpoint.every=3", "checkpoint.async_save=false"]
    one = embshard_train([*run, "schedule.batch_size=16", f"checkpoint.dir={tmp_path}/ck1", *ck], 1)
    two = embshard_train([*run, "schedule.batch_size=8", f"checkpoint.dir={tmp_path}/ck", *ck], 2)
    l1, m1 = _losses(one.stdout)
    l2, m2 = _losses(two.stdout)
    assert sorted(l1) == sorted(l2) == list(range(1, 7))
    np.testing.assert_allclose([l2[s] for s in l1], list(l1.values()), rtol=0, atol=1.01e-4)  # the printed digits
    assert set(m1) == {"loss", "hr@10", "ndcg@10", "pop_hr@10", "pop_ndcg@10"}
    for k in m1:
        assert abs(m1[k] - m2[k]) <= 1.01e-4, (k, m1, m2)

    def resumed(saved: str, into: str, nproc: int) -> tuple[dict[int, float], dict[str, float]]:
        """The losses and final evaluation of `nproc` processes resumed from the step-3 checkpoint of `saved`."""
        shutil.copytree(tmp_path / saved / "step_3", tmp_path / into / "step_3")
        batch = f"schedule.batch_size={16 // nproc}"
        res = embshard_train([*run, batch, f"checkpoint.dir={tmp_path}/{into}", "checkpoint.resume_from=latest"], nproc)
        losses, metrics = _losses(res.stdout)
        assert sorted(losses) == [4, 5, 6], res.stdout
        return losses, metrics

    # Every step after the resume (not only step 4, whose loss is that of the weights saved at step 3) and the final
    # evaluation are those of the run that never stopped, to the printed digits: the optimizer states saved on 2
    # ranks are those of 1 (every row's gradient is one process's, whatever the number of ranks: the module
    # docstring of embshard/models/sequential.py), and so are the popularity counts (saved with the catalog rows);
    # and the other way: 2 processes resumed from the 1-process run's step-3 checkpoint continue the 2-process run
    for (l_got, m_got), l_want, m_want in (
        (resumed("ck", "resumed", 1), l1, m1),
        (resumed("ck1", "resumed2", 2), l2, m2),
    ):
        for s in (4, 5, 6):
            assert abs(l_got[s] - l_want[s]) <= 1.01e-4, (s, l_got, l_want)
        assert set(m_got) == set(m_want)
        for k in m_want:
            assert abs(m_got[k] - m_want[k]) <= 1.01e-4, (k, m_got, m_want)


def test_sequences_source_emits_each_items_category_for_side_features():
    from embshard.data.sequences import SequenceSource

    cfg = load_config(SIDE, TINY)
    src = SequenceSource(cfg.data.sequences, list(cfg.model.tables), 8, seed=3, rank=0, world_size=1)
    kjt = next(src.train_batches(0)).sparse
    assert list(kjt.keys()) == ["item", "user", "category"]
    items, cats = kjt["item"], kjt["category"]
    assert torch.equal(cats.lengths(), items.lengths()) and torch.equal(cats.values(), items.values() % 50)
    assert torch.equal(kjt["user"].lengths(), torch.ones(8, dtype=kjt["user"].lengths().dtype))
