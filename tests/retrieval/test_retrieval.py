"""Retrieval over a row-sharded catalog against plain-PyTorch references on the whole catalog (float64): the full
softmax and the sampled softmax (loss, query gradients, item rows after an SGD step of the fused optimizer), all-
gathered in-batch negatives, recall@K by sharded top-k, `local_rows`, and the sampler. 1, 2 and 3 processes
(gloo; NCCL with EMBSHARD_TEST_DEVICE=cuda), uneven local batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import device_kind, run_distributed

from embshard import simple_plan
from embshard.lookup import init_rows
from embshard.spec.geometry import row_blocks
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.tables import TableConfig

CATALOG = TableConfig("t_item", num_embeddings=23, embedding_dim=8, feature_names=("item",))
LR = 0.5
SIZES = {1: [6], 2: [5, 3], 3: [4, 6, 2]}  # local batch sizes (uneven on purpose)


def close(got, want, msg=None):
    """fp32 results against float64 references."""
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=(lambda m: f"{msg}: {m}") if msg else None)


def batch(world: int, step: int, dim: int = 8, items: int = 23):
    """Per rank: queries [B_r, D], targets [B_r], upstream weights [B_r] (fresh for every step)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for B in SIZES[world]:
        out.append(
            (
                torch.randn(B, dim, generator=gen),
                torch.randint(0, items, (B,), generator=gen),
                torch.rand(B, generator=gen) + 0.5,
            )
        )
    return out


def tier(device: torch.device) -> str:
    return "hbm" if device.type == "cuda" else "host"


def make_catalog(world: int, device, **kw):
    from embshard.retrieval import Catalog

    plan = simple_plan([CATALOG], world, sharding_types={"t_item": "row_wise"}, tier=tier(device))
    return Catalog(
        CATALOG, plan, FusedOptimizerConfig("sgd", lr=LR), device, seed=3, chunk_mib=4 * 12 * 5 / (1 << 20), **kw
    )


def softmax_worker(rank, world, device, kind, steps):
    """Train the catalog with `kind` softmax for `steps` steps; per step the query gradients, the loss and (sampled)
    the negatives drawn with their global ids; then the full table."""
    cat = make_catalog(world, device, sampler="unigram", num_negatives=7, smoothing=0.5)
    record = []
    for step in range(steps):
        q, t, w = batch(world, step)[rank]
        q = q.to(device).requires_grad_(True)
        neg = None
        if kind == "sampled":  # what this step's sampler draws (replayed: the draw depends only on seed and step)
            neg = (cat.sampler.sample(step) + cat.row_offset).cpu()
        fn = cat.full_softmax_loss if kind == "full" else cat.sampled_softmax_loss
        loss = fn(q, t.to(device))
        (loss * w.to(device)).sum().backward()
        record.append({"loss": loss.detach().cpu(), "grad": q.grad.cpu(), "neg": neg})
    return {"steps": record, "weights": cat.ebc.full_weights()["t_item"]}


def expected_draws(world: int, counts: torch.Tensor, smoothing: float, k_per_rank: list[int]) -> torch.Tensor:
    """Expected draws per row under the stratified unigram proposal, written out from the rule in sampler.py."""
    out = torch.zeros(CATALOG.num_embeddings, dtype=torch.float64)
    r0 = 0
    for r, n in enumerate(row_blocks(CATALOG.num_embeddings, world)):
        c = counts[r0 : r0 + n] + smoothing
        out[r0 : r0 + n] = k_per_rank[r] * c / c.sum()
        r0 += n
    return out


def worker(rank, world, device):
    """Everything this file checks on `world` processes, in one start of the processes."""
    out = {kind: softmax_worker(rank, world, device, kind, STEPS) for kind in ("full", "sampled")}
    out["recall"] = recall_worker(rank, world, device)
    out["in_batch"] = in_batch_worker(rank, world, device)
    out["local_rows"] = local_rows_worker(rank, world, device)
    out["block_vectors"] = block_vectors_worker(rank, world, device)
    return out


