"""The whole training step as one CUDA graph (embshard/training/step_graph.py, training.graph_scope step) trains like the
eager step, with a column-wise table (two column blocks, the exact row-wise Adagrad update) beside table-wise and
data-parallel ones, on 2 processes (and on 1: both blocks on one rank), for 20 steps of fixed bags (the first eager, the second warms up on the capture stream
and captures, then replays) and through the steps where one rank's data has ended (other counts: eager again);
fp32 and bf16. With ragged bags the graph is given up after `max_changes` steps of changing counts and training
goes on the other way, with the same losses, where the batches cannot be padded (mean pooling); where they can, the
ragged batches are padded to a capacity per feature (filler ids of weight 0) and the whole step replays for them,
again with the eager step's losses and weights. On the CPU, where CUDA graphs do not exist, the same step runs
without capture (`StepGraph(capture=False)`: the same id exchange sized from the host's counts, lookups, dense
step, embedding backward and optimizers) and is checked against the eager step instead.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dist_harness import device_kind, run_distributed
from test_pipeline import BATCH, _state
from test_pipeline import _batches as pipeline_batches
from test_pipeline import _build as build_model

from embshard import TableConfig
from embshard.spec.plan import ShardingType

TABLES = (
    TableConfig("s_tw", 300, 8, ("h_a",), ids_per_bag=3),
    TableConfig("s_tw2", 500, 8, ("h_b", "h_c"), ids_per_bag=2),
    TableConfig("s_w", 211, 8, ("h_d",), weighted=True, ids_per_bag=4),
    TableConfig("s_dp", 12, 8, ("h_e",), ids_per_bag=2),
)
# s_tw2 column-wise (two column blocks: on both ranks at world 2), the rest table-wise
TYPES = {"s_dp": ShardingType.DATA_PARALLEL, "s_tw2": ShardingType.COLUMN_WISE}
STEPS = [22, 20]  # batches of rank 0 and rank 1: steps 21 and 22 have other counts (rank 1 feeds empty batches)


MEAN_TABLES = tuple(replace(t, pooling="mean") if t.name == "s_tw2" else t for t in TABLES)


def _train(rank, world, device, whole: bool, precision: str, bags: str = "fixed", tables=TABLES):
    from embshard.training.dense_graph import DenseGraphStep
    from embshard.training.model_graphs import ModelGraphs
    from embshard.training.pipeline import TrainPipeline
    from embshard.training.step_graph import StepGraph

    model, opt = build_model(rank, world, device, tables, TYPES)
    graphs = ModelGraphs(model)
    if whole:
        if device.type == "cuda":  # as `embshard train` sets it up: the dense update overlapped (graph_overlap)
            assert graphs.capture_dense_step(opt, BATCH, precision == "bf16") is None
            assert graphs.capture_whole_step(overlap=True) is None
            graphs.whole.max_changes = 4
        else:  # the graphs' steps without capture
            graphs.dense = DenseGraphStep(model.dense_module(), opt, BATCH, precision == "bf16", capture=False)
            graphs.whole = StepGraph(model, graphs.dense, capture=False, max_changes=4)
    pipe = TrainPipeline(model, opt, "sparse_dist", precision=precision, graphs=graphs)
    batches = pipeline_batches(rank, STEPS[rank], tables, bags)
    losses, whole_steps = [], 0
    while (done := pipe.progress(batches)) is not None:
        losses.append(float(done.output.loss.detach()))
        whole_steps += int(done.output.updated)
    pipe.close()
    graph = graphs.whole
    info = (
        (whole_steps, graph.replays, graph.captures, graph.given_up, graph.backward_parts)
        if graph is not None
        else None
    )
    graphs.release()
    return losses, _state(model), info


def _worker(rank, world, device):
    res = {(False, p): _train(rank, world, device, False, p) for p in ("fp32", "bf16")}
    res.update({(True, p): _train(rank, world, device, True, p) for p in ("fp32", "bf16")})
    res["ragged"] = _train(rank, world, device, False, "fp32", "poisson")
    res["ragged whole"] = _train(rank, world, device, True, "fp32", "poisson")
    res["mean ragged"] = _train(rank, world, device, False, "fp32", "poisson", MEAN_TABLES)
    res["mean ragged whole"] = _train(rank, world, device, True, "fp32", "poisson", MEAN_TABLES)
    return res


def _close(a, b, rtol, atol):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_whole_step_graph_trains_like_the_eager_step():
    results = run_distributed(_worker, 2)
    cuda = device_kind() == "cuda"
    for rank, res in enumerate(results):
        # fp32: on the CPU the same arithmetic as the eager step; on GPUs 20 steps of the same model trained twice
        # (atomics in the embedding backward, kernels picked under capture) may drift by rounding
        fp32 = (1e-5, 1e-6) if not cuda else (1e-4, 1e-5)
        for precision, (rtol, atol) in (("fp32", fp32), ("bf16", (2e-2, 2e-3))):
            eager_losses, eager_state, _ = res[(False, precision)]
            losses, state, (whole_steps, replays, captures, given_up, parts) = res[(True, precision)]
            assert len(losses) == max(STEPS), (rank, precision, losses)
            assert parts == 2  # the pooled exchange's backward, then the lookups' (the dense update issued between)
            # step 1 eager (its counts are new), steps 2-20 the whole step (2 warms up and captures), 21-22 eager
            assert whole_steps == min(STEPS) - 1 and given_up is None, (rank, precision, whole_steps, given_up)
            assert (replays, captures) == ((min(STEPS) - 2, 1) if cuda else (0, 0)), (replays, captures)
            _close(torch.tensor(losses), torch.tensor(eager_losses), rtol, atol)
            _close(state["dense"], eager_state["dense"], rtol, atol)
            _close(state["tables"], eager_state["tables"], rtol, atol)
            assert losses[-1] < losses[0], (rank, precision, losses)  # it trains
        # ragged bags: counts change every step. Padded to a capacity (step 1 eager, step 2 sets the capacity, then
        # the padded whole step; a batch over the capacity grows it and runs eagerly): the eager step's training
        eager_losses, eager_state, _ = res["ragged"]
        losses, state, (whole_steps, replays, captures, given_up, _) = res["ragged whole"]
        assert given_up is None and whole_steps >= min(STEPS) - 6, (whole_steps, given_up)
        assert (replays > 0 and captures >= 1) if cuda else (replays, captures) == (0, 0), (replays, captures)
        _close(torch.tensor(losses), torch.tensor(eager_losses), *fp32)
        _close(state["dense"], eager_state["dense"], *fp32)
        _close(state["tables"], eager_state["tables"], *fp32)
        # mean pooling cannot be padded: the graph is given up after 4 changes, and the losses are the eager ones
        eager_losses, eager_state, _ = res["mean ragged"]
        losses, state, (whole_steps, replays, _, given_up, _) = res["mean ragged whole"]
        assert whole_steps == 0 and replays == 0 and "ragged bags" in given_up and "mean" in given_up, given_up
        _close(torch.tensor(losses), torch.tensor(eager_losses), *fp32)
        _close(state["tables"], eager_state["tables"], *fp32)


def _one_rank_worker(rank, world, device):
    return {
        (whole, bags): _train(rank, world, device, whole, "fp32", bags)
        for whole in (False, True)
        for bags in ("fixed", "poisson")
    }


def test_whole_step_graph_on_one_rank_trains_like_the_eager_step():
    """World 1 (both column blocks of the column-wise table on one rank): fixed bags and padded ragged bags."""
    ((res),) = run_distributed(_one_rank_worker, 1)
    cuda = device_kind() == "cuda"
    fp32 = (1e-4, 1e-5) if cuda else (1e-5, 1e-6)
    for bags in ("fixed", "poisson"):
        eager_losses, eager_state, _ = res[(False, bags)]
        losses, state, (whole_steps, replays, captures, given_up, _) = res[(True, bags)]
        assert given_up is None and whole_steps >= min(STEPS) - 6, (bags, whole_steps, given_up)
        assert (replays > 0 and captures >= 1) if cuda else (replays, captures) == (0, 0), (bags, replays, captures)
        _close(torch.tensor(losses), torch.tensor(eager_losses), *fp32)
        _close(state["dense"], eager_state["dense"], *fp32)
        _close(state["tables"], eager_state["tables"], *fp32)


def _refusal_worker(rank, world, device):
    from embshard.training.step_graph import StepGraph, refusal

    model, opt = build_model(rank, world, device, TABLES, {**TYPES, "s_tw2": ShardingType.ROW_WISE})
    why = refusal(model)
    with pytest.raises(ValueError, match="row_wise"):
        StepGraph(model, None)
    return why


def test_whole_step_graph_refuses_a_plan_sized_on_the_device():
    (why, _) = run_distributed(_refusal_worker, 2)
    assert "['row_wise'] tables" in why and "table_wise, column_wise and data_parallel only" in why, why


def test_graph_scope_is_a_config_field():
    from embshard.config.run import TrainingConfig

    assert TrainingConfig(cuda_graph=True).graph_scope == "step"
    assert TrainingConfig(cuda_graph=True, graph_scope="dense").graph_scope == "dense"


def test_padding_spreads_the_fillers_and_keeps_every_bag():
    """A padded batch (ragged bags): every bag keeps its ids and weights in order, each feature holds its capacity,
    and the fillers (weight 0, on the first rows of the feature's table) are spread over the bags, at most
    ceil(pad / B) in any one bag: one long bag of fillers would hold up its lookup."""
    import numpy as np

    from embshard.collection.padding import FILLER_ROWS
    from embshard.sharding.exchange import parse_counts
    from embshard.training.dense_graph import DenseGraphStep
    from embshard.training.step_graph import StepGraph

    device = torch.device("cpu")
    model, opt = build_model(0, 1, device, TABLES, TYPES)
    dense = DenseGraphStep(model.dense_module(), opt, BATCH, False, capture=False)
    graph = StepGraph(model, dense, capture=False)
    batch = next(iter(pipeline_batches(0, 1, TABLES, "poisson")))
    row = model.ebc.host_counts(batch.sparse, check=False).numpy()
    counts = parse_counts(row.reshape(1, -1))
    graph.capacity = np.asarray(counts.ids[0]) + np.array([0, 37, 5, 64, 3])[: len(counts.ids[0])]
    padded, full = graph._padded(batch, counts)
    kjt, out = batch.sparse, padded.sparse
    assert (full.ids == graph.capacity).all()
    rows = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
    weighted = {f for t in TABLES if t.weighted for f in t.feature_names}
    for f in kjt.keys():
        got, own = out[f], kjt[f]
        cap, n = int(graph.capacity[graph._padder._column[f]]), int(own.lengths().sum())
        assert int(got.lengths().sum()) == cap, f
        extra = got.lengths() - own.lengths()
        assert (extra >= 0).all() and int(extra.max()) <= -(-(cap - n) // BATCH), (f, extra)
        values, weights = got.values(), got.weights()
        offsets, own_offsets = got.offsets(), own.offsets()
        for b in range(BATCH):
            lo, k = int(offsets[b]), int(own.lengths()[b])
            assert torch.equal(values[lo : lo + k], own.values()[int(own_offsets[b]) : int(own_offsets[b]) + k]), f
            want_w = own.weights()[int(own_offsets[b]) : int(own_offsets[b]) + k] if f in weighted else torch.ones(k)
            assert torch.equal(weights[lo : lo + k], want_w.float()), f
            fill = slice(lo + k, int(offsets[b + 1]))
            assert (weights[fill] == 0).all() and (values[fill] < min(rows[f], FILLER_ROWS)).all(), f


def test_ready_is_a_query_and_prepare_sizes_the_graph():
    """`ready` changes nothing (asked twice, the same answer and state); `prepare` (a step `ready` turned down)
    remembers the first of a run of equal counts, switches to padding once the counts change, grows the capacity
    for a batch over it, and gives the graph up when padding is refused and the counts keep changing."""
    import numpy as np

    from embshard.sharding.exchange import parse_counts
    from embshard.training.dense_graph import DenseGraphStep
    from embshard.training.step_graph import StepGraph

    model, opt = build_model(0, 1, torch.device("cpu"), TABLES, TYPES)
    F = len(model.ebc.features)

    def counts(ids, size=BATCH, bad=0):
        return parse_counts(np.array([[size, bad, 0, *ids]], dtype=np.int64))

    def state(g):
        cap = None if g.capacity is None else g.capacity.tolist()
        return (g._key, cap, g.changes, g.given_up, g.graph)

    def graph_of(pad=True):
        dense = DenseGraphStep(model.dense_module(), opt, BATCH, False, capture=False)
        return StepGraph(model, dense, capture=False, max_changes=2, pad=pad)

    graph, a, b = graph_of(), counts([10] * F), counts([20] * F)
    before = state(graph)
    assert graph.ready(a) is False and graph.ready(a) is False and state(graph) == before  # a query
    graph.prepare(a)  # the first of a run of equal counts: remembered
    assert graph.changes == 1 and graph.ready(a) is True and graph.ready(b) is False
    graph.prepare(a)  # a step `ready` accepts: nothing to do
    assert graph.changes == 1 and graph.capacity is None
    for ineligible in (counts([10] * F, size=BATCH - 1), counts([10] * F, bad=1)):
        assert graph.ready(ineligible) is False
        graph.prepare(ineligible)
        assert graph.changes == 1
    graph.prepare(b)  # the counts changed: padded to a capacity from now on
    cap = graph.capacity.copy()
    assert (cap >= 20).all() and graph.ready(a) and graph.ready(b) and graph.changes == 2
    over = counts([int(cap[0]) + 1] + [10] * (F - 1))
    assert graph.ready(over) is False and (graph.capacity == cap).all()  # still a query
    graph.prepare(over)  # grown: this step runs another way, the next with these counts replays
    assert graph.capacity[0] > cap[0] and graph.ready(over) and graph.given_up is None

    refused = graph_of(pad=False)  # counts that keep changing without padding: given up
    for i in range(4):
        refused.prepare(counts([10 + i] * F))
    assert "ragged bags" in refused.given_up and refused.ready(counts([13] * F)) is False
