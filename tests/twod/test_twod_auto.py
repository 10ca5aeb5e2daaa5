"""sharding.group_size auto: the config parses it (bad values name the key, the value and the fix), the group-size
search's choice reaches the job's plan, and `embshard plan` on the training config prints the same choice. No
processes (training with auto at world 4: tests/twod/test_twod_auto_train.py)."""

from __future__ import annotations

import pytest

from embshard.config import load_config
from embshard.planner.topology import Topology
from embshard.planner.twod import plan_at_scale
from embshard.spec.tables import ConfigError
from embshard.tools import plan as plan_cmd
from embshard.training.group_plan import auto_group_plan_for_job, dense_spec, job_settings

CONFIG = "configs/dlrm_synthetic.yaml"
SYNC = ["sharding.replica_sync=periodic", "sharding.replica_sync_every=1000", "schedule.batch_size=4096"]


def test_group_size_values():
    assert load_config(CONFIG, ["sharding.group_size=auto"]).sharding.group_size == "auto"
    assert load_config(CONFIG, ["sharding.group_size=4"]).sharding.group_size == 4
    assert load_config(CONFIG, ["sharding.group_size=null"]).sharding.group_size is None
    for bad in ("big", "0", "true"):
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, [f"sharding.group_size={bad}"])
        text = str(e.value)
        assert "sharding.group_size" in text and "auto" in text, text


@pytest.fixture(scope="module")
def topo_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "cpu.yaml"
    Topology.preset("cpu", 32, 4).save(path)
    return str(path)


@pytest.mark.parametrize("sync,world", [(SYNC, 32)], ids=["periodic"])
def test_choice_reaches_plan_and_plan_command(topo_file, sync, world, capsys):
    cfg = load_config(CONFIG, ["sharding.group_size=auto", f"planner.topology_file={topo_file}", *sync])
    lines: list[str] = []
    plan = auto_group_plan_for_job(cfg, world, 4, "cpu", lines.append)
    # the search over every size, run here on its own: the job's plan is its fastest candidate's
    topo = Topology.load(topo_file).with_sizes(world, 4)
    twod = cfg.sharding
    steps = {}
    for g in [g for g in range(4, world + 1, 4) if world % g == 0]:
        one = plan_at_scale(cfg.model.tables, topo, cfg.schedule.batch_size, cfg.sparse_optimizer,
                            cfg.planner.constraints, job_settings(cfg), dense_spec(cfg), twod.replica_sync,
                            twod.replica_sync_every, g)  # fmt: skip
        steps[g] = one.best.step_s
    best = min(steps, key=steps.get)
    want = None if best == world else best
    assert plan.sharding_group_size == want and plan.world_size == world and plan.local_world_size == 4
    if want is not None:
        assert plan.replica_sync.value == twod.replica_sync and plan.replica_sync_every == twod.replica_sync_every
        assert plan.group_plan().world_size == want
    log = "\n".join(lines)
    name = str(want) if want is not None else "none (no 2D)"
    assert f"chosen sharding_group_size: {name};" in log and f"sharding.group_size auto: {name}," in log
    capsys.readouterr()
    plan_cmd.main([CONFIG, "sharding.group_size=auto", f"planner.topology_file={topo_file}", *sync,
                   "--world-size", str(world), "--local-world-size", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"chosen sharding_group_size: {name};" in out, out[-2000:]
    assert ("replica sync periodic every 1000 steps" in out) == (twod.replica_sync == "periodic")


def test_auto_refuses_a_fixed_plan(topo_file):
    cfg = load_config(CONFIG, ["sharding.group_size=auto", "planner.strategy=simple"])
    with pytest.raises(ConfigError, match="sharding.group_size=auto with planner.strategy='simple'"):
        auto_group_plan_for_job(cfg, 8, 4, "cpu", print)


def test_step_mode_follows_the_chosen_group_size():
    """Before the plan, auto may mean 2D (no CUDA graphs); after it, only a 2D plan turns them off."""
    from dataclasses import replace

    from embshard import simple_plan
    from embshard.training.mode import resolve_step_mode

    cfg = load_config(CONFIG, ["sharding.group_size=auto", "training.cuda_graph=true"])
    flat = simple_plan(list(cfg.model.tables), 4, 2)
    twod = replace(simple_plan(list(cfg.model.tables), 2, 2), world_size=4, local_world_size=2, sharding_group_size=2)
    why = "sharding.group_size (2D sharding)"
    for plan, refused in ((None, True), (flat, False), (twod, True)):
        mode = resolve_step_mode(cfg, "cuda", plan)
        assert any(why in f.reason for f in mode.fallbacks) == refused, (plan, mode.fallbacks)
        assert (mode.scope == "eager") == refused, mode
