"""Dense parts of the configured models: DLRM-DCNv2's cross network path and the two-tower losses."""

from __future__ import annotations

import paths
import torch

from embshard.models.dcn import DLRMDCNDense
from embshard.models.two_tower import TwoTowerDense, bce_scores, in_batch_softmax_loss


def test_dcn_dense_shapes_and_gradients():
    torch.manual_seed(0)
    model = DLRMDCNDense(num_dense=5, sparse_width=24, dense_width=8, bottom=[16], top=[16], num_layers=2, low_rank=4)
    dense = torch.randn(6, 5)
    sparse = torch.randn(6, 24, requires_grad=True)
    out = model(dense, sparse)
    assert out.shape == (6,)
    out.sum().backward()
    assert sparse.grad is not None and sparse.grad.abs().sum() > 0
    # the cross network is x_{l+1} = x0 * (W (V x_l) + b) + x_l: check one layer by hand
    cross = model.cross
    x0 = torch.randn(3, 32)
    w, v, b = cross.W_kernels[0], cross.V_kernels[0], cross.bias[0]
    x1 = x0 * (x0 @ v.t() @ w.t() + b) + x0
    x2 = x0 * (x1 @ cross.V_kernels[1].t() @ cross.W_kernels[1].t() + cross.bias[1]) + x1
    torch.testing.assert_close(cross(x0), x2)


def test_two_tower_losses():
    torch.manual_seed(1)
    towers = TwoTowerDense(12, 6, [8, 4], [8, 4])
    user, item = towers(torch.randn(5, 12), torch.randn(5, 6))
    assert user.shape == item.shape == (5, 4)
    torch.testing.assert_close(bce_scores(user, item), torch.stack([user[i] @ item[i] for i in range(5)]))
    loss, logits, target = in_batch_softmax_loss(user, item, temperature=0.5)
    manual = torch.stack([-(torch.log_softmax(user[i] @ item.t() / 0.5, 0)[i]) for i in range(5)]).mean()
    torch.testing.assert_close(loss, manual)
    assert logits.shape == (5, 5) and torch.equal(target, torch.arange(5))


def test_every_config_kind_has_a_registered_model():
    import pytest

    from embshard.config.model import BUILTIN_KINDS
    from embshard.models.registry import model_kind
    from embshard.spec.tables import ConfigError

    for kind in BUILTIN_KINDS:
        assert callable(model_kind(kind).build_dense) and callable(model_kind(kind).step), kind
    assert model_kind("two_tower").output_groups is not None and model_kind("dlrm").output_groups is None
    with pytest.raises(ConfigError, match=r"model.kind='nope' has no model: known kinds are \['dlrm', 'dlrm_dcnv2'"):
        model_kind("nope")


def test_register_model_from_user_code():
    """A kind registered from Python is accepted by ModelConfig (and a YAML config read afterwards) and found by
    RecModel's lookup; built-in names and non-ModelKind values are refused; registering again replaces."""
    import pytest

    from embshard.config import load_config
    from embshard.config.model import ModelConfig
    from embshard.models import ModelKind, bce_output, model_kind, register_model
    from embshard.spec.tables import ConfigError, TableConfig

    tables = (TableConfig("t", 10, 4, ("f",)),)
    with pytest.raises(ConfigError, match=r"kind='test_mlp' is invalid: choose one of \['dlrm', 'dlrm_dcnv2', 'two_"):
        ModelConfig(kind="test_mlp", tables=tables)
    first = ModelKind(build_dense=lambda cfg, n: torch.nn.Linear(n + 4, 1), step=lambda m, b: bce_output(b, b))
    register_model("test_mlp", first)
    assert ModelConfig(kind="test_mlp", tables=tables).kind == "test_mlp" and model_kind("test_mlp") is first
    second = ModelKind(build_dense=first.build_dense, step=first.step)
    register_model("test_mlp", second)
    assert model_kind("test_mlp") is second
    yaml = paths.ROOT / "configs" / "dlrm_criteo.yaml"
    assert load_config(yaml, ["model.kind=test_mlp", "model.dlrm=null"]).model.kind == "test_mlp"
    with pytest.raises(ConfigError, match="other than the built-in kinds"):
        register_model("dlrm", first)
    with pytest.raises(TypeError, match="takes a ModelKind"):
        register_model("x", first.build_dense)


def test_compiled_dense_trains_like_the_eager_one():
    """compile_dense's forward (embshard/training/model_graphs.py): compiled for the training batch size (bf16 autocast, 20 Adam steps: the
    same losses as the eager copy within bf16 rounding), eager for any other batch size (bit for bit)."""
    import copy

    import pytest

    from embshard.training.model_graphs import CompiledForBatch

    if not torch.cuda.is_available():
        pytest.skip("torch.compile of the dense part is CUDA only (the CPU runs eagerly)")
    torch.manual_seed(3)
    dev = torch.device("cuda", 0)
    eager = DLRMDCNDense(13, 26 * 16, 16, [64, 16], [64, 32], num_layers=2, low_rank=8).to(dev)
    fast = copy.deepcopy(eager)
    fast.forward = CompiledForBatch(fast.forward, "default", 256)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, fast)]
    losses = {0: [], 1: []}
    for _ in range(20):
        dense, sparse = torch.randn(256, 13, device=dev), torch.randn(256, 26 * 16, device=dev)
        labels = torch.randint(0, 2, (256,), device=dev).float()
        for i, (model, opt) in enumerate(zip((eager, fast), opts)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).float(), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[i].append(float(loss))
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        x, y = torch.randn(7, 13, device=dev), torch.randn(7, 26 * 16, device=dev)
        assert torch.equal(fast(x, y), fast.forward._eager(x, y))  # another shape: the eager forward


