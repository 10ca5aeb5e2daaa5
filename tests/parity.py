"""Shared parity machinery: random batches, a distributed worker that trains the sharded module, and the check
against the unsharded reference (forward outputs every step, weights after the last step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from reference import ReferenceEBC

from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import TableConfig

Batch = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def step_batch_sizes(batch_sizes: Sequence[int] | Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """Per step, every rank's local batch size: `batch_sizes` is one list for all steps, or one list per step."""
    if batch_sizes and not isinstance(batch_sizes[0], int):
        assert len(batch_sizes) == steps, f"{len(batch_sizes)} per-step batch sizes for {steps} steps"
        return [list(b) for b in batch_sizes]
    return [list(batch_sizes)] * steps


def random_batches(
    tables: Sequence[TableConfig], batch_sizes: Sequence[int] | Sequence[Sequence[int]], steps: int, seed: int
) -> list[tuple[list[Batch], list[dict[str, torch.Tensor]]]]:
    """Per step: per rank a batch {feature: (lengths, ids, weights)} and the upstream gradient per feature.
    `batch_sizes`: every rank's local batch size, the same every step or one list per step (0 allowed).

    Bag lengths are 0..2*ids_per_bag+1 (empty bags included), ids uniform over the table, weights in [0.5, 1.5).
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for sizes in step_batch_sizes(batch_sizes, steps):
        per_rank, upstream = [], []
        for B in sizes:
            batch, grads = {}, {}
            for t in tables:
                for f in t.feature_names:
                    hi = int(2 * t.ids_per_bag) + 2
                    lengths = torch.randint(0, hi, (B,), generator=gen)
                    ids = torch.randint(0, t.num_embeddings, (int(lengths.sum()),), generator=gen)
                    w = torch.rand(ids.numel(), generator=gen) + 0.5 if t.weighted else None
                    batch[f] = (lengths, ids, w)
                    grads[f] = torch.randn(B, t.embedding_dim, generator=gen)
            per_rank.append(batch)
            upstream.append(grads)
        out.append((per_rank, upstream))
    return out


def to_kjt(batch: Batch, key_order: Sequence[str], device: torch.device):
    """A torchrec KeyedJaggedTensor with the features in `key_order`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weighted = any(batch[k][2] is not None for k in key_order)
    weights = None
    if weighted:
        weights = torch.cat(
            [batch[k][2] if batch[k][2] is not None else torch.ones(batch[k][1].numel()) for k in key_order]
        )
    return KeyedJaggedTensor(
        keys=list(key_order),
        values=torch.cat([batch[k][1] for k in key_order]).to(device),
        lengths=torch.cat([batch[k][0] for k in key_order]).to(torch.int32).to(device),
        weights=weights.to(device) if weights is not None else None,
    )


def sharded_worker(
    rank: int,
    world_size: int,
    device: torch.device,
    tables: list[TableConfig],
    plan: ShardingPlan,
    opt: FusedOptimizerConfig,
    batch_sizes: list[int],
    steps: int,
    seed: int,
    groups: dict[str, list[str]] | None = None,
    options=None,
):
    """Train the sharded module on this rank's slice of each step's batch; return its outputs, the full weights,
    this rank's replicas of the data-parallel tables, its shards' optimizer state ({(table, row offset, column
    offset): {name: tensor}}) and the labels of the collectives it started.

    Without `groups` the loss is sum(out[f] * upstream[f]) over features; with `groups` the module returns one
    tensor per group and the loss is sum(out[g] * group_upstream(g)) (see group_upstream)."""
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.runtime import comm

    torch.manual_seed(1234 + rank)  # must not matter: initialisation is seeded per table
    ebc = ShardedEmbeddingBagCollection(
        tables, plan, opt, output_groups=groups, device=device, seed=seed, options=options
    )
    features = [f for t in tables for f in t.feature_names]
    key_order = features[::-1]  # a different order from the tables', to exercise the mapping
    outputs = []
    with comm.trace() as labels:
        for per_rank, upstream in random_batches(tables, batch_sizes, steps, seed):
            out = ebc(to_kjt(per_rank[rank], key_order, device))
            got = out if groups is not None else out.to_dict()
            names = list(groups) if groups is not None else features
            up = group_upstream(upstream[rank], groups) if groups is not None else upstream[rank]
            loss = sum((got[n] * up[n].to(device)).sum() for n in names)
            loss.backward()
            outputs.append({n: got[n].detach().cpu() for n in names})
    dp = {t.table for t in plan.tables if t.sharding_type is ShardingType.DATA_PARALLEL}
    replicas = {name: w.detach().cpu().clone() for name, _, w in ebc.local_shards() if name in dp}
    states = {
        (name, s.row_offset, s.col_offset): {k: v.detach().cpu().clone() for k, v in st.items()}
        for name, s, st in ebc.local_optimizer_states()
    }
    return {
        "outputs": outputs,
        "weights": ebc.full_weights(),
        "replicas": replicas,
        "states": states,
        "collectives": list(labels),
    }


