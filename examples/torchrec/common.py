"""The TorchRec job the migration examples start from: a DLRM (TorchRec's torchrec.models.dlrm) over three
tables, row-wise Adagrad applied to its embeddings in backward, SGD for its dense part, and random batches."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist

LR = 0.05
CONFIGS = [  # name, rows, features (DLRM: every table 16 wide)
    ("user", 100, ["user_id"]),
    ("item", 200, ["item_id", "last_item"]),
    ("category", 30, ["category"]),
]
NUM_DENSE = 4


def torchrec_constraints() -> dict:
    """The TorchRec job's ParameterConstraints (its planner's input): allowed sharding types and pooling factors."""
    from torchrec.distributed.planner.types import ParameterConstraints

    return {
        "user": ParameterConstraints(sharding_types=["column_wise"], min_partition=8, pooling_factors=[1.5]),
        "item": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[1.5, 1.5]),
        "category": ParameterConstraints(sharding_types=["table_wise"], pooling_factors=[1.5]),
    }


def torchrec_dlrm(device: str = "meta"):
    """TorchRec's DLRMTrain (BCE loss) on a fresh EmbeddingBagCollection (meta: no weights yet), with the sparse
    optimizer applied in backward as a TorchRec job does."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=16, feature_names=f) for n, r, f in CONFIGS]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR, "eps": 1e-8})
    torch.manual_seed(0)  # the same dense initialisation on every rank
    return DLRMTrain(DLRM(ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[16], over_arch_layer_sizes=[8, 1]))


def batches(steps: int, seed: int, batch_size: int = 8) -> list:
    """This rank's batches (embshard.data.Batch: dense features, a KeyedJaggedTensor of ids, 0/1 labels)."""
    from torchrec import KeyedJaggedTensor

    from embshard.data.common import Batch

    gen = torch.Generator().manual_seed(seed * 1000 + (dist.get_rank() if dist.is_initialized() else 0))
    out = []
    for _ in range(steps):
        keys, lengths, values = [], [], []
        for _, rows, features in CONFIGS:
            for f in features:
                le = torch.randint(0, 4, (batch_size,), generator=gen, dtype=torch.int32)
                keys.append(f)
                lengths.append(le)
                values.append(torch.randint(0, rows, (int(le.sum()),), generator=gen))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
        out.append(Batch(torch.randn(batch_size, NUM_DENSE, generator=gen), kjt, labels))
    return out


def torchrec_batch(b, device: torch.device):
    """The same batch as TorchRec's torchrec.datasets.utils.Batch."""
    from torchrec.datasets.utils import Batch

    b = b.to(device)
    return Batch(dense_features=b.dense, sparse_features=b.sparse, labels=b.labels)


def torchrec_train(dmp, steps: list, device: torch.device) -> list[float]:
    """Train TorchRec's DMP on the batches (its dense part with SGD); this rank's losses."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=LR)
    )
    losses = []
    for b in steps:
        loss, _ = dmp(torchrec_batch(b, device))
        dense.zero_grad()
        loss.backward()
        dense.step()
        losses.append(float(loss))
    return losses


def quiet() -> None:
    """Silence TorchRec's warnings and logging."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def run_as_script(main: Callable, doc: str, out_help: str) -> None:
    """A step run by torchrun: `--out FOLDER`, the process group joined, main(out, device), the group ended."""
    from embshard.runtime.distributed import init_distributed

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help=out_help)
    main(ap.parse_args().out, init_distributed())
    dist.destroy_process_group()
