"""training.cuda_graph (embshard/training/dense_graph.py): the dense step replayed as one CUDA graph trains like the eager
step, on 2 processes, through steps where every rank has a full batch (the first eager, the second captured, then
replays) and steps where one rank's data has ended (eager again, DistributedDataParallel); fp32 and bf16. On the CPU,
where CUDA graphs do not exist, the option falls back to the eager step and says why, and the graph's step run
without capture (`DenseGraphStep(capture=False)`: the same gradients by torch.autograd.grad, flat all-reduce and
optimizer) is checked against the eager step instead.

Its Adagrad (torch 2.11 has no fused CUDA Adagrad) is checked against torch's, bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_harness import device_kind, run_distributed
from test_pipeline import _batches, _build, _state

from embshard.config.run import TrainingConfig
from embshard.spec.tables import ConfigError

STEPS = [22, 20]  # batches of rank 0 and rank 1: steps 21 and 22 run eagerly (rank 1 feeds empty batches)


def _train(rank, world, device, graph: bool | str, precision: str):
    """`graph`: False (eager), True (the graph) or "compiled" (the graph holding torch.compile's kernels, CUDA)."""
    from embshard.training.dense_graph import DenseGraphStep
    from embshard.training.model_graphs import ModelGraphs
    from embshard.training.pipeline import TrainPipeline

    model, opt = _build(rank, world, device)
    init = _state(model)
    compiled = "default" if graph == "compiled" else None
    graphs = ModelGraphs(model)
    why_not = graphs.capture_dense_step(opt, 32, precision == "bf16", compiled) if graph else "off"
    if graph and device.type == "cpu":  # the graph's step without capture
        graphs.dense = DenseGraphStep(model.dense_module(), opt, 32, precision == "bf16", capture=False)
    pipe = TrainPipeline(model, opt, "sparse_dist", precision=precision, graphs=graphs)
    batches = _batches(rank, STEPS[rank])
    losses = []
    while (done := pipe.progress(batches)) is not None:
        losses.append(float(done.output.loss.detach()))
    pipe.close()
    replays = graphs.dense.replays if graphs.dense is not None else 0
    if graphs.dense is not None:  # the graph holds an NCCL collective: released before the group may go
        graphs.release()
        assert graphs.dense.graph is None
    return losses, _state(model), why_not, replays, init


def _worker(rank, world, device):
    graphs = (False, True, "compiled") if device.type == "cuda" else (False, True)  # torch.compile: CUDA only
    return {
        (graph, precision): _train(rank, world, device, graph, precision)
        for precision in ("fp32", "bf16")
        for graph in graphs
    }


def test_graph_step_trains_like_the_eager_step():
    results = run_distributed(_worker, 2)
    for rank, res in enumerate(results):
        # fp32: on the CPU the same arithmetic as the eager step; on GPUs 20 steps of the same model trained twice
        # (atomics in the embedding backward, kernels picked under capture) may drift by rounding
        fp32 = (1e-5, 1e-6) if device_kind() == "cpu" else (1e-4, 1e-5)
        # compiled: inductor's fused kernels round differently from the eager ones (fp32 to about 1e-6 a step)
        cases = [(True, "fp32", fp32), (True, "bf16", (2e-2, 2e-3))]
        # (in bf16 a step's loss of 32 samples to a few percent: fused kernels keep fp32 where eager rounds to bf16)
        cases += [("compiled", "fp32", (1e-3, 1e-4)), ("compiled", "bf16", (5e-2, 2e-2))]
        for graph, precision, (rtol, atol) in cases:
            if (graph, precision) not in res:
                continue  # compiled: CUDA only
            eager_losses, eager_state, _, _, init = res[(False, precision)]
            losses, state, why_not, replays, _ = res[(graph, precision)]
            assert len(losses) == max(STEPS), (rank, precision, losses)
            assert why_not == (None if device_kind() == "cuda" else "CUDA graphs need a CUDA GPU"), why_not
            assert replays == min(STEPS) - 1, (rank, precision, replays)  # steps 2-20 replayed; 1, 21, 22 eager
            case = f"rank {rank}, graph {graph}, {precision}"
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(eager_losses),
                rtol=rtol,
                atol=atol,
                msg=lambda m, case=case: f"{case}: {m}",
            )
            if graph == "compiled":  # Adagrad turns a near-zero gradient's rounding into a step of about lr, so
                # elementwise bounds do not hold: per tensor, the distance to the eager weights, relative to how far
                # the eager step moved them from the start (a missed update would be 1, a reversed one 2)
                for part in ("dense", "tables"):
                    for name, t in state[part].items():
                        ref, start = eager_state[part][name], init[part][name]
                        moved = float((ref - start).norm())
                        off = float((t - ref).norm()) / max(moved, 1e-6 * float(ref.norm()), 1e-12)
                        print(f"{case} {part} {name}: {off:.3f} of the eager update")  # shown if it fails
                        assert off < 0.5, (case, part, name, f"{off:.3f} of the eager update {moved:.3g}")
            else:
                torch.testing.assert_close(state["dense"], eager_state["dense"], rtol=rtol, atol=atol)
                torch.testing.assert_close(state["tables"], eager_state["tables"], rtol=rtol, atol=atol)
            assert losses[-1] < losses[0], (rank, precision, losses)  # it trains