def block_vectors_worker(rank, world, device):
    """Rows of arbitrary ids read from every rank's catalog block (Catalog.block_vectors), then one SGD step of the
    block: the rows, and the table before and after."""
    cat = make_catalog(world, device)
    before = cat.ebc.full_weights()["t_item"]
    gen = torch.Generator().manual_seed(7)
    every = [torch.randint(0, CATALOG.num_embeddings, (n,), generator=gen) for n in SIZES[world]]
    ups = [torch.randn(n, CATALOG.embedding_dim, generator=gen) for n in SIZES[world]]
    block = cat.block()
    rows = cat.block_vectors(every[rank].to(device), block)
    (rows * ups[rank].to(device)).sum().backward()
    return {"ids": every, "ups": ups, "rows": rows.detach().cpu(), "before": before, "after": cat.ebc.full_weights()}


@pytest.fixture(
    scope="module",
    params=[w for w in (1, 2, 3) if device_kind() == "cpu" or w <= torch.cuda.device_count()],
    ids=lambda w: f"world{w}",
)
def ranks(request):
    """(world size, every rank's results of `worker`)."""
    return request.param, run_distributed(worker, request.param)


STEPS = 2


@pytest.mark.parametrize("kind", ["full", "sampled"])
def test_sharded_softmax_matches_the_unsharded_reference(ranks, kind):
    world, all_results = ranks
    steps = STEPS
    results = [res[kind] for res in all_results]
    E = init_rows(CATALOG, 0, 0, CATALOG.num_embeddings, 0, CATALOG.embedding_dim, 3).double()
    counts = torch.zeros(CATALOG.num_embeddings, dtype=torch.float64)
    for step in range(steps):
        per_rank = batch(world, step)
        Q = torch.cat([q for q, _, _ in per_rank]).double().requires_grad_(True)
        T = torch.cat([t for _, t, _ in per_rank])
        Wt = torch.cat([w for _, _, w in per_rank]).double()
        Er = E.clone().requires_grad_(True)
        scores = Q @ Er.t()
        if kind == "full":
            loss = F.cross_entropy(scores, T, reduction="none")
        else:
            negs = [res["steps"][step]["neg"] for res in results]
            neg = torch.cat(negs)
            e = expected_draws(world, counts, 0.5, [n.numel() for n in negs])
            logits = torch.cat([scores.gather(1, T[:, None]) - e[T].log()[:, None], scores[:, neg] - e[neg].log()], 1)
            logits[:, 1:] = logits[:, 1:].masked_fill(neg[None, :] == T[:, None], float("-inf"))
            loss = F.cross_entropy(logits, torch.zeros_like(T), reduction="none")
            counts += torch.bincount(T, minlength=CATALOG.num_embeddings).double()
        (loss * Wt).sum().backward()
        start = 0
        for r, res in enumerate(results):
            B = SIZES[world][r]
            got = res["steps"][step]
            msg = f"{kind} softmax, world {world}, step {step}, rank {r}"
            close(got["loss"].double(), loss[start : start + B].detach(), msg=msg)
            close(got["grad"].double(), Q.grad[start : start + B], msg=msg)
            start += B
        E = E - LR * Er.grad
    for r, res in enumerate(results):
        close(res["weights"].double(), E, msg=f"{kind} softmax, rank {r}: rows after {steps} steps")


def recall_worker(rank, world, device):
    cat = make_catalog(world, device)
    q, t, _ = batch(world, 0)[rank]
    hits = cat.recall(q.to(device), t.to(device), (1, 3, 10))
    return {k: int(v) for k, v in hits.items()}


def test_recall_by_sharded_topk_equals_brute_force(ranks):
    world, all_results = ranks
    results = [res["recall"] for res in all_results]
    E = init_rows(CATALOG, 0, 0, CATALOG.num_embeddings, 0, CATALOG.embedding_dim, 3)
    start = 0
    for r, (q, t, _) in enumerate(batch(world, 0)):
        top = (q @ E.t()).topk(10, dim=1).indices
        want = {k: int((top[:, :k] == t[:, None]).any(1).sum()) for k in (1, 3, 10)}
        assert results[r] == want, (r, results[r], want)
        start += q.shape[0]
    assert any(v for res in results for v in res.values())  # the check is not vacuous


