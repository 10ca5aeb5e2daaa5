"""A TorchRec model with an EmbeddingBagCollection and an EmbeddingCollection converted by rec_model_from_torchrec:
the EmbeddingCollection's tables become the RecModel's sequence tables, and one training step on 1 and 2 ranks
(row-wise sequence table on 2) equals the unsharded TorchRec model's: logits, dense gradients and both collections'
SGD-updated weights."""

from __future__ import annotations

import torch
from dist_harness import run_distributed
from torch import nn

LR = 0.1
B_GLOBAL = 6


class SeqModel(nn.Module):
    """forward(dense, kjt): the pooled user row, the summed rows of the history (at most 3 ids) and the dense
    features, into one logit."""

    def __init__(self, ebc: nn.Module, ec: nn.Module) -> None:
        super().__init__()
        self.sparse = ebc
        self.seq = ec
        self.dense_arch = nn.Linear(3, 4)
        self.over = nn.Linear(12, 1)

    def forward(self, dense_BN: torch.Tensor, kjt) -> torch.Tensor:
        pooled_BD = self.sparse(kjt).values()
        hist_BD = self.seq(kjt)["h"].to_padded_dense(desired_length=3).sum(1)
        return self.over(torch.cat([self.dense_arch(dense_BN), pooled_BD, hist_BD], 1))


def _model() -> SeqModel:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t_u", num_embeddings=10, embedding_dim=4, feature_names=["u"])]
    )
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t_h", num_embeddings=12, embedding_dim=4, feature_names=["h"])]
    )
    return SeqModel(ebc, ec)


def _batch(lo: int, hi: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(7)
    dense = torch.randn(B_GLOBAL, 3, generator=g)
    users = torch.randint(0, 10, (B_GLOBAL,), generator=g)
    lengths = torch.randint(0, 4, (B_GLOBAL,), generator=g)
    lengths[1] = 0  # an empty history
    ids = torch.randint(0, 12, (int(lengths.sum()),), generator=g)
    labels = (torch.rand(B_GLOBAL, generator=g) > 0.5).float()
    starts = torch.cumsum(lengths, 0) - lengths
    mine = ids[int(starts[lo]) : int(starts[hi - 1] + lengths[hi - 1])] if hi > lo else ids[:0]
    kjt = KeyedJaggedTensor(
        keys=["u", "h"],
        values=torch.cat([users[lo:hi], mine]),
        lengths=torch.cat([torch.ones(hi - lo, dtype=torch.int64), lengths[lo:hi]]).int(),
    )
    return dense[lo:hi], kjt, labels[lo:hi]


def _step(rank: int, world: int, device: torch.device) -> dict:
    from embshard import FusedOptimizerConfig, simple_plan
    from embshard.data.common import Batch
    from embshard.interop import rec_model_from_torchrec, tables_from_torchrec

    ref = _model()
    model = _model()
    tables = tables_from_torchrec(model.sparse) + tables_from_torchrec(model.seq)
    types = {"t_u": "table_wise", "t_h": "row_wise" if world > 1 else "table_wise"}
    plan = simple_plan(tables, world, sharding_types=types, tier="hbm" if device.type == "cuda" else "host")
    rec = rec_model_from_torchrec(model, plan, device, FusedOptimizerConfig(kind="sgd", lr=LR))
    b = B_GLOBAL // world
    dense, kjt, labels = _batch(rank * b, (rank + 1) * b)
    out = rec.step(Batch(dense.to(device), kjt.to(device), labels.to(device)))
    out.loss.backward()
    # the reference: every rank's mean loss summed (the embeddings' gradient: summed over ranks), the dense part's
    # gradient that sum / world (DistributedDataParallel averages)
    ref_loss, ref_logits = 0.0, []
    for r in range(world):
        d, k, y = _batch(r * b, (r + 1) * b)
        logits = ref(d, k).reshape(-1)
        ref_logits.append(logits)
        ref_loss = ref_loss + nn.functional.binary_cross_entropy_with_logits(logits, y)
    ref_loss.backward()
    res = {"logits": torch.allclose(out.scores.detach().cpu(), ref_logits[rank].detach(), atol=1e-5)}
    dense_model = rec.dense_module().model
    res["dense_grads"] = all(
        torch.allclose(p.grad.cpu(), ref.get_parameter(n).grad / world, atol=1e-5)
        for n, p in dense_model.named_parameters()
    )
    res["dense_names"] = sorted(n for n, _ in dense_model.named_parameters())
    with torch.no_grad():
        u = ref.sparse.embedding_bags["t_u"].weight
        h = ref.seq.embeddings["t_h"].weight
        res["ebc_weights"] = torch.allclose(rec.ebc.full_weights()["t_u"].cpu(), u - LR * u.grad, atol=1e-5)
        res["ec_weights"] = torch.allclose(rec.ec.full_weights()["t_h"].cpu(), h - LR * h.grad, atol=1e-5)
        res["ec_moved"] = bool((h.grad != 0).any())
    res["tables"] = ([t.name for t in rec.ebc.tables], [t.name for t in rec.ec.tables])
    return res


def test_torchrec_model_with_both_collections_trains_like_torchrec():
    for world in (1, 2):
        for r in run_distributed(_step, world):
            assert r["tables"] == (["t_u"], ["t_h"])
            assert r["dense_names"] == ["dense_arch.bias", "dense_arch.weight", "over.bias", "over.weight"]
            assert r["logits"] and r["dense_grads"] and r["ebc_weights"] and r["ec_weights"] and r["ec_moved"], (
                world,
                r,
            )
