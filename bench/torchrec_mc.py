"""TorchRec's managed-collision embedding bags against its static ones, timed in one process on the same batches.

Run with torchrun, one process per GPU (NCCL), or CPU processes (gloo) for a smoke test:
    torchrun --nproc-per-node=2 -m bench.torchrec_mc --workload uniform26 --id-space 10 --rounds 3 --steps 20
    torchrun --nproc-per-node=2 -m bench.torchrec_mc --workload tiny --steps 3 --rounds 1

Two modules of the workload's tables (bench/embshard_dmp.py's WORKLOADS; batch per rank as the workload says),
each wrapped in TorchRec's DistributedModelParallel with every table row-wise (the one sharding TorchRec's
ManagedCollisionEmbeddingBagCollectionSharder offers, so the static tables are row-wise too and the ratio is the
cost of the managed collisions alone), row-wise Adagrad fused into the backward (lr 0.01):
  static  EmbeddingBagCollection; ids = the raw ids modulo rows.
  mc      ManagedCollisionEmbeddingBagCollection: one MCHManagedCollisionModule per table (zch_size = its rows,
          input_hash_size = the id space, so that the row-wise input split spreads the ids evenly over ranks;
          --eviction lru|lfu, --eviction-interval steps between admissions), remapping raw ids to rows, admitting
          new ids, evicting, and resetting the evicted rows' weights and optimizer state.
Ids are uniform over --id-space K x rows distinct raw values (K = 1: ids within the rows, every id resident after
the first batches; K = 10: admitting and evicting every step); --batches distinct batches are cycled. Bag lengths
are uniform in [0, 2 x mean]. Step = forward, `values().sum().backward()` with the fused optimizer, no pipelining,
timed as bench/baselines/torchrec_dmp.py times it (5 warm-up steps, synchronize + barrier, --steps steps), in
--rounds interleaved rounds (static, mc, static, mc, ...); the median round is reported. Rank 0 prints each
module's memory per rank (weights, optimizer state, MC buffers) and one line per kind that bench/report.py parses:
    RESULT bench=torchrec_mc framework=torchrec workload=W world=N ids=static|mc id_space=K ms_per_step=X ...
`python -m bench.run rawids` runs it beside bench/embshard_dmp.py --ids both (embshard's raw-id tables).
Memory: an MCH module keeps three int64 values a row (sorted raw ids, their rows, the LRU clock or LFU count) and a
history of about 1.25 x a step's ids; rank 0 prints the prediction before building and what the modules hold after
the warm-up. uniform26 at full rows needs per GPU 6.25 GiB (static) + 6.58 GiB (mc) on 2 GPUs, 12.5 + 13.1 GiB on
one, so both fit in 80 GB; --scale shrinks the rows of both kinds where they would not (the run stops, naming it).
On CPU processes the evicted rows' reset (FBGEMM's reset_weight_momentum, a GPU kernel only) runs in PyTorch
instead: zero weights and Adagrad state, as the kernel writes them; everything else is TorchRec's sharded path.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
import types

import torch
import torch.distributed as dist

from bench.timing import interleaved_ms, result_line
from bench.workloads import WORKLOADS

KINDS = ("static", "mc")


def tensor_bytes(t: object) -> int:
    """Bytes this rank holds of a state-dict value (ShardedTensor and DTensor: the local part)."""
    if hasattr(t, "local_shards"):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in t.local_shards())
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def module_bytes(model: torch.nn.Module) -> dict[str, int]:
    """This rank's bytes of the module: embedding weights, fused optimizer state, managed-collision buffers (the
    state dict's and the non-persistent history buffers)."""
    out = {"weights": 0, "optimizer": 0, "mc_buffers": 0}
    for k, v in model.state_dict().items():
        out["mc_buffers" if "_managed_collision_collection" in k else "weights"] += tensor_bytes(v)
    for k, b in model.named_buffers():  # the non-persistent ones too (LRU's history of each id's step)
        if "_managed_collision_collection" in k and "_history" in k:
            out["mc_buffers"] += tensor_bytes(b)
    for m in model.modules():  # the history accumulator is a plain attribute, made at the first step
        acc = getattr(m, "_history_accumulator", None)
        if isinstance(acc, torch.Tensor):
            out["mc_buffers"] += tensor_bytes(acc)
    for state in model.fused_optimizer.state_dict()["state"].values():
        for v in state.values():
            out["optimizer"] += tensor_bytes(v)
    return out


