"""The training loss of embshard and of TorchRec on the same synthetic batches (the learnable signal of
embshard's synthetic source), step by step: both frameworks' losses should fall alike.

    python -m bench.loss_curves --config configs/dlrm_dcnv2_mlperf.yaml --nproc 2 --steps 300 --out loss.png
    python -m bench.loss_curves ... --scale 1e-4 --batch-size 128 --small     # on the CPU (gloo)

embshard: RecModel + TrainPipeline (the config's pipeline and precision). TorchRec: the same architecture
(torchrec.models.dlrm.DLRM_DCN through bench/baselines/torchrec_dlrm_train.py's build_model), row-wise Adagrad fused
into its TBEs, dense Adagrad, TorchRec's planner, DistributedModelParallel and TrainPipelineSparseDist, fed the same
batches (converted to torchrec's Batch). Both start from their own initialisations. --small shrinks both dense
parts alike (bottom 32, top 64, cross rank 16) for the CPU. Rank 0 writes the curves (mean loss over ranks, and a
moving average) to --out (PNG) and the raw losses to --out with .json, and prints the first and last 20-step means.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def baseline_module():
    """bench/baselines/torchrec_dlrm_train.py, imported (its build_model and Batch class)."""
    path = os.path.join(ROOT, "bench", "baselines", "torchrec_dlrm_train.py")
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def embshard_losses(cfg, source, device, steps: int) -> list[torch.Tensor]:
    from embshard.training.pipeline import TrainPipeline
    from embshard.training.train import build_model, plan_job

    world = dist.get_world_size()
    plan = plan_job(cfg, device, world, world, lambda _line: None)
    model, opt, graphs, _mode = build_model(cfg, plan, source.num_dense, device, world, lambda _line: None)
    pipe = TrainPipeline(model, opt, cfg.training.pipeline, precision=cfg.training.precision, graphs=graphs)
    batches = source.train_batches(0)
    out = [pipe.progress(batches).output.loss.detach() for _ in range(steps)]
    pipe.close()
    return out


def torchrec_losses(cfg, source, device, steps: int, small: bool) -> list[torch.Tensor]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    base = baseline_module()
    if small:
        base.BOTTOM_MLP, base.TOP_MLP, base.DCN_RANK = [32, 128], [64, 1], 16
    base.DCN_LAYERS = cfg.model.dcn.num_layers
    world = dist.get_world_size()
    tables = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                           feature_names=list(t.feature_names))
        for t in cfg.model.tables
    ]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = base.build_model(ebc, device, "torchrec", lambda *a: None)
    so, do = cfg.sparse_optimizer, cfg.dense_optimizer
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": so.lr, "eps": so.eps})
    constraints = {t.name: ParameterConstraints(pooling_factors=[float(t.ids_per_bag)]) for t in cfg.model.tables}
    cuda = device.type == "cuda"
    kw = {"hbm_cap": torch.cuda.get_device_properties(device).total_memory} if cuda else {}
    topo = Topology(world_size=world, local_world_size=world, compute_device=device.type, **kw)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=cfg.schedule.batch_size, constraints=constraints)
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=do.lr, eps=do.eps),
    )
    pipe = TrainPipelineSparseDist(dmp, opt, device)
    Batch = base.batch_class()
    pin = cuda

    def converted():
        for b in source.train_batches(0):
            out = Batch(dense_features=b.dense, sparse_features=b.sparse, labels=b.labels)
            yield out.pin_memory() if pin else out

    it = converted()
    dmp.train()
    return [pipe.progress(it)[0].detach() for _ in range(steps)]  # DLRMTrain: (loss, logits, labels)


def run(args: argparse.Namespace) -> None:
    from embshard.config import load_config
    from embshard.data import build_source
    from embshard.runtime.distributed import init_distributed

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    over = list(args.overrides)
    cfg = load_config(args.config, over)
    if args.scale != 1.0:
        for i, t in enumerate(cfg.model.tables):
            over.append(
                f"model.tables[{i}].num_embeddings={max(min(t.num_embeddings, 16), math.ceil(t.num_embeddings * args.scale))}"
            )
    if args.batch_size:
        over.append(f"schedule.batch_size={args.batch_size}")
    if args.small:
        over += ["model.dlrm.bottom_mlp=[32]", "model.dlrm.top_mlp=[64]", "model.dcn.low_rank=16"]
    cfg = load_config(args.config, over)
    batch = cfg.schedule.batch_size
    source = build_source(cfg.data, list(cfg.model.tables), batch, cfg.seed, rank, world)
    curves = {}
    for name, fn in (("embshard", lambda: embshard_losses(cfg, source, device, args.steps)),
                     ("torchrec", lambda: torchrec_losses(cfg, source, device, args.steps, args.small))):  # fmt: skip
        losses = torch.stack(fn()).double()
        gc.collect()  # the first framework's model goes before the second one's is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.all_reduce(losses)
        curves[name] = (losses / world).cpu().tolist()
        first, last = sum(curves[name][:20]) / 20, sum(curves[name][-20:]) / 20
        if rank == 0:
            print(f"{name}: mean loss of the first 20 steps {first:.4f}, of the last 20 {last:.4f}", flush=True)
    if rank == 0 and args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"config": args.config, "batch_per_rank": batch, "world": world, **curves}, f)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for (name, ys), color in zip(curves.items(), ("#1f77b4", "#d62728")):
            ax.plot(range(1, len(ys) + 1), ys, color=color, alpha=0.25, linewidth=0.8)
            k = max(1, len(ys) // 20)
            smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(range(1, len(ys) + 1), smooth, color=color, label=f"{name} ({k}-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (BCE, mean over ranks)")
        ax.set_title(f"{os.path.basename(args.config)}: {world} ranks x {batch} samples, synthetic signal")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"plot: {args.out}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every table's rows by this")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="smaller dense parts in both frameworks (CPU)")
    ap.add_argument("--out", default=None, help="PNG of the curves (rank 0); the losses go to the same name .json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    if "RANK" in os.environ or args.nproc <= 1:
        run(args)
        return
    from embshard.runtime.distributed import spawn_local

    spawn_local(run, args.nproc, args)


if __name__ == "__main__":
    main()
