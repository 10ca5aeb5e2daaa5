"""Raw-id tables against bad inputs and at their edges: ids that are not integers (raw and static tables alike),
the zero row (ids without a row train nothing there) zero in every saved or exported form, a loaded map that holds
an id twice, and raw-id row blocks of 1 row refused by the planner. One process, the CPU."""

from __future__ import annotations

import pytest
import torch
from parity import to_kjt
from raw_cases import id_pools, pool_batches

from embshard import ConfigError, FusedOptimizerConfig, TableConfig, simple_plan
from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
from embshard.planner import Topology, plan_with_report
from embshard.spec.plan import MemoryTier
from embshard.tools.checkpoint import main as checkpoint_cli

TABLES = [
    TableConfig("adm", 10, 4, ("fa",), ids="raw", ids_per_bag=2, admit_min_count=3),  # most ids: the zero row
    TableConfig("lru", 12, 4, ("fb",), ids="raw", ids_per_bag=2),
    TableConfig("s", 8, 4, ("fc",)),
]
FEATURES = ["fa", "fb", "fc"]
OPT = FusedOptimizerConfig("adam", lr=0.05, eps=1e-6)


def _make(seed: int = 1):
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    plan = simple_plan(TABLES, 1, tier=MemoryTier.HOST)
    return ShardedEmbeddingBagCollection(TABLES, plan, OPT, device=torch.device("cpu"), seed=seed)


def _trained(steps: int = 3):
    ebc = _make()
    for i, per_rank in enumerate(pool_batches(TABLES, id_pools(TABLES, {"adm": 30, "lru": 30}, 7), [6], steps, 3)):
        out = ebc(to_kjt(per_rank[0], FEATURES, torch.device("cpu"))).to_dict()
        gen = torch.Generator().manual_seed(i)
        sum((out[f] * torch.randn(out[f].shape, generator=gen)).sum() for f in FEATURES).backward()
    return ebc


def _kjt(values: torch.Tensor):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=torch.tensor([1, 1, 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_ids_that_are_not_int32_or_int64_are_refused_before_any_work(dtype):
    ebc = _make()
    with pytest.raises(ConfigError, match=rf"ids of features \['fa', 'fb', 'fc'\] are {dtype}: ids must be integers"):
        ebc(_kjt(torch.tensor([1, 2, 3]).to(dtype)))
    assert ebc.step == 0 and all(m.clock == 0 for _, _, m, _ in ebc.id_map_shards())  # nothing ran
    for ok in (torch.int32, torch.int64):
        ebc(_kjt(torch.tensor([1, 2, 3], dtype=ok)))


def test_the_zero_row_is_zero_in_full_weights_checkpoints_and_exports(tmp_path):
    from safetensors.torch import load_file

    ebc = _trained()
    live = {n: w for n, _, w in ebc.local_shards()}
    assert live["adm"][-1].abs().sum() > 0  # ids without a row trained it since the last lookup zeroed it
    assert ebc.full_weights()["adm"][-1].abs().sum() == 0 and live["adm"][-1].abs().sum() > 0  # a copy: zeros
    ckpt = Checkpointer(TrainState({"ebc": ebc}), str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(3)
    ckpt.close()
    checkpoint_cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    for name in ("adm", "lru"):
        assert load_file(str(tmp_path / "out" / f"{name}.safetensors"))["weight"][-1].abs().sum() == 0
    again = _make(2)
    load_checkpoint(latest(str(tmp_path / "ckpt")), TrainState({"ebc": again}))
    assert all(st["m"][-1].abs().sum() == 0 for n, _, st in again.local_optimizer_states() if n != "s")


def test_a_map_holding_an_id_twice_is_refused_on_load(tmp_path):
    ebc = _trained()
    [(name, _, views)] = [x for x in ebc.local_id_maps() if x[0] == "lru"]
    used = (views["id_last"] >= 0).nonzero().flatten().tolist()
    views["ids"][used[1]] = views["ids"][used[0]]
    ckpt = Checkpointer(TrainState({"ebc": ebc}), str(tmp_path), async_save=False)
    ckpt.save(3)
    ckpt.close()
    with pytest.raises(
        ConfigError, match=rf"table 'lru' \(ids: raw\): .* holds id -?\d+ in two rows \({used[0]} and {used[1]}\)"
    ):
        load_checkpoint(latest(str(tmp_path)), TrainState({"ebc": _make(2)}), verify=False)


def test_raw_id_row_blocks_of_one_row_are_refused_by_the_planner():
    tables = [TableConfig("r", 10, 4, ("f",), ids="raw")]  # over 4 ranks: blocks of 3, 3, 3 and 1 rows
    message = r"table 'r' has ids: raw .* row blocks of \[3, 3, 3, 1\] .* needs >= 2 rows .* num_embeddings: 11"
    with pytest.raises(ConfigError, match=message):
        simple_plan(tables, 4, sharding_types={"r": "row_wise"})
    topo = Topology.preset("cpu", 4)
    with pytest.raises(ConfigError, match=message):
        plan_with_report(tables, topo, 8, constraints={"r": {"sharding_types": ["row_wise"]}})
    plan, _ = plan_with_report(tables, topo, 8)  # free to choose: table-wise
    assert plan["r"].sharding_type.value == "table_wise"
    assert simple_plan([TableConfig("r", 11, 4, ("f",), ids="raw")], 4, sharding_types={"r": "row_wise"})