def test_cross_network_is_torchrecs_in_fewer_passes():
    """The cross network has torchrec's LowRankCrossNet's parameters and arithmetic (fp32: equal within rounding,
    random biases); under bf16 autocast its running sum is fp32 (as torchrec's, which its fp32 bias promotes): its
    output is within bf16 rounding of torchrec's, and the fused running-sum kernel (embshard.kernels.cross, which
    runs here under Triton's interpreter where the tests set it, else on CUDA) gives the torch ops' forward and
    gradients."""
    from torchrec.modules.crossnet import LowRankCrossNet

    torch.manual_seed(4)
    ours = DLRMDCNDense(5, 24, 8, [16], [16], num_layers=3, low_rank=4).cross
    ref = LowRankCrossNet(32, 3, 4)
    for p in ref.bias:
        torch.nn.init.normal_(p)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 32)
    torch.testing.assert_close(ours(x), ref(x))  # fp32
    xb = x.bfloat16().requires_grad_(True)
    runs = {}
    for name, fused in (("fused", True), ("torch", False)):
        ours.fused = fused
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ours(xb)
        grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, 32)).sum(), [xb, *ours.parameters()])
        runs[name] = (out, grads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slow = ref(xb)
    assert slow.dtype == torch.float32 and runs["torch"][0].dtype == torch.float32
    for name in runs:
        torch.testing.assert_close(runs[name][0].float(), slow, rtol=3e-2, atol=3e-2)
    fused, plain = runs["fused"], runs["torch"]  # within bf16 rounding (the interpreter rounds bf16 its own way)
    torch.testing.assert_close(fused[0].float(), plain[0].bfloat16().float(), rtol=3e-2, atol=1e-1)
    for a, b in zip(fused[1], plain[1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=1e-1)


def test_fused_cross_sum_is_the_torch_arithmetic():
    """embshard.kernels.cross.cross_sum against torch's ops, forward and backward (fp16 factors, whose rounding the
    interpreter shares with the GPU; bf16 on GPUs), with a gradient on either output or both; the first layer's
    form (x is x0) and the last's (no fp32 sum written)."""
    import pytest

    from embshard.kernels.cross import cross_sum, fused_available

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(9)
    for lo in (torch.float16, torch.bfloat16) if dev.type == "cuda" else (torch.float16,):
        x = torch.randn(37, 29, generator=g).to(dev).requires_grad_(True)  # 1,073 elements: a partial block
        x0 = torch.randn(37, 29, generator=g).to(dev, lo).requires_grad_(True)
        y = torch.randn(37, 29, generator=g).to(dev, lo).requires_grad_(True)
        if not fused_available(x, x0, y):
            pytest.skip("the fused kernel needs a CUDA GPU or Triton's interpreter")
        out, out_lo = cross_sum(x, x0, y)
        ref = x.detach() + x0.detach().float() * y.detach().float()
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(out_lo, out.to(lo)) and out.dtype == torch.float32 and out_lo.dtype == lo
        for w_out, w_lo in ((1.0, 0.0), (0.0, 1.0), (0.5, 2.0)):
            g_out = torch.randn(37, 29, generator=g).to(dev)
            g_lo = torch.randn(37, 29, generator=g).to(dev, lo)
            o, o_lo = cross_sum(x, x0, y)
            terms = ([(o * g_out).sum()] if w_out else []) + ([(o_lo.float() * g_lo.float()).sum()] if w_lo else [])
            gx, gx0, gy = torch.autograd.grad(sum(terms), [x, x0, y])
            total = (g_out if w_out else 0) + (g_lo.float() if w_lo else 0)
            torch.testing.assert_close(gx, total * torch.ones_like(gx))
            torch.testing.assert_close(gx0, (total * y.detach().float()).to(lo))
            torch.testing.assert_close(gy, (total * x0.detach().float()).to(lo))
        # the first layer (the running sum is x0 itself: one gradient for it) and the last (no fp32 sum kept)
        g_lo = torch.randn(37, 29, generator=g).to(dev, lo)
        for first in (True, False):
            for keep in (True, False):
                s, s_lo = cross_sum(None if first else x, x0, y, keep_sum=keep)
                base = x0.detach().float() if first else x.detach()
                ref = base + x0.detach().float() * y.detach().float()
                assert (s is None) == (not keep) and torch.equal(s_lo, ref.to(lo)), (first, keep)
                if keep:
                    torch.testing.assert_close(s, ref, rtol=1e-6, atol=1e-6)
                g_out = torch.randn(37, 29, generator=g).to(dev)
                loss = (s_lo.float() * g_lo.float()).sum() + ((s * g_out).sum() if keep else 0)
                inputs = [x0, y] if first else [x, x0, y]
                grads = torch.autograd.grad(loss, inputs)
                total = g_lo.float() + (g_out if keep else 0)
                gx0_ref = total * y.detach().float() + (total if first else 0)  # first: x0's own gradient too
                torch.testing.assert_close(grads[-2], gx0_ref.to(lo), rtol=1e-2, atol=1e-2)
                torch.testing.assert_close(grads[-1], (total * x0.detach().float()).to(lo))
                if not first:
                    torch.testing.assert_close(grads[0], total)


def test_models_import_nothing_from_the_training_loop():
    """The model is built and steps without the training loop: the step's CUDA graphs and the compiled dense
    forward are the loop's (embshard/training/model_graphs.py); no module of embshard/models imports embshard.training,
    at the top or inside a function."""
    import ast
    from pathlib import Path

    import embshard.models

    found = []
    for path in sorted(Path(embshard.models.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("embshard.training")]
    assert found == [], found
