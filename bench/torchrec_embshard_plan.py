"""TorchRec's runtime on embshard's plan: the TorchRec baseline (bench/baselines/torchrec_dmp.py, unchanged: its
model, DistributedModelParallel and timing loop) with its planner replaced by embshard's, converted to TorchRec's
ShardingPlan by embshard.interop. Compare with the baseline's own plan, back to back on the same machine:

    torchrun --nproc-per-node=2 -m bench.torchrec_embshard_plan --plan torchrec --workload hetero124 --hbm-gib 70
    torchrun --nproc-per-node=2 -m bench.torchrec_embshard_plan --plan embshard --workload hetero124 --hbm-gib 70
    torchrun --nproc-per-node=2 -m bench.torchrec_embshard_plan --plan torchrec --workload overflow --hbm-gib 16
    torchrun --nproc-per-node=2 -m bench.torchrec_embshard_plan --plan embshard --workload overflow --hbm-gib 16
    torchrun --nproc-per-node=2 -m bench.torchrec_embshard_plan --plan plan.torchrec.json --workload ...  # a file

--plan torchrec: the baseline as is (TorchRec's planner). --plan embshard: embshard's planner (embshard.planner, this
machine's GPUs via Topology.detect, --hbm-gib as the GPU memory it may plan for, 0: all of it; the workload's ids
per bag and batch; row-wise Adagrad as the baseline trains), converted with embshard.interop.to_torchrec_plan; rank 0
prints the embshard plan's summary, its predicted step time and the conversion's notes (data-parallel tables run
TorchRec's dense kernel; the small-table kernel becomes FBGEMM's). --plan FILE: a TorchRec plan file
(`embshard plan ... --format torchrec --out FILE`, tables named t0, t1, ... as the baseline's). Other flags are the
baseline's (--workload, --hbm-gib, --steps, --force); --numa-bind runs each rank on the CPUs of its GPU's NUMA
node (bench/numa.py; every run prints each rank's placement); the workloads of bench/embshard_dmp.py it lacks (overflow)
are added as in bench/torchrec_more.py. The baseline prints the plan summary and ms/step, samples/s, peak memory.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINES = [
    os.environ.get("TORCHREC_BASELINE", ""),
    os.path.join(HERE, "baselines", "torchrec_dmp.py"),
]


def embshard_planner(args: argparse.Namespace, spec: list, batch: int):
    """A stand-in for TorchRec's EmbeddingShardingPlanner whose collective_plan is embshard's plan, converted."""

    class EmbshardPlanner:
        def __init__(self, topology=None, constraints=None, **_: object) -> None:
            self.device_type = getattr(topology, "compute_device", "cuda")

        def collective_plan(self, module, sharders=None, pg=None):
            import dataclasses

            import torch.distributed as dist

            from embshard import FusedOptimizerConfig
            from embshard.interop import load_torchrec_plan, tables_from_torchrec, to_torchrec_plan
            from embshard.planner import Topology, plan_with_report

            rank0 = dist.get_rank() == 0
            if args.plan != "embshard":
                if rank0:
                    print(f"TorchRec plan file {args.plan}", flush=True)
                return load_torchrec_plan(args.plan, device_type=self.device_type)
            tables = [
                dataclasses.replace(t, ids_per_bag=float(mean))
                for t, (_, _, mean) in zip(tables_from_torchrec(module), spec)
            ]
            optimizer = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
            topo = Topology.detect(world_size=dist.get_world_size()).with_sizes(hbm_gib=args.hbm_gib or None)
            plan, report = plan_with_report(tables, topo, batch, optimizer)
            tr_plan, notes = to_torchrec_plan(plan, "", self.device_type, optimizer, tables=tables)
            if rank0:
                kinds = collections.Counter(
                    f"{t.sharding_type.value}/{t.tier.value}/{t.kernel.value}" for t in plan.tables
                )
                print(
                    f"embshard plan: {dict(kinds)}; predicted {report.step_time_s * 1e3:.2f} ms/step (embshard's "
                    f"runtime), peak {report.peak_hbm / 2**30:.1f} GiB; {len(notes)} notes, e.g. {notes[:1]}",
                    flush=True,
                )
            return tr_plan

    return EmbshardPlanner


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--plan", default="torchrec", help="torchrec, embshard, or a TorchRec plan file (JSON)")
    ap.add_argument("--workload", default="uniform26")
    ap.add_argument("--hbm-gib", type=float, default=0)
    ap.add_argument("--numa-bind", action="store_true", help="run each rank on its GPU's NUMA node's CPUs")
    args, rest = ap.parse_known_args()
    from bench.numa import numa_setup
    from bench.workloads import WORKLOADS

    numa_setup(bind=args.numa_bind)  # one line per rank: the GPU's node and where the process runs

    path = next(p for p in BASELINES if p and os.path.exists(p))
    spec_ = importlib.util.spec_from_file_location("torchrec_dmp", path)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    for name, workload in WORKLOADS.items():
        mod.WORKLOADS.setdefault(name, workload)
    if args.plan != "torchrec":
        import torchrec.distributed.planner as planner

        spec, batch = mod.WORKLOADS[args.workload]
        planner.EmbeddingShardingPlanner = embshard_planner(args, spec, batch)  # what the baseline's main() imports
    sys.argv = [path, "--workload", args.workload, "--hbm-gib", str(args.hbm_gib), *rest]
    mod.main()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
