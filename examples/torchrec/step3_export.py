"""Step 3 of 3: go back to TorchRec at any time.

embshard's checkpoint of step 2 loads into the model on any embshard plan and is written as a DCP checkpoint under
TorchRec's keys; TorchRec's DistributedModelParallel, on a plan of TorchRec's own planner, loads it the usual way
and computes the loss embshard computes on the same held-out batch.

    torchrun --nproc-per-node=2 examples/torchrec/step3_export.py --out /tmp/migrate
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import batches, quiet, run_as_script, torchrec_batch, torchrec_dlrm

from embshard import simple_plan
from embshard.checkpoint import TrainState, latest, load_checkpoint
from embshard.interop import rec_model_from_torchrec, save_torchrec_checkpoint, tables_from_torchrec


def main(out: str, device: torch.device) -> dict:
    quiet()
    dlrm = torchrec_dlrm().model
    tables = tables_from_torchrec(dlrm.sparse_arch.embedding_bag_collection)
    model = rec_model_from_torchrec(
        dlrm, simple_plan(tables, dist.get_world_size(), tier="hbm" if device.type == "cuda" else "host"), device
    )
    load_checkpoint(latest(os.path.join(out, "embshard_ckpt")), TrainState.of_model(model, None))
    notes = save_torchrec_checkpoint(os.path.join(out, "back_to_torchrec"), model, module_path="model")
    held_out = batches(1, seed=3)[0]
    with torch.no_grad():
        ours = float(model.step(held_out.to(device)).loss)

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    module = torchrec_dlrm()
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type)
    plan = EmbeddingShardingPlanner(topology=topology).collective_plan(module, [EmbeddingBagCollectionSharder()])
    dmp = DistributedModelParallel(module, device=device, plan=plan)
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(out, "back_to_torchrec"))
    dmp.load_state_dict(state["model"])
    with torch.no_grad():
        theirs = float(dmp(torchrec_batch(held_out, device))[0])
    if dist.get_rank() == 0:
        print("\n".join(f"note: {n}" for n in notes))
        print(f"held-out loss: embshard {ours:.6f}, TorchRec from the exported checkpoint {theirs:.6f}")
    return {"ours": ours, "theirs": theirs}


if __name__ == "__main__":
    run_as_script(main, __doc__, "the folder of steps 1 and 2")
