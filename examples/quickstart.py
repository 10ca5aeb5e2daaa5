"""embshard in one file: describe the tables, let the cost-model planner place them on a GPU cluster, then shard the
same tables (scaled down) on this machine and train one step.

    python examples/quickstart.py                                  # plan for 64 x H100, train on 1 CPU process
    python examples/quickstart.py --world-size 16 --device h200    # another cluster
    torchrun --nproc-per-node 2 examples/quickstart.py             # the training part on 2 processes

No GPU is needed: the plan for the cluster is made from the device preset's speeds and memory, without the
hardware; the training part runs on the GPUs of this machine if it has them (NCCL), else on CPU processes (gloo).
"""

from __future__ import annotations

import argparse

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embshard import FusedOptimizerConfig, ShardedEmbeddingBagCollection, TableConfig
from embshard.planner import Topology, explain, plan_with_report
from embshard.runtime.distributed import init_distributed


def make_tables(row_scale: float = 1.0) -> list[TableConfig]:
    """A small recommendation model's tables: two large id spaces, a few small ones. `row_scale` shrinks every
    table's rows (at least 100) so the same model fits a laptop."""

    def rows(n: int) -> int:
        return max(100, int(n * row_scale))

    return [
        TableConfig("user", rows(200_000_000), 128, feature_names=("user_id",)),
        TableConfig("item", rows(50_000_000), 128, feature_names=("item_id", "last_items"), ids_per_bag=20),
        TableConfig("query", rows(10_000_000), 64, feature_names=("query_terms",), ids_per_bag=8, pooling="mean"),
        TableConfig("country", rows(300), 16, feature_names=("country",)),
        TableConfig("category", rows(5_000), 32, feature_names=("item_category", "user_top_categories")),
    ]


def random_batch(tables: list[TableConfig], batch_size: int, seed: int) -> KeyedJaggedTensor:
    """A batch of `batch_size` samples: every feature a bag of 0-3 ids in its table's rows."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            n = torch.randint(0, 4, (batch_size,), generator=g, dtype=torch.int32)
            keys.append(f)
            lengths.append(n)
            values.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=64, help="GPUs of the cluster to plan for (default 64)")
    p.add_argument("--device", default="h100", help="the cluster's GPU model: a planner preset (h100, h200)")
    p.add_argument("--batch-size", type=int, default=8192, help="samples per GPU and step to plan for")
    p.add_argument("--local-batch", type=int, default=4, help="samples per process in the training step here")
    args = p.parse_args(argv)
    optimizer = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)

    # 1. Plan the full-size tables for the cluster: sharding type, ranks, memory tier and kernel per table.
    tables = make_tables()
    cluster = Topology.preset(args.device, world_size=args.world_size)
    plan, report = plan_with_report(tables, cluster, batch_size=args.batch_size, optimizer=optimizer)
    device = init_distributed()  # one process per rank under torchrun; a group of 1 otherwise
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0:
        print(f"== the plan for {args.world_size} x {args.device}")
        print(plan)
        print(report.summary())
        print(explain(report, "user"))

    # 2. The same model at 1/100,000 of its rows, planned for the processes of this job and sharded across them.
    small = make_tables(row_scale=1e-5)
    here = Topology.detect(world, device_type=device.type)  # this machine: its GPUs, or CPU processes
    local_plan, _ = plan_with_report(small, here, batch_size=args.local_batch, optimizer=optimizer)
    if rank == 0:
        print(f"== the plan for this job ({world} x {device.type})")
        print(local_plan)
    ebc = ShardedEmbeddingBagCollection(
        small,
        local_plan,
        optimizer,
        output_groups={"user": ["user_id", "country"], "item": ["item_id", "last_items", "item_category"]},
        device=device,
    )

    # 3. One training step: forward (pooled embeddings per output group), backward (the fused optimizer updates the
    # rows the batch touched, inside the backward: no optimizer.step() for the embeddings). A toy loss: the squared
    # pooled embeddings, so the step must make it smaller on the same batch.
    kjt = random_batch(small, args.local_batch, seed=rank).to(device)
    out = ebc(kjt)
    loss = sum(o.float().pow(2).mean() for o in out.values())
    loss.backward()
    with torch.no_grad():
        after = sum(o.float().pow(2).mean() for o in ebc(kjt).values())
    shapes = {k: tuple(v.shape) for k, v in out.items()}
    print(f"rank {rank}: pooled outputs {shapes}; loss {float(loss.detach()):.6f}, after one step {float(after):.6f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
