"""Step 1 of 3: keep TorchRec's runtime, plan with embshard.

The TorchRec job (common.py) gets its ShardingPlan from embshard's planner: the tables, the optimizer and the
planner constraints (allowed sharding types, pooling factors) come from the TorchRec model and its
ParameterConstraints; the plan is written as a TorchRec plan file (JSON) and loaded with one call;
DistributedModelParallel trains as before and saves a DCP checkpoint, the usual TorchRec way.

    torchrun --nproc-per-node=2 examples/torchrec/step1_plan.py --out /tmp/migrate
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import batches, quiet, run_as_script, torchrec_constraints, torchrec_dlrm, torchrec_train

from embshard.interop import (
    constraints_from_torchrec,
    load_torchrec_plan,
    optimizer_from_torchrec,
    save_torchrec_plan,
    tables_from_torchrec,
    with_pooling_factors,
)
from embshard.planner import Topology, plan_with_report

EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # where DMP finds the collection in DLRMTrain


def main(out: str, device: torch.device) -> dict:
    quiet()
    model = torchrec_dlrm()
    ebc = model.model.sparse_arch.embedding_bag_collection
    tr_constraints = torchrec_constraints()
    tables = with_pooling_factors(tables_from_torchrec(ebc), tr_constraints)
    constraints = constraints_from_torchrec(tr_constraints, tables)
    topology = Topology.detect(world_size=dist.get_world_size())
    optimizer = optimizer_from_torchrec(ebc)
    plan, report = plan_with_report(tables, topology, 8, optimizer, constraints)
    plan_file = os.path.join(out, "plan.torchrec.json")
    if dist.get_rank() == 0:
        print(report)
        os.makedirs(out, exist_ok=True)
        notes = save_torchrec_plan(plan_file, plan, EBC_PATH, device_type=device.type, optimizer=optimizer)
        print("\n".join(f"note: {n}" for n in notes))
    dist.barrier()

    from torchrec.distributed.model_parallel import DistributedModelParallel

    dmp = DistributedModelParallel(model, device=device, plan=load_torchrec_plan(plan_file))  # the one call
    losses = torchrec_train(dmp, batches(4, seed=1), device)
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.save(state, checkpoint_id=os.path.join(out, "torchrec_ckpt"))
    if dist.get_rank() == 0:
        print(
            f"TorchRec trained 4 steps on embshard's plan (losses {[round(x, 4) for x in losses]}); saved {out}/torchrec_ckpt"
        )
    return {"losses": losses, "plan": plan}


if __name__ == "__main__":
    run_as_script(main, __doc__, "folder for the plan file and the TorchRec checkpoint")