def test_cuda_graph_holds_compiled_kernels_not_compiled_graphs():
    with pytest.raises(ConfigError, match="compile.*reduce-overhead.*CUDA graphs of its own.*compile default"):
        TrainingConfig(compile="reduce-overhead", cuda_graph=True)
    for mode in ("none", "default", "max-autotune-no-cudagraphs"):
        TrainingConfig(compile=mode, cuda_graph=True)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_graph_adagrad_step_is_torchs_adagrad_step(weight_decay):
    """The Adagrad step the graph captures (where torch has no fused Adagrad) updates parameters, sums and step
    counters exactly as torch's Adagrad does, over several steps of fresh random gradients."""
    from embshard.training.dense_graph import graph_optimizer_step

    g = torch.Generator().manual_seed(5)
    shapes = [(7, 3), (3,), (4, 4, 2)]
    ours = [torch.randn(s, generator=g, requires_grad=True) for s in shapes]
    ref = [p.detach().clone().requires_grad_(True) for p in ours]
    kw = dict(lr=0.05, eps=1e-8, weight_decay=weight_decay, initial_accumulator_value=0.1)
    opt, opt_ref = torch.optim.Adagrad(ours, **kw), torch.optim.Adagrad(ref, **kw)
    graph_opt = graph_optimizer_step(opt)
    assert not graph_opt.lr_in_graph  # the rate is a device tensor the graph reads
    for i in range(6):
        if i == 2:  # a rate set between steps applies from the next step on, as in torch's
            for o in (opt, opt_ref):
                o.param_groups[0]["lr"] = 0.02
        if i == 4:  # a checkpoint's load replaces the groups and the state: the step follows them
            opt.load_state_dict(opt.state_dict())
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        graph_opt.before()
        graph_opt.step()
        graph_opt.after()
        opt_ref.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), i
    for a, b in zip(ours, ref):
        assert torch.equal(opt.state[a]["sum"], opt_ref.state[b]["sum"])
        assert float(opt.state[a]["step"]) == float(opt_ref.state[b]["step"]) == 6.0


# Inductor's C++ code on a machine with an empty compile cache first probes nine instruction sets (a compile and a
# load each) and builds a precompiled header: 10 s of CPU before its first kernel, 3 s without them (scalar code).
CPU_COMPILE = {"cpp.vec_isa_ok": False, "cpp_cache_precompile_headers": False}