def column_blocks(plan: ShardingPlan) -> dict[str, list[int]]:
    """{table: column-block widths} of the plan's column-wise tables (each block has its own optimizer state)."""
    return {
        t.table: [s.num_cols for s in sorted(t.shards, key=lambda s: s.col_offset)]
        for t in plan.tables
        if t.sharding_type is ShardingType.COLUMN_WISE
    }


def group_upstream(upstream: dict[str, torch.Tensor], groups: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Upstream gradient of each output group: its members' upstream gradients side by side, times (g + 1) for
    the g-th group, so a feature in two groups receives two different contributions."""
    return {n: torch.cat([upstream[f] for f in m], dim=1) * (g + 1) for g, (n, m) in enumerate(groups.items())}


def feature_upstream(upstream: dict[str, torch.Tensor], groups: dict[str, list[str]] | None) -> dict[str, torch.Tensor]:
    """What group_upstream means per feature: the sum over its appearances (zero for features in no group)."""
    if groups is None:
        return upstream
    out = {f: torch.zeros_like(u) for f, u in upstream.items()}
    for g, members in enumerate(groups.values()):
        for f in members:
            out[f] = out[f] + upstream[f] * (g + 1)
    return out


def check_parity(
    results: list[dict],
    tables: list[TableConfig],
    opt: FusedOptimizerConfig,
    batch_sizes: list[int],
    steps: int,
    seed: int,
    atol: float = 2e-5,
    groups: dict[str, list[str]] | None = None,
    plan: ShardingPlan | None = None,
    rtol: float = 1e-4,
) -> None:
    """Compare every rank's outputs and the final weights with the unsharded reference on the global batch.
    With `plan`, the reference keeps row-wise Adagrad state per column block of the column-wise tables."""
    ref = ReferenceEBC(tables, opt, seed, column_blocks=column_blocks(plan) if plan is not None else None)
    for step, (per_rank, upstream) in enumerate(random_batches(tables, batch_sizes, steps, seed)):
        glob = {
            f: tuple(
                torch.cat([b[f][i] for b in per_rank]) if per_rank[0][f][i] is not None else None for i in range(3)
            )
            for f in per_rank[0]
        }
        up = {f: torch.cat([u[f] for u in upstream]) for f in upstream[0]}
        want = ref.step(glob, feature_upstream(up, groups))
        if groups is not None:
            want = {n: torch.cat([want[f] for f in m], dim=1) for n, m in groups.items()}
        start = 0
        for r, B in enumerate(step_batch_sizes(batch_sizes, steps)[step]):
            for f, w in want.items():
                got = results[r]["outputs"][step][f]
                torch.testing.assert_close(
                    got.double(),
                    w[start : start + B],
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, c=f"step {step} rank {r} {f}": f"{c}: {m}",
                )
            start += B
    for r, res in enumerate(results):
        for t in tables:
            torch.testing.assert_close(
                res["weights"][t.name].double(),
                ref.weights[t.name],
                atol=atol,
                rtol=rtol,
                msg=lambda m, c=f"weights of {t.name} on rank {r} after {steps} steps": f"{c}: {m}",
            )
