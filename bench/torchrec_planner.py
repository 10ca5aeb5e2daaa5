"""TorchRec's planner on embshard tables, its plan converted to an embshard ShardingPlan (for comparisons:
planning time, and TorchRec's placement predicted by embshard's cost model or measured with embshard).

    from bench.torchrec_planner import torchrec_plan
    plan = torchrec_plan(tables, world_size=2, local_world_size=2, hbm_gib=130, batch_size=8192)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

from embshard.interop import from_torchrec_plan
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import TableConfig


def torchrec_inputs(tables: Sequence[TableConfig]) -> tuple:
    """(meta-device EmbeddingBagCollection, ParameterConstraints with the pooling factors from ids_per_bag): what
    TorchRec's planner needs for `tables`. Silences TorchRec's warnings and logging."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
        )
        for t in tables
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.ids_per_bag] * len(t.feature_names)) for t in tables}
    return ebc, constraints


def torchrec_plan(
    tables: Sequence[TableConfig],
    world_size: int,
    local_world_size: int,
    hbm_gib: float | None,
    batch_size: int,
    ddr_gib: float | None = None,
) -> ShardingPlan:
    """Plan with TorchRec's EmbeddingShardingPlanner (meta-device EmbeddingBagCollection, pooling factors from
    ids_per_bag; hbm_gib None: TorchRec's default 32 GiB) and convert the result (embshard.interop.from_torchrec_plan)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    ebc, constraints = torchrec_inputs(tables)
    kw = {}
    if hbm_gib is not None:
        kw["hbm_cap"] = int(hbm_gib * 1024**3)
    if ddr_gib is not None:
        kw["ddr_cap"] = int(ddr_gib * 1024**3)
    topo = Topology(world_size=world_size, local_world_size=local_world_size, compute_device="cuda", **kw)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch_size, constraints=constraints)
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return from_torchrec_plan(plan, "", world_size, local_world_size, tables=tables)