def in_batch_worker(rank, world, device):
    from embshard.models.two_tower import in_batch_softmax_loss

    q, t, w = batch(world, 0)[rank]
    items = torch.randn(q.shape[0], 8, generator=torch.Generator().manual_seed(7 + rank))
    q, items = q.to(device).requires_grad_(True), items.to(device).requires_grad_(True)
    loss, _, _ = in_batch_softmax_loss(q, items, 0.5, global_negatives=True, item_ids_B=t.to(device))
    loss.backward()
    return {"loss": float(loss), "dq": q.grad.cpu(), "di": items.grad.cpu()}


def test_global_in_batch_negatives(ranks):
    world, all_results = ranks
    results = [res["in_batch"] for res in all_results]
    per_rank = batch(world, 0)
    Q = torch.cat([q for q, _, _ in per_rank]).double().requires_grad_(True)
    T = torch.cat([t for _, t, _ in per_rank])
    items = [torch.randn(SIZES[world][r], 8, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
    items_all = torch.cat(items).double().requires_grad_(True)
    logits = Q @ items_all.t() / 0.5
    own = torch.arange(len(T))
    dup = (T[None, :] == T[:, None]) & (own[None, :] != own[:, None])  # the same item elsewhere: not a negative
    logits = logits.masked_fill(dup, float("-inf"))
    losses = F.cross_entropy(logits, own, reduction="none")
    start, total = 0, 0
    for r in range(world):
        B = SIZES[world][r]
        total = total + losses[start : start + B].mean()
        start += B
    total.backward()
    start = 0
    for r, res in enumerate(results):
        B = SIZES[world][r]
        assert res["loss"] == pytest.approx(float(losses[start : start + B].mean()), rel=1e-5)
        close(res["dq"].double(), Q.grad[start : start + B])
        close(res["di"].double(), items_all.grad[start : start + B])
        start += B


def local_rows_worker(rank, world, device):
    """Two row-wise tables in one TBE, one read by two features: local_rows of each, then an SGD step on them."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    tables = [
        TableConfig("a", num_embeddings=10, embedding_dim=4, feature_names=("a1", "a2")),
        TableConfig("b", num_embeddings=7, embedding_dim=8, feature_names=("b1",)),
    ]
    plan = simple_plan(tables, world, sharding_types={"a": "row_wise", "b": "row_wise"}, tier=tier(device))
    ebc = ShardedEmbeddingBagCollection(tables, plan, FusedOptimizerConfig("sgd", lr=LR), device=device, seed=5)
    before = ebc.full_weights()
    off_a, rows_a = ebc.local_rows("a")
    off_b, rows_b = ebc.local_rows("b", torch.tensor([1, 0, 1]) if rank == 0 else None)
    up_a = torch.randn(rows_a.shape, generator=torch.Generator().manual_seed(rank))
    ((rows_a * up_a.to(device)).sum() + rows_b.sum()).backward()
    return {
        "off": (off_a, off_b),
        "a": rows_a.detach().cpu(),
        "b": rows_b.detach().cpu(),
        "up_a": up_a,
        "before": before,
        "after": ebc.full_weights(),
    }


def test_local_rows_read_the_block_and_train_it(ranks):
    world, all_results = ranks
    results = [res["local_rows"] for res in all_results]
    before = results[0]["before"]
    want_a, want_b = before["a"].clone(), before["b"].clone()
    for rank, res in enumerate(results):
        off_a, off_b = res["off"]
        n = res["a"].shape[0]
        close(res["a"], before["a"][off_a : off_a + n])
        want_a[off_a : off_a + n] -= LR * res["up_a"]
        if rank == 0:
            close(res["b"], before["b"][[1, 0, 1]])
            want_b[1] -= 2 * LR
            want_b[0] -= LR
        else:
            close(res["b"], before["b"][off_b : off_b + res["b"].shape[0]])
            want_b[off_b : off_b + res["b"].shape[0]] -= LR
    for res in results:
        close(res["after"]["a"], want_a)
        close(res["after"]["b"], want_b)


def test_block_vectors_read_any_rows_and_train_them_once(ranks):
    world, all_results = ranks
    results = [res["block_vectors"] for res in all_results]
    before, ids, ups = results[0]["before"], results[0]["ids"], results[0]["ups"]
    want = before.clone()
    for r in range(world):
        close(results[r]["rows"], before[ids[r]])
        want.index_add_(0, ids[r], -LR * ups[r])  # SGD: every rank's uses of a row add up, in one step
    for res in results:
        close(res["after"]["t_item"], want)


def test_sampler_draws_follow_the_smoothed_counts():
    from embshard.retrieval import BlockSampler, negatives_per_rank

    assert negatives_per_rank(10, [4, 4, 3]) == [4, 3, 3] and sum(negatives_per_rank(7, [6, 5])) == 7
    assert negatives_per_rank(5, [6, 0, 5])[1] == 0
    with pytest.raises(ValueError, match="num_negatives=1 is fewer than the 2 ranks"):
        negatives_per_rank(1, [3, 3])
    s = BlockSampler("unigram", 10, 5, 4000, 1.0, 0, 0, torch.device("cpu"))
    s.observe(torch.tensor([12, 12, 12, 14, 3, 99]))  # rows 2 (x3) and 4 of the block; 3 and 99 are elsewhere
    close(s.counts, torch.tensor([0.0, 0, 3, 0, 1], dtype=torch.float64))
    draws = s.sample(step=1)
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    torch.testing.assert_close(freq, torch.tensor([1.0, 1, 4, 1, 2], dtype=torch.float64) / 9, atol=0.03, rtol=0)
    assert torch.equal(draws, s.sample(step=1)) and not torch.equal(draws, s.sample(step=2))
    want = torch.log(torch.tensor([4000 * 4 / 9, 4000 * 2 / 9]))
    close(s.log_expected(torch.tensor([2, 4])), want.float())
    u = BlockSampler("uniform", 0, 8, 3, 1.0, 0, 0, torch.device("cpu"))
    assert u.sample(0).max() < 8 and math.isclose(
        float(u.log_expected(torch.tensor([5]))), math.log(3 / 8), rel_tol=1e-6
    )


def test_synthetic_affinity_items_come_from_the_users_group():
    """data.synthetic.affinity: about `strength` of the items are in their user's group (g + G k before the scramble),
    the rest anywhere; labels are 1; a feature with several ids per bag or a group count that does not divide the
    item table is refused."""
    import numpy as np

    from embshard.config.data import AffinityConfig, SyntheticConfig
    from embshard.data.synthetic import _GOLDEN, SyntheticSource, scramble_multiplier
    from embshard.spec.tables import ConfigError

    tables = [TableConfig("u", 500, 4, ("user",)), TableConfig("i", 1000, 4, ("item",))]
    cfg = SyntheticConfig(num_dense=0, affinity=AffinityConfig("user", "item", clusters=50, strength=0.7))
    b = SyntheticSource(cfg, tables, 4000, seed=1, rank=0).batch(3)
    users, items = b.sparse["user"].values().numpy(), b.sparse["item"].values().numpy()
    assert users.size == items.size == 4000 and bool((b.labels == 1).all())
    unscrambled = items * pow(scramble_multiplier(1000), -1, 1000) % 1000
    group = ((users.astype(np.uint64) + np.uint64(12345)) * _GOLDEN >> np.uint64(33)) % np.uint64(50)
    in_group = (unscrambled % 50 == group.astype(np.int64)).mean()
    assert 0.7 < in_group < 0.7 + 0.3 / 50 + 0.03  # strength, plus the other draws that land in the group by chance
    bad = [TableConfig("u", 500, 4, ("user",), ids_per_bag=2), tables[1]]
    with pytest.raises(ConfigError, match="feature 'user' has 2"):
        SyntheticSource(cfg, bad, 8, seed=1, rank=0)
    with pytest.raises(ConfigError, match="clusters=50 does not divide table 'i'"):
        SyntheticSource(cfg, [tables[0], TableConfig("i", 1010, 4, ("item",))], 8, seed=1, rank=0)
