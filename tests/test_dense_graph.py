"""training.cuda_graph (embshard/dense_graph.py): the dense step replayed as one CUDA graph trains like the eager
step, on 2 processes, through steps where every rank has a full batch (the first eager, the second captured, then
replays) and steps where one rank's data has ended (eager again, DistributedDataParallel); fp32 and bf16. On the CPU
the option falls back to the eager step (the same losses, bit for bit) and says why."""

from __future__ import annotations

import pytest
import torch
from dist_harness import device_kind, run_distributed
from test_pipeline import _batches, _build, _state

from embshard.config.run import TrainingConfig
from embshard.tables import ConfigError

STEPS = [8, 6]  # batches of rank 0 and rank 1: steps 7 and 8 run eagerly (rank 1 feeds empty batches)


def _train(rank, world, device, graph: bool, precision: str):
    from embshard.pipeline import TrainPipeline

    model, opt = _build(rank, world, device)
    why_not = model.capture_dense_step(opt, 32, precision == "bf16") if graph else "off"
    pipe = TrainPipeline(model, opt, "sparse_dist", precision=precision)
    batches = _batches(rank, STEPS[rank])
    losses = []
    while (done := pipe.progress(batches)) is not None:
        losses.append(float(done.output.loss.detach()))
    pipe.close()
    replays = model.dense_graph.replays if model.dense_graph is not None else 0
    return losses, _state(model), why_not, replays


def _worker(rank, world, device):
    return {
        (graph, precision): _train(rank, world, device, graph, precision)
        for precision in ("fp32", "bf16")
        for graph in (False, True)
    }


def test_graph_step_trains_like_the_eager_step():
    results = run_distributed(_worker, 2)
    for rank, res in enumerate(results):
        for precision, (rtol, atol) in (("fp32", (1e-5, 1e-6)), ("bf16", (2e-2, 2e-3))):
            eager_losses, eager_state, _, _ = res[(False, precision)]
            losses, state, why_not, replays = res[(True, precision)]
            assert len(losses) == max(STEPS), (rank, precision, losses)
            if device_kind() == "cuda":
                assert why_not is None, why_not
                assert replays == min(STEPS) - 1, (rank, precision, replays)  # steps 2-6 replayed; 1, 7, 8 eager
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=rtol, atol=atol)
                torch.testing.assert_close(state["dense"], eager_state["dense"], rtol=rtol, atol=atol)
                torch.testing.assert_close(state["tables"], eager_state["tables"], rtol=rtol, atol=atol)
            else:
                assert why_not == "CUDA graphs need a CUDA GPU" and replays == 0, (why_not, replays)
                assert losses == eager_losses, (rank, precision)
                torch.testing.assert_close(state, eager_state, rtol=0, atol=0)
            assert losses[-1] < losses[0], (rank, precision, losses)  # it trains


def test_cuda_graph_refuses_compile_reduce_overhead():
    with pytest.raises(ConfigError, match="cuda_graph.*reduce-overhead"):
        TrainingConfig(compile="reduce-overhead", cuda_graph=True)
    TrainingConfig(compile="default", cuda_graph=True)
