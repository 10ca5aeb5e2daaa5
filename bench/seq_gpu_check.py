"""GPU check of the sequence collection (`ShardedEmbeddingCollection`, FBGEMM TBE with `PoolingMode.NONE`): parity
with a plain-PyTorch reference for every tier (hbm, uvm, uvm_caching), every fused optimizer, dedup off and on,
every sharding type (each table takes each type over the rotations), then step timings.

    python -m bench.seq_gpu_check --out DIR                                       # one GPU
    torchrun --standalone --nproc-per-node=2 -m bench.seq_gpu_check --out DIR    # two GPUs (NCCL)

Parity: 3 training steps of a global batch (histories of 0..2L ids, ids skewed so that batches repeat them), each
rank its share of the samples; every rank compares its rows with the reference's (full tables, `weight[ids]`, the
optimizer rules of embshard/lookup/updates.py applied to the touched rows, one row-wise Adagrad state per column
block for column-wise tables) and, after the last step, every table's weights. One line per case: `PASS name` or
`FAIL name: why`; then `ALL PASS` or `N FAILED`. Timings: forward + backward of one table-wise table of 1M x 128
rows (hbm, rowwise_adagrad), batch 4096 a rank, 50 ids a history, dedup off and on: `TIME name: ms a step` (median
of 20 steps after 5 warm-up steps). Rank 0 writes the lines to DIR/seq_gpu_check.txt too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embshard import FusedOptimizerConfig, TableConfig, simple_plan
from embshard.collection.sequence import ShardedEmbeddingCollection
from embshard.lookup.updates import apply_update, optimizer_state
from embshard.spec.plan import ShardingType

TABLES = [
    TableConfig("s_a", 400, 16, ("h_a", "h_a2"), pooling="none", ids_per_bag=4),
    TableConfig("s_b", 640, 32, ("h_b",), pooling="none", ids_per_bag=6, max_length=5),
    TableConfig("s_c", 300, 16, ("h_c",), pooling="none", ids_per_bag=3),
    TableConfig("s_d", 500, 64, ("h_d",), pooling="none", ids_per_bag=4),
]
TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]
OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
}
KEYS = ["h_d", "h_a2", "h_b", "h_a", "h_c"]


def global_batch(tables, B: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{feature: (lengths [B], ids, upstream gradient per kept id)} on the CPU, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in tables:
        for f in t.feature_names:
            lengths = torch.randint(0, int(2 * t.ids_per_bag) + 1, (B,), generator=gen)
            ids = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * t.num_embeddings).long()
            if t.max_length:
                parts = ids.split(lengths.tolist())
                ids = torch.cat([p[len(p) - min(len(p), t.max_length) :] for p in parts] + [ids[:0]])
                lengths = lengths.clamp(max=t.max_length)
            out[f] = (lengths, ids, torch.randn(ids.numel(), t.embedding_dim, generator=gen))
    return out


def share(batch, rank: int, world: int):
    """This rank's samples of the global batch (contiguous, equal shares)."""
    B = next(iter(batch.values()))[0].numel() // world
    out = {}
    for f, (lengths, ids, grads) in batch.items():
        a, b = int(lengths[: rank * B].sum()), int(lengths[: (rank + 1) * B].sum())
        out[f] = (lengths[rank * B : (rank + 1) * B], ids[a:b], grads[a:b])
    return out


def kjt_of(batch, device):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.cat([batch[k][1] for k in KEYS]).to(device),
        lengths=torch.cat([batch[k][0] for k in KEYS]).to(torch.int32).to(device),
    )


class Reference:
    """Full tables on the CPU (fp32): rows `weight[ids]`, exact updates of the touched rows per column block."""

    def __init__(self, weights: dict[str, torch.Tensor], opt: FusedOptimizerConfig, plan) -> None:
        self.w = {k: v.clone() for k, v in weights.items()}
        self.opt = opt
        self.blocks: dict[str, list[tuple[int, int, dict]]] = {}
        for t in TABLES:
            tp = plan[t.name]
            cols = sorted({(s.col_offset, s.num_cols) for s in tp.shards})
            if tp.sharding_type is not ShardingType.COLUMN_WISE:
                cols = [(0, t.embedding_dim)]
            self.blocks[t.name] = [(c, n, optimizer_state(opt, self.w[t.name][:, c : c + n])) for c, n in cols]
        self.t = 0

    def rows(self, batch) -> dict[str, torch.Tensor]:
        return {f: self.w[t.name][batch[f][1]] for t in TABLES for f in t.feature_names}

    def step(self, batch) -> None:
        self.t += 1
        for t in TABLES:
            w = self.w[t.name]
            g = torch.zeros_like(w)
            touched = torch.zeros(w.shape[0], dtype=torch.bool)
            for f in t.feature_names:
                g.index_add_(0, batch[f][1], batch[f][2])
                touched[batch[f][1]] = True
            for c, n, state in self.blocks[t.name]:
                block = w[:, c : c + n].contiguous()
                apply_update(self.opt, block, state, g[:, c : c + n].contiguous(), self.t, False, touched)
                w[:, c : c + n] = block


