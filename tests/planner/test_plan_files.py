"""Plan, topology and TorchRec plan files of a bad structure: one ConfigError naming the file and the field."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from embshard import ConfigError, TableConfig, simple_plan
from embshard.interop.plan_out import check_plan_file, load_torchrec_plan, plan_dict
from embshard.planner.topology import Topology
from embshard.spec.plan import ShardingPlan

TABLES = [TableConfig("a", 100, 8, ("fa",)), TableConfig("b", 40, 4, ("fb",))]
PLAN = simple_plan(TABLES, 2, sharding_types={"a": "row_wise", "b": "table_wise"}, tier="host")


def _edit(data: dict, path: tuple, value: object) -> dict:
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("tables",), KeyError, r"the plan lacks \['tables'\]"),
        (("tables",), 5, r"tables=5 is invalid: it must be a list"),
        (("world_size",), "two", r"world_size='two' is invalid: it must be an integer >= 1"),
        (("world_size",), float("inf"), r"world_size=inf is invalid"),
        (("local_world_size",), 0, r"local_world_size=0 is invalid"),
        (("extra",), 1, r"the plan has unknown keys \['extra'\]"),
        (("tables", 0), 3, r"tables\[0\] must be a mapping, not int"),
        (("tables", 0, "table"), 3, r"tables\[0\].table=3 is invalid"),
        (("tables", 1, "table"), "a", r"tables\[1\].table='a' is invalid: the table is listed twice"),
        (("tables", 0, "sharding_type"), "evil", r"table 'a' sharding_type='evil' is invalid: choose one of"),
        (("tables", 0, "tier"), "disk", r"table 'a' tier='disk' is invalid"),
        (("tables", 0, "kernel"), "fast", r"table 'a' kernel='fast' is invalid"),
        (("tables", 0, "cache_load_factor"), 2, r"table 'a' cache_load_factor=2 is invalid"),
        (("tables", 0, "shards"), "x", r"table 'a' shards='x' is invalid"),
        (("tables", 0, "shards", 0), [1, 2], r"table 'a' shards\[0\] must be a mapping"),
        (("tables", 0, "shards", 0, "rank"), 0.5, r"table 'a' shards\[0\].rank=0.5 is invalid"),
        (("tables", 0, "shards", 0, "rank"), 7, r"shards\[0\].rank=7 is invalid: ranks are 0..1"),
        (("tables", 0, "shards", 0, "num_rows"), 0, r"shards\[0\].num_rows=0 is invalid: it must be an integer >= 1"),
        (("tables", 0, "shards", 0, "foo"), 1, r"shards\[0\] has unknown keys \['foo'\]"),
        (("table_row_wise_exchange",), "ring", r"table_row_wise_exchange='ring' is invalid"),
    ],
)
def test_bad_plan_file_names_the_file_and_the_field(tmp_path, path, value, message):
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(_edit(PLAN.to_dict(), path, value)))
    with pytest.raises(ConfigError, match=rf"plan\.yaml: not a valid embshard plan: .*{message}"):
        ShardingPlan.load(f)


def test_plan_file_round_trip_and_unreadable_files(tmp_path):
    PLAN.save(tmp_path / "p.yaml")
    PLAN.save(tmp_path / "p.json")
    assert ShardingPlan.load(tmp_path / "p.yaml") == PLAN == ShardingPlan.load(tmp_path / "p.json")
    cases = {
        "list.yaml": ("[1, 2]", r"the plan must be a mapping, not list"),
        "empty.yaml": ("", r"the plan must be a mapping, not NoneType"),
        "python.yaml": ("!!python/object/apply:os.system ['true']", r"not a plan file of plain YAML or JSON"),
        "broken.json": ("{", r"not a plan file of plain YAML or JSON"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: .*{message}"):
            ShardingPlan.load(tmp_path / name)
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the plan file"):
        ShardingPlan.load(tmp_path / "missing.yaml")


TOPO = "world_size: 2\nlocal_world_size: 2\ndevice_name: h100\nhbm_gib: 80\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        ("hbm_gbps: 0\n", r"hbm_gbps=0 is invalid: bandwidths must be > 0"),
        ("inter_host_gbps: -5\n", r"inter_host_gbps=-5 is invalid: bandwidths must be > 0"),
        ("hbm_gbps: .inf\n", r"hbm_gbps=inf is invalid: expected a finite number"),
        ("ddr_gib: 1.0e+308\n", r"ddr_gib=1e\+308 is invalid: it is out of range"),
        ("measured: 5\n", r"measured=5 is invalid: expected a list of field names"),
        ("regroup_efficiency: fast\n", r"regroup_efficiency='fast' is invalid"),
        ("source: [1]\n", r"source=\[1\] is invalid: expected a string"),
        ("kernel_us: -1\n", r"kernel_s=-1e-06 is invalid: it must be >= 0"),
        ("lookup_id_ns: 1\nuvm_gbps: 0\n", r"uvm_gbps=0 is invalid: bandwidths must be > 0"),
    ],
)
def test_bad_topology_file_names_the_file_and_the_field(tmp_path, extra, message):
    f = tmp_path / "topo.yaml"
    f.write_text(TOPO + extra)
    with pytest.raises(ConfigError, match=rf"topo\.yaml: .*{message}"):
        Topology.load(f)


def test_topology_file_round_trip_and_unreadable_files(tmp_path):
    topo = Topology.preset("h100", 4, 2)
    topo.save(tmp_path / "t.yaml")
    assert Topology.load(tmp_path / "t.yaml").to_dict() == topo.to_dict()
    for name, text, message in [
        ("list.yaml", "[1]", r"expected a mapping of topology fields, not list"),
        ("python.yaml", "!!python/object/apply:os.system ['true']", r"not a topology file of plain YAML or JSON"),
        ("ws.yaml", "world_size: two\nlocal_world_size: 1\n", r"world_size='two' is invalid"),
    ]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: .*{message}"):
            Topology.load(tmp_path / name)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d, t: t.update(sharding_type="evil"), r"\['b'\]\.sharding_type='evil' is invalid: choose one of"),
        (lambda d, t: t.update(compute_kernel="magic"), r"\['b'\]\.compute_kernel='magic' is invalid"),
        (lambda d, t: t.update(ranks=[9]), r"\['b'\]\.ranks\[0\]=9 is invalid: it must be a rank in 0\.\.1"),
        (lambda d, t: t.update(shards=[{"rank": 0}]), r"\['b'\]\.shards\[0\]\.offsets is missing"),
        (
            lambda d, t: t.update(cache_params={"algorithm": "mru", "load_factor": 0.2}),
            r"cache_params\.algorithm='mru' is invalid",
        ),
        (lambda d, t: t.pop("ranks"), r"\['b'\]\.ranks is missing"),
        (lambda d, t: d.update(local_world_size=0), r"local_world_size=0 is invalid"),
        (lambda d, t: d.update(device_type="tpu"), r"device_type='tpu' is invalid"),
        (lambda d, t: d.update(modules=[]), r"modules is a list, not an object"),
    ],
)
def test_bad_torchrec_plan_file_names_the_file_and_the_field(tmp_path, edit, message):
    data = plan_dict(PLAN, "ebc")
    check_plan_file(copy.deepcopy(data), "good")  # the file embshard writes passes
    edit(data, data["modules"]["ebc"]["b"])
    f = tmp_path / "plan.torchrec.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"plan\.torchrec\.json: .*{message}"):
        load_torchrec_plan(f)
    f.write_text("[1]")
    with pytest.raises(
        ConfigError, match=r"plan\.torchrec\.json: not a valid TorchRec plan file: the file holds a list"
    ):
        load_torchrec_plan(f)
