"""The fuzzer's sequence cases: random sequence tables (pooling none) in a ShardedEmbeddingCollection, each table any
sharding type, dedup on, off or for some tables, any fused optimizer, random world size and per-rank batch sizes
(0 included), random max_length cuts; trained 2 steps on every rank against the unsharded reference of
tests/sequence (seq_cases.reference_run): every step's rows per id and lengths, then the weights."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import torch
from dist_harness import run_distributed
from seq_cases import OPTIMIZERS, TIER, TYPES, random_batches, reference_run, to_kjt

from embshard import TableConfig, simple_plan
from embshard.spec.plan import ShardingPlan

STEPS = 2


@dataclass
class SeqCase:
    """One random sequence case (`source()` prints it for a failure)."""

    seed: int
    world_size: int
    tables: list[TableConfig]
    types: dict[str, str]
    optimizer: str
    dedup: bool | list[str]
    sizes: list[int]

    @property
    def plan(self) -> ShardingPlan:
        return simple_plan(self.tables, self.world_size, self.world_size, self.types, tier=TIER, column_shards=2)

    def source(self) -> str:
        return (
            f"SeqCase(seed={self.seed}, world_size={self.world_size}, tables={self.tables!r}, types={self.types}, "
            f"optimizer={self.optimizer!r}, dedup={self.dedup!r}, sizes={self.sizes})"
        )


def draw_sequence_case(seed: int, world: int) -> SeqCase:
    """A random case on `world` ranks: 1-3 tables of 1-2 features (8-60 rows, width 4-16), each a random sharding
    type, some with a max_length that cuts histories."""
    rng = random.Random(seed)
    tables = []
    for i in range(rng.randint(1, 3)):
        feats = tuple(f"sq{i}_{k}" for k in range(rng.randint(1, 2)))
        max_length = rng.choice([None, None, rng.randint(1, 4)])
        rows, dim = rng.randint(8, 60), rng.choice([4, 8, 12, 16])
        per = rng.choice([1, 2, 3])
        tables.append(TableConfig(f"sq{i}", rows, dim, feats, pooling="none", ids_per_bag=per, max_length=max_length))
    types = {t.name: rng.choice(TYPES) for t in tables}
    names = [t.name for t in tables]
    dedup = rng.choice([False, True, sorted(rng.sample(names, rng.randint(1, len(names))))])
    sizes = [rng.choice([0, 1, 3, 5]) for _ in range(world)]
    return SeqCase(seed, world, tables, types, rng.choice(list(OPTIMIZERS)), dedup, sizes)


def sequence_worker(rank: int, world: int, device, cases: list[SeqCase]) -> list:
    """Train every case; per case the outputs of every step ({feature: (lengths, rows)}) and the full weights after
    the last step, or the error's text."""
    from embshard.collection.sequence import ShardedEmbeddingCollection

    out = []
    for case in cases:
        try:
            ec = ShardedEmbeddingCollection(
                case.tables, case.plan, OPTIMIZERS[case.optimizer], device=device, dedup=case.dedup
            )
            keys = [f for t in case.tables for f in t.feature_names][::-1]  # not the tables' order
            steps = []
            for ranks in random_batches(case.tables, case.sizes, STEPS, case.seed):
                batch, grads = ranks[rank]
                res = ec(to_kjt(batch, keys, device))
                sum((res[f].values() * grads[f].to(device)).sum() for f in keys).backward()
                steps.append({f: (res[f].lengths().cpu(), res[f].values().detach().cpu()) for f in keys})
            out.append((steps, ec.full_weights()))
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            out.append(f"{type(e).__name__}: {e}")
    return out


def check_sequence_case(case: SeqCase, ranks: list) -> list[str]:
    """What differs from the reference (empty: the case passes)."""
    if any(isinstance(r, str) for r in ranks):
        return [f"rank {i} raised {r}" for i, r in enumerate(ranks) if isinstance(r, str)]
    steps = random_batches(case.tables, case.sizes, STEPS, case.seed)
    want_out, want_w = reference_run(case.tables, case.plan, OPTIMIZERS[case.optimizer], steps)
    errors = []

    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6):
            errors.append(f"{what}: max diff {(got.float() - want.float()).abs().max() if got.shape == want.shape else 'shape'}")  # fmt: skip

    for r, (outs, weights) in enumerate(ranks):
        for s, (got, want) in enumerate(zip(outs, want_out)):
            for f, (lengths, rows) in want[r].items():
                if not torch.equal(got[f][0].long(), lengths.long()):
                    errors.append(f"rank {r} step {s} feature {f}: lengths")
                close(got[f][1], rows.float(), f"rank {r} step {s} feature {f} rows")
        for t in case.tables:
            close(weights[t.name], want_w[t.name], f"rank {r} table {t.name} weights after {STEPS} steps")
    return errors


def run_sequence_cases(cases: list[SeqCase]) -> dict[int, str | None]:
    """Train (one distributed call per world size) and check every case: per case index its failure or None."""
    by_world: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(cases):
        by_world[c.world_size].append(i)
    outcome: dict[int, str | None] = {}
    for world, todo in sorted(by_world.items()):
        ranks = run_distributed(sequence_worker, world, [cases[i] for i in todo])
        for k, i in enumerate(todo):
            errors = check_sequence_case(cases[i], [r[k] for r in ranks])
            outcome[i] = None
            if errors:
                outcome[i] = f"SEQUENCE FUZZ CASE {cases[i].seed} FAILED:\n" + "\n".join(errors[:8])
                outcome[i] += f"\n{cases[i].source()}"
    return outcome
