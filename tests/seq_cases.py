"""Workers and the unsharded reference of tests/sequence/: sequence tables (pooling none) trained sharded on every
rank against plain PyTorch (full tables, `weight[ids]`, the optimizer math written out in reference.py)."""

from __future__ import annotations

import torch
from dist_harness import device_kind
from reference import ReferenceEBC

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.collection.sequence import ShardedEmbeddingCollection
from embshard.spec.plan import MemoryTier, ShardingPlan, ShardingType

Batch = dict[str, tuple[torch.Tensor, torch.Tensor]]  # feature -> (lengths [B], ids)

TABLES = [
    TableConfig("s_a", 40, 8, ("h_a", "h_a2"), pooling="none", ids_per_bag=3),  # two features share a table
    TableConfig("s_b", 64, 12, ("h_b",), pooling="none", ids_per_bag=4, max_length=3),  # histories cut to 3
    TableConfig("s_c", 30, 8, ("h_c",), pooling="none", ids_per_bag=2),
    TableConfig("s_d", 50, 16, ("h_d",), pooling="none", ids_per_bag=3),
]
TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]
OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
}


TIER = MemoryTier.HBM if device_kind() == "cuda" else MemoryTier.HOST


def plan_for(world: int, rotation: int, tables=TABLES) -> ShardingPlan:
    """Table i gets TYPES[(i + rotation) % 5]; column-wise tables in 2 blocks; every table in the test device's
    tier."""
    types = {t.name: TYPES[(i + rotation) % len(TYPES)] for i, t in enumerate(tables)}
    return simple_plan(tables, world, world, types, tier=TIER, column_shards=2)


def random_batches(tables, sizes: list[int], steps: int, seed: int) -> list[list[tuple[Batch, dict]]]:
    """Per step, per rank: ({feature: (lengths, ids)}, {feature: upstream gradient per id, `[n, D]`}). Lengths
    0..2*ids_per_bag (empty histories included); ids skewed to low rows so that batches repeat ids. The gradients
    are multiples of 1/16 in [-2, 2]: a row's gradient (the sum over its ids) is then exact in float32 in any order,
    as in the float64 reference. Normal draws made the order matter: a sum that all but cancels (1e-5 from terms
    near 1) keeps a float32 rounding of 1% of itself, which Adagrad's first step (g / (|g| + eps)) turns into weights
    2e-5 apart."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ranks = []
        for B in sizes:
            batch, grads = {}, {}
            for t in tables:
                for f in t.feature_names:
                    lengths = torch.randint(0, int(2 * t.ids_per_bag) + 1, (B,), generator=gen)
                    n = int(lengths.sum())
                    ids = (torch.rand(n, generator=gen) ** 2 * t.num_embeddings).long()
                    batch[f] = (lengths, ids)
                    kept = int(torch.clamp(lengths, max=t.max_length or n + 1).sum())
                    grads[f] = torch.randint(-32, 33, (kept, t.embedding_dim), generator=gen).float() / 16
            ranks.append((batch, grads))
        out.append(ranks)
    return out


def cut(batch: Batch, tables) -> Batch:
    """Each history cut to its table's max_length, keeping the newest (last) ids."""
    out = {}
    for t in tables:
        for f in t.feature_names:
            lengths, ids = batch[f]
            m = t.max_length
            if m is None:
                out[f] = (lengths, ids)
                continue
            parts = ids.split(lengths.tolist())
            out[f] = (lengths.clamp(max=m), torch.cat([p[len(p) - min(len(p), m) :] for p in parts] + [ids[:0]]))
    return out


def to_kjt(batch: Batch, keys, device):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.cat([batch[k][1] for k in keys]).to(device),
        lengths=torch.cat([batch[k][0] for k in keys]).to(torch.int32).to(device),
    )


class SequenceReference(ReferenceEBC):
    """Unsharded sequence tables in plain PyTorch: `weight[ids]` per feature, exact sparse updates (reference.py)."""

    def forward(self, batch, params=None):
        params = params or self.weights
        return {f: params[t.name][batch[f][1].long()] for t in self.tables for f in t.feature_names}


