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
    from embshard.tables import ConfigError

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
    from embshard.tables import ConfigError, TableConfig

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
    """RecModel.compile_dense's forward: compiled for the training batch size (bf16 autocast, 20 Adam steps: the
    same losses as the eager copy within bf16 rounding), eager for any other batch size (bit for bit)."""
    import copy

    import pytest

    from embshard.models.build import _CompiledForBatch

    if not torch.cuda.is_available():
        pytest.skip("torch.compile of the dense part is CUDA only (the CPU runs eagerly)")
    torch.manual_seed(3)
    dev = torch.device("cuda", 0)
    eager = DLRMDCNDense(13, 26 * 16, 16, [64, 16], [64, 32], num_layers=2, low_rank=8).to(dev)
    fast = copy.deepcopy(eager)
    fast.forward = _CompiledForBatch(fast.forward, "default", 256)
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
    random biases); under bf16 autocast its running sum is fp32 (as torchrec's, which its fp32 bias promotes) and
    its output within bf16 rounding of torchrec's."""
    from torchrec.modules.crossnet import LowRankCrossNet

    torch.manual_seed(4)
    ours = DLRMDCNDense(5, 24, 8, [16], [16], num_layers=3, low_rank=4).cross
    ref = LowRankCrossNet(32, 3, 4)
    for p in ref.bias:
        torch.nn.init.normal_(p)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(9, 32)
    torch.testing.assert_close(ours(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, slow = ours(x.bfloat16()), ref(x.bfloat16())
    assert fast.dtype == slow.dtype == torch.float32
    torch.testing.assert_close(fast, slow, rtol=3e-2, atol=3e-2)
    ours.bf16_residual = True  # model.dcn.bf16_residual: the running sum in bf16, within bf16 rounding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = ours(x.bfloat16())
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), slow, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ours(x), ref(x))  # fp32: the option changes nothing