def check_case(name, tier, opt_name, dedup, rotation, rank, world, device, seed) -> str | None:
    """None when the case matches the reference, else why not."""
    types = {t.name: TYPES[(i + rotation) % len(TYPES)] for i, t in enumerate(TABLES)}
    plan = simple_plan(TABLES, world, world, types, tier=tier, column_shards=2)
    ec = ShardedEmbeddingCollection(TABLES, plan, OPTIMIZERS[opt_name], device=device, dedup=dedup)
    ref = Reference(ec.full_weights(), OPTIMIZERS[opt_name], plan)
    for s in range(3):
        glob = global_batch(TABLES, 8 * world, seed + s)
        mine = share(glob, rank, world)
        out = ec(kjt_of(mine, device))
        want = ref.rows(mine)
        for f in KEYS:
            got = out[f].values().detach().float().cpu()
            if not torch.equal(out[f].lengths().cpu().long(), mine[f][0].long()):
                return f"step {s} feature {f}: lengths differ"
            if got.shape != want[f].shape or not torch.allclose(got, want[f], rtol=1e-4, atol=1e-5):
                return f"step {s} feature {f}: rows differ (max {(got - want[f]).abs().max():.3g})"
        sum((out[f].values() * mine[f][2].to(device)).sum() for f in KEYS).backward()
        ref.step(glob)
    weights = ec.full_weights()
    for t in TABLES:
        diff = (weights[t.name] - ref.w[t.name]).abs().max().item()
        if not diff <= 1e-4 + 1e-4 * ref.w[t.name].abs().max().item():
            return f"table {t.name} ({types[t.name]}): weights after 3 steps differ by {diff:.3g}"
    return None


def time_steps(dedup: bool, rank: int, world: int, device) -> float:
    """Median ms of forward + backward of one 1M x 128 sequence table (hbm, rowwise_adagrad), batch 4096 a rank."""
    t = TableConfig("big", 1_000_000, 128, ("hist",), pooling="none", ids_per_bag=50)
    plan = simple_plan([t], world, world, {"big": "row_wise" if world > 1 else "table_wise"}, tier="hbm")
    ec = ShardedEmbeddingCollection([t], plan, FusedOptimizerConfig("rowwise_adagrad"), device=device, dedup=dedup)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(rank)
    B = 4096
    lengths = torch.randint(0, 101, (B,), generator=gen)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * t.num_embeddings).long()  # skewed: repeats
    kjt = KeyedJaggedTensor(keys=["hist"], values=ids.to(device), lengths=lengths.int().to(device))
    grad = torch.randn(ids.numel(), 128, device=device)
    times = []
    for i in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ec(kjt)
        (out["hist"].values() * grad).sum().backward()
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for seq_gpu_check.txt")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "little"))
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    lines: list[str] = [f"seed {args.seed}, world {world}, {torch.cuda.get_device_name(device)}"]

    def say(line: str) -> None:
        if rank == 0 or line.startswith("FAIL"):  # every rank prints its own failures
            print(line, flush=True)
        lines.append(line)

    say(lines[0])
    failures = 0
    k = 0
    for tier in ("hbm", "uvm", "uvm_caching"):
        for opt_name in OPTIMIZERS:
            for dedup in (False, True):
                for rotation in range(len(TYPES)) if tier == "hbm" else (k % len(TYPES),):
                    name = f"{tier} {opt_name} dedup={dedup} rotation={rotation}"
                    try:
                        why = check_case(name, tier, opt_name, dedup, rotation, rank, world, device, args.seed + k)
                    except Exception as e:  # a failing case is reported, and the others still run
                        why = f"{type(e).__name__}: {str(e)[:500]}"
                    k += 1
                    failures += why is not None
                    say(f"PASS {name}" if why is None else f"FAIL {name}: {why} (rank {rank})")
    if world > 1:  # failures on any rank
        total = torch.tensor([failures], device=device)
        dist.all_reduce(total)
        failures = int(total.item())
    say("ALL PASS" if not failures else f"{failures} FAILED (cases x ranks)")
    for dedup in (False, True):
        ms = time_steps(dedup, rank, world, device)
        say(f"TIME sequence step 1M x 128, batch 4096 x 0..100 ids, dedup={dedup}: {ms:.2f} ms a step")
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "seq_gpu_check.txt").write_text("\n".join(lines) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