def test_compiled_graph_adagrad_step_is_torchs_adagrad_step():
    """With the dense step compiled (training.compile), the graph's Adagrad arithmetic is compiled too (one fused
    kernel per group of tensors instead of five passes): torch's Adagrad within fp32 rounding over several steps of
    fresh random gradients, with and without weight decay, the gradients left as they are; its warm-up compiles it
    on copies (nothing updated) so that the first real call, which a capture may hold, compiles nothing."""
    import torch._inductor.config as inductor_config

    device = torch.device(device_kind())  # on a GPU inductor's Triton kernels (its CPU code needs a C++ compiler)
    g = torch.Generator().manual_seed(11)
    with inductor_config.patch(CPU_COMPILE if device.type == "cpu" else {}):
        for weight_decay in (0.0, 0.01):
            _check_compiled_adagrad(device, weight_decay, g)


def _check_compiled_adagrad(device: torch.device, weight_decay: float, g: torch.Generator) -> None:
    from torch._dynamo.utils import counters

    from embshard.training.dense_graph import graph_optimizer_step

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)).to(device)
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ours = list(model.parameters())
    kw = dict(lr=0.05, eps=1e-8, weight_decay=weight_decay, initial_accumulator_value=0.1)
    opt, opt_ref = torch.optim.Adagrad(ours, **kw), torch.optim.Adagrad(ref, **kw)
    flat = torch.zeros(sum(p.numel() for p in ours), device=device)  # the gradients: views of one buffer
    views = [flat[o : o + p.numel()].view_as(p) for o, p in zip(np.cumsum([0] + [p.numel() for p in ours]), ours)]
    for p, v in zip(ours, views):
        p.grad = v
    graph_opt = graph_optimizer_step(opt, "default")
    start = [p.detach().clone() for p in ours]
    graph_opt.warm_up()
    assert all(torch.equal(a, b) for a, b in zip(start, ours))  # the warm-up updated nothing
    assert all(torch.equal(opt.state[p]["sum"], torch.full_like(p, 0.1)) for p in ours)  # nor the sums
    compiled = counters["stats"]["unique_graphs"]
    for _ in range(4):
        flat.copy_(torch.randn(flat.shape, generator=g))  # from the CPU generator, on any device
        for a, b in zip(ref, views):
            a.grad = b.clone()
        graph_opt.step()
        opt_ref.step()
        assert torch.equal(torch.cat([p.grad.reshape(-1) for p in ours]), flat)  # the gradients unchanged
        for a, b in zip(ours, ref):  # fp32 rounding (the fused kernel may contract multiply-adds)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == compiled  # the real calls compiled nothing more
    for a, b in zip(ours, ref):
        torch.testing.assert_close(opt.state[a]["sum"], opt_ref.state[b]["sum"], rtol=1e-5, atol=1e-6)


def test_graph_step_refuses_what_it_cannot_capture():
    from embshard.training.dense_graph import DenseGraphStep, graph_optimizer_step

    p = [torch.zeros(2, requires_grad=True)]
    assert "no fused implementation" in graph_optimizer_step(torch.optim.SGD(p, lr=0.1))
    assert "lr_decay" in graph_optimizer_step(torch.optim.Adagrad(p, lr=0.1, lr_decay=0.1))
    with pytest.raises(ValueError, match="SGD.*no fused implementation"):
        DenseGraphStep(torch.nn.Linear(2, 1), torch.optim.SGD(p, lr=0.1), 4, False, capture=False)


def test_a_changed_rate_recaptures_a_fused_step_that_holds_it():
    """A fused optimizer's captured step holds its learning rates: after a change, the next eligible step runs
    eagerly (the graph is dropped) and the one after captures again; an unchanged rate keeps replaying."""
    from embshard.training.dense_graph import DenseGraphStep

    dense = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(dense.parameters(), lr=0.1, fused=True)
    step = DenseGraphStep(dense, opt, batch_size=4, autocast_bf16=False, capture=False)
    assert step._opt.lr_in_graph and step.ready(4) is False and step.ready(4) is True
    step.graph, step._captured_lrs = "captured", [0.1]  # as a capture leaves them
    assert step.ready(4) is True and step.graph == "captured"
    opt.param_groups[0]["lr"] = 0.05
    assert step.ready(4) is False and step.graph is None  # eager now
    assert step.ready(4) is True  # captures again
