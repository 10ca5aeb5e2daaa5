"""Shared setup of the raw-id tests: tables, id pools of random 64-bit ids, batches drawn from the pools, and the
static twin of a raw-id collection (the same tables with ids: index, fed each id's row through a vocabulary)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from embshard.spec.tables import TableConfig

Batch = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def static_twin(tables: Sequence[TableConfig]) -> list[TableConfig]:
    """The tables with ids: index (a raw-id table's rows, fed through a fixed vocabulary)."""
    return [dataclasses.replace(t, ids="index", eviction="lru", admit_min_count=1) for t in tables]


def id_pools(tables: Sequence[TableConfig], sizes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Per raw-id table, `sizes[name]` distinct random int64 ids (negative and huge ones too)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in tables:
        if t.raw_ids:
            ids = torch.randint(-(2**62), 2**62, (sizes[t.name] * 2,), generator=gen) * 2 + 1
            out[t.name] = torch.unique(ids)[: sizes[t.name]][torch.randperm(sizes[t.name], generator=gen)]
    return out


def pool_batches(
    tables: Sequence[TableConfig], pools: Mapping[str, torch.Tensor], batch_sizes: Sequence[int], steps: int, seed: int
) -> list[list[Batch]]:
    """Per step, per rank: {feature: (lengths, ids, weights)}; raw tables draw from their pool (Zipf-like: low
    pool positions more often), index tables uniformly over their rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_rank = []
        for B in batch_sizes:
            batch = {}
            for t in tables:
                for f in t.feature_names:
                    lengths = torch.randint(0, int(2 * t.ids_per_bag) + 2, (B,), generator=gen)
                    n = int(lengths.sum())
                    if t.raw_ids:
                        pool = pools[t.name]
                        pos = (torch.rand(n, generator=gen) ** 2 * len(pool)).long().clamp(max=len(pool) - 1)
                        ids = pool[pos]
                    else:
                        ids = torch.randint(0, t.num_embeddings, (n,), generator=gen)
                    w = torch.rand(n, generator=gen) + 0.5 if t.weighted else None
                    batch[f] = (lengths, ids, w)
            per_rank.append(batch)
        out.append(per_rank)
    return out


def through_vocab(batch: Batch, tables: Sequence[TableConfig], vocab: Mapping[str, dict[int, int]]) -> Batch:
    """The batch with every raw id replaced by its row (`vocab[table][id]`)."""
    out = dict(batch)
    for t in tables:
        if t.raw_ids:
            for f in t.feature_names:
                lengths, ids, w = batch[f]
                out[f] = (lengths, torch.tensor([vocab[t.name][int(i)] for i in ids], dtype=torch.int64), w)
    return out


def gathered_vocab(ebc) -> dict[str, dict[int, int]]:
    """{table: {raw id: table row}} of every rank's maps (collective when distributed)."""
    import torch.distributed as dist

    mine: dict[str, dict[int, int]] = {}
    for name, shard, st in ebc.local_id_maps():
        used = (st["id_last"] >= 0).nonzero().flatten().tolist()
        ids = st["ids"].tolist()
        mine.setdefault(name, {}).update({ids[r]: shard.row_offset + r for r in used})
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    out: dict[str, dict[int, int]] = {}
    for m in everyone:
        for name, v in m.items():
            out.setdefault(name, {}).update(v)
    return out


def zero_rows(ebc) -> dict[str, list[int]]:
    """{table: table rows that are zero rows of a raw-id block} (every block's last row), from the plan."""
    return {t.name: [s.row_offset + s.num_rows - 1 for s in ebc.plan[t.name].shards] for t in ebc.tables if t.raw_ids}