def column_blocks(plan: ShardingPlan, tables) -> dict[str, list[int]]:
    """Widths of each column-wise table's blocks (row-wise Adagrad keeps one state per block there)."""
    out = {}
    for t in tables:
        tp = plan[t.name]
        if tp.sharding_type is ShardingType.COLUMN_WISE:
            widths = {s.col_offset: s.num_cols for s in tp.shards}
            out[t.name] = [widths[c] for c in sorted(widths)]
    return out


def reference_run(tables, plan, opt, steps_data) -> tuple[list[list[dict]], dict[str, torch.Tensor]]:
    """Per step the reference's outputs cut per rank, and its weights after the last step."""
    ref = SequenceReference(tables, opt, seed=0, column_blocks=column_blocks(plan, tables))
    outs = []
    for ranks in steps_data:
        cut_ranks = [cut(b, tables) for b, _ in ranks]
        glob = {f: (None, torch.cat([c[f][1] for c in cut_ranks])) for f in cut_ranks[0]}
        up = {f: torch.cat([g[f] for _, g in ranks]).double() for f in glob}
        out = ref.step(glob, up)
        per_rank, starts = [], dict.fromkeys(glob, 0)
        for c in cut_ranks:
            mine = {}
            for f, (lengths, ids) in c.items():
                mine[f] = (lengths, out[f][starts[f] : starts[f] + ids.numel()].float())
                starts[f] += ids.numel()
            per_rank.append(mine)
        outs.append(per_rank)
    return outs, {k: v.float() for k, v in ref.weights.items()}


def parity_worker(rank, world, device, cases, sizes, seed):
    """Train every case (rotation, dedup, optimizer name) for len(steps) steps on this rank's batches; return per
    case the outputs of every step ((lengths, values) per feature) and the full weights after the last step."""
    keys = ["h_d", "h_a2", "h_b", "h_a", "h_c"]  # not the tables' order
    results = []
    for k, (rotation, dedup, opt_name) in enumerate(cases):
        plan = plan_for(world, rotation)
        ec = ShardedEmbeddingCollection(TABLES, plan, OPTIMIZERS[opt_name], device=device, dedup=dedup)
        steps = random_batches(TABLES, sizes, 2, seed + k)
        outs = []
        for ranks in steps:
            batch, grads = ranks[rank]
            out = ec(to_kjt(batch, keys, device))
            loss = sum((out[f].values() * grads[f].to(device)).sum() for f in keys)
            loss.backward()
            outs.append({f: (out[f].lengths().cpu(), out[f].values().detach().cpu()) for f in keys})
        results.append((outs, ec.full_weights()))
    return results


def bad_batch_worker(rank, world, device):
    """Rank 1's batch has a history over a max_length that refuses it, then rank 0's an id outside its table; every
    rank must raise each time (none left waiting), and a good batch afterwards still trains. Returns the errors'
    (type, message) per attempt."""
    tables = [TableConfig("strict", 20, 4, ("s",), pooling="none", max_length=2, length_overflow="error")]
    plan = simple_plan(tables, world, world, {"strict": "row_wise"}, tier=TIER)
    ec = ShardedEmbeddingCollection(tables, plan, device=device)
    good = {"s": (torch.tensor([2, 1]), torch.tensor([1, 19, 5]))}
    bad = [
        {"s": (torch.tensor([3, 0]), torch.tensor([1, 2, 3]))} if rank == 1 else good,
        {"s": (torch.tensor([1, 0]), torch.tensor([20]))} if rank == 0 else good,
    ]
    errors = []
    for batch in bad:
        try:
            ec(to_kjt(batch, ["s"], device))
            errors.append(None)
        except ValueError as e:
            errors.append((type(e).__name__, str(e)))
    out = ec(to_kjt(good, ["s"], device))
    return errors, out["s"].values().shape[0]