def reset_rows_on_host(model: torch.nn.Module) -> int:
    """Give the module's host-memory TBEs the eviction reset that FBGEMM has as a GPU kernel only
    (fbgemm::reset_weight_momentum: the evicted rows' weights and row-wise Adagrad state set to 0, before TorchRec
    writes their initial values), so that the sharded managed-collision module runs on CPU processes too. GPU TBEs
    keep FBGEMM's kernel. Returns the number of TBEs given it."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    def reset(tbe, pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids) -> None:
        weights, states = tbe.split_embedding_weights(), tbe.split_optimizer_states()
        bounds = pruned_indices_offsets.tolist()
        with torch.no_grad():
            for t, b in zip(logical_table_ids.tolist(), buffer_ids.tolist()):
                rows = pruned_indices[bounds[b] : bounds[b + 1]].long()
                weights[t][rows] = 0
                for state in states[t]:
                    state[rows] = 0

    tbes = {}  # TorchRec's sharded MC module keeps the TBE of each table for its evictions
    for m in model.modules():
        for tbe, _ in getattr(m, "_table_to_tbe_and_index", {}).values():
            tbes[id(tbe)] = tbe
    n = 0
    for tbe in tbes.values():
        if isinstance(tbe, SplitTableBatchedEmbeddingBagsCodegen) and tbe.current_device.type != "cuda":
            tbe.reset_embedding_weight_momentum = types.MethodType(reset, tbe)
            n += 1
    return n


def predicted_gib(spec: list, world: int, batch: int, eviction: str, interval: int) -> dict[str, float]:
    """Per rank, before building: fp32 weights and row-wise Adagrad's one fp32 a row per module; the MCH modules'
    three int64 a row, 1025 output segments and their id history (1.25 x interval x the ids a rank's module gets a
    step, about batch x mean bag length; LRU keeps each id's step beside it)."""
    weights = sum(-(-r // world) * (d * 4 + 4) for r, d, _ in spec)
    history = (2 if eviction == "lru" else 1) * 8 * sum(int(1.25 * interval * batch * m) for _, _, m in spec)
    mc = sum(-(-r // world) * 24 + 1026 * 8 for r, _, _ in spec) + history
    return {"static": weights / 2**30, "mc": (weights + mc) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="uniform26")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (static, mc, static, mc, ...)")
    ap.add_argument("--id-space", type=float, default=1.0, help="ids drawn from this many x rows distinct values")
    ap.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    ap.add_argument("--eviction", choices=("lru", "lfu"), default="lru", help="the MCH modules' eviction policy")
    ap.add_argument("--eviction-interval", type=int, default=1, help="steps between the MCH modules' admissions")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every table's rows (both kinds) by this")
    args = ap.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.batches < 1 or args.eviction_interval < 1:
        raise SystemExit(
            f"--steps {args.steps}, --rounds {args.rounds}, --batches {args.batches}, --eviction-interval "
            f"{args.eviction_interval}: each must be at least 1"
        )
    if args.id_space < 1 or not 0 < args.scale <= 1:
        raise SystemExit(f"--id-space {args.id_space:g} must be >= 1 and --scale {args.scale:g} in (0, 1]")

    from embshard.runtime.distributed import init_distributed

    dev = init_distributed(collective_timeout_s=None)  # torchrun's group: NCCL on the rank's GPU, else gloo
    cuda = dev.type == "cuda"
    rank, ws = dist.get_rank(), dist.get_world_size()

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    full, batch = WORKLOADS[args.workload]
    spec = [(max(ws, int(r * args.scale)), d, m) for r, d, m in full]
    space = [max(1, int(r * args.id_space)) for r, _, _ in spec]
    pred = predicted_gib(spec, ws, batch, args.eviction, args.eviction_interval)
    if rank == 0:
        scaled = f" (rows x {args.scale:g})" if args.scale != 1 else ""
        print(
            f"{args.workload}{scaled}: {len(spec)} tables, {sum(r for r, _, _ in spec):,} rows; predicted per rank: "
            f"static {pred['static']:.3f} GiB, mc {pred['mc']:.3f} GiB (weights, Adagrad state, MC buffers)",
            flush=True,
        )
    if cuda:
        free = torch.cuda.mem_get_info()[0] / 2**30
        if pred["static"] + pred["mc"] > 0.8 * free:
            raise SystemExit(
                f"{args.workload}: the two modules need about {pred['static'] + pred['mc']:.1f} GiB per GPU, "
                f"{free:.1f} GiB free: pass --scale {0.8 * free / (pred['static'] + pred['mc']):.2f} or fewer rows"
            )

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{i}"])
        for i, (r, d, _) in enumerate(spec)
    ]
    meta = torch.device("meta")
    policy = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy}[args.eviction]
    modules = {
        "static": EmbeddingBagCollection(tables=tables, device=meta),
        "mc": ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=meta),
            ManagedCollisionCollection(
                managed_collision_modules={
                    t.name: MCHManagedCollisionModule(
                        zch_size=t.num_embeddings,
                        device=meta,
                        eviction_policy=policy(),
                        eviction_interval=args.eviction_interval,
                        input_hash_size=n,
                    )
                    for t, n in zip(tables, space)
                },
                embedding_configs=tables,
            ),
            return_remapped_features=False,
        ),
    }
    sharders = {"static": EmbeddingBagCollectionSharder(), "mc": ManagedCollisionEmbeddingBagCollectionSharder()}
    models: dict[str, DistributedModelParallel] = {}
    built: dict[str, float] = {}
    for kind in KINDS:
        module = modules[kind]
        apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.01})
        t0 = time.time()
        base = torch.cuda.memory_allocated() if cuda else 0
        plan = construct_module_sharding_plan(
            module,
            per_param_sharding={t.name: row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for t in tables},
            sharder=sharders[kind],
            world_size=ws,
            device_type=dev.type,
        )
        models[kind] = DistributedModelParallel(
            module, device=dev, plan=ShardingPlan({"": plan}), sharders=[sharders[kind]]
        )
        if kind == "mc" and reset_rows_on_host(models[kind]) and rank == 0:
            print("mc: the evicted rows' reset runs in PyTorch on the host (FBGEMM's kernel is GPU-only)")
        if cuda:
            torch.cuda.synchronize()
        built[kind] = (torch.cuda.memory_allocated() - base) / 2**30 if cuda else float("nan")
        if rank == 0:
            kinds = collections.Counter(f"{p.sharding_type}/{p.compute_kernel}" for p in plan.values())
            print(f"{kind}: plan+build {time.time() - t0:.1f} s; plan: {dict(kinds)} over {ws} ranks", flush=True)

    gen = torch.Generator(device=dev).manual_seed(rank)

    def make_batch() -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        """(static batch, mc batch): the same bags; raw ids from id_space x rows values, the static ones mod rows."""
        lengths, values = [], []
        for (_, _, mean), n in zip(spec, space):
            le = torch.randint(0, 2 * mean + 1, (batch,), device=dev, generator=gen, dtype=torch.int32)
            lengths.append(le)
            values.append(torch.randint(0, n, (int(le.sum()),), device=dev, generator=gen))
        keys = [f"f{i}" for i in range(len(spec))]
        raw = torch.cat(values)
        static = torch.cat([v % r for v, (r, _, _) in zip(values, spec)])
        return tuple(
            KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.cat(lengths)) for v in (static, raw)
        )

    batches = [make_batch() for _ in range(args.batches)]

    def step(kind: str, i: int) -> None:
        out = models[kind](batches[i % len(batches)][kind == "mc"])
        if kind == "mc":  # (pooled embeddings, remapped ids or None)
            out = out[0]
        out.values().sum().backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for kind in KINDS:
        for i in range(5):
            step(kind, i)
    sync()
    dist.barrier()
    held = {kind: module_bytes(models[kind]) for kind in KINDS}  # every rank: the state dicts are built alike
    dist.barrier()
    if rank == 0:
        for kind, parts in held.items():
            measured = f", {built[kind]:.2f} GiB allocated by the build" if cuda else ""
            print(
                f"{kind} memory, rank 0: "
                + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in parts.items())
                + f", {sum(parts.values()) / 2**30:.3f} GiB in all (predicted {pred[kind]:.3f} GiB{measured})",
                flush=True,
            )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = interleaved_ms(KINDS, args.rounds, args.steps, step, sync, before=dist.barrier)
    peak = torch.tensor([float(torch.cuda.max_memory_allocated()) if cuda else 0.0], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection

    open_slots = torch.zeros(1, dtype=torch.int64, device=dev)  # TorchRec's count of unused rows, all tables
    for m in models["mc"].modules():
        if isinstance(m, ShardedManagedCollisionCollection):
            open_slots += sum(int(v.sum()) for v in m.open_slots().values())
    dist.all_reduce(open_slots)
    if rank == 0:
        mem = f"; peak GPU memory {peak.item() / 2**30:.2f} GiB (max over ranks)" if cuda else ""
        for kind in KINDS:
            ms = statistics.median(times[kind])
            rounds = ", ".join(f"{t:.2f}" for t in times[kind])
            print(
                f"torchrec {kind} {args.workload} world={ws} id_space={args.id_space:g}: {ms:.2f} ms/step "
                f"(rounds: {rounds}), {ws * batch / ms * 1e3:,.0f} samples/s{mem}",
                flush=True,
            )
        ratio = statistics.median(times["mc"]) / statistics.median(times["static"])
        print(
            f"torchrec mc/static {args.workload} id_space={args.id_space:g}: {ratio:.2f}x; "
            f"{int(open_slots.item()):,} of {sum(r for r, _, _ in spec):,} rows unused at the end",
            flush=True,
        )
        for kind in KINDS:
            ms = statistics.median(times[kind])
            fields = [
                f"bench=torchrec_mc framework=torchrec workload={args.workload} world={ws} ids={kind}",
                f"id_space={args.id_space:g} ms_per_step={ms:.3f} samples_per_s={ws * batch / ms * 1e3:.0f}",
                f"rounds={len(times[kind])} steps={args.steps} batch_per_rank={batch} scale={args.scale:g}",
                f"peak_gib={peak.item() / 2**30:.2f}",
            ]
            if kind == "mc":
                fields.append(f"eviction={args.eviction} eviction_interval={args.eviction_interval}")
                fields.append(f"open_slots={int(open_slots.item())}")
            print(result_line(fields), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
