"""Step 2 of 3: run the TorchRec model on embshard, from TorchRec's checkpoint.

The same DLRM (its dense part unchanged) trains in embshard's TrainPipeline: its EmbeddingBagCollection becomes a
ShardedEmbeddingBagCollection on embshard's plan for this job (any world size), TorchRec's DCP checkpoint of step 1
loads into it (tables, row-wise Adagrad state, dense weights), and embshard saves its own checkpoint.

    torchrun --nproc-per-node=2 examples/torchrec/step2_train.py --out /tmp/migrate
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from common import LR, batches, quiet, run_as_script, torchrec_dlrm

from embshard.checkpoint import Checkpointer, TrainState
from embshard.interop import load_torchrec_checkpoint, rec_model_from_torchrec, tables_from_torchrec
from embshard.planner import Topology, plan_with_report
from embshard.training.pipeline import TrainPipeline


def main(out: str, device: torch.device) -> dict:
    quiet()
    dlrm = torchrec_dlrm().model  # DLRM: forward(dense_features, sparse_features)
    tables = tables_from_torchrec(dlrm.sparse_arch.embedding_bag_collection)
    plan, _ = plan_with_report(tables, Topology.detect(world_size=dist.get_world_size()), batch_size=8)
    model = rec_model_from_torchrec(dlrm, plan, device)  # sparse optimizer: TorchRec's row-wise Adagrad
    notes = load_torchrec_checkpoint(os.path.join(out, "torchrec_ckpt"), model, module_path="model")
    dense_optimizer = torch.optim.SGD(model.dense_parameters(), lr=LR)
    pipeline = TrainPipeline(model, dense_optimizer, mode="sparse_dist", start_step=4)
    source = iter(batches(4, seed=2))
    losses = []
    while (done := pipeline.progress(source)) is not None:
        losses.append(float(done.output.loss))
    pipeline.close()
    saver = Checkpointer(
        TrainState.of_model(model, dense_optimizer), os.path.join(out, "embshard_ckpt"), async_save=False
    )
    saver.save(pipeline.step, None)
    saver.close()
    if dist.get_rank() == 0:
        print("\n".join(f"note: {n}" for n in notes))
        print(f"embshard trained steps 5-8 (losses {[round(x, 4) for x in losses]}); saved {out}/embshard_ckpt")
    return {"losses": losses, "plan": plan}


if __name__ == "__main__":
    run_as_script(main, __doc__, "the folder of step 1")
