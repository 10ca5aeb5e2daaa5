"""examples/quickstart.py runs as README.md says: `python examples/quickstart.py` plans its five tables for 64 x H100
with the cost-model planner (plan, predictions, why the largest table went where it did), then shards the tables at
1/100,000 of their rows on one CPU process and trains one step that lowers its loss on the same batch."""

from __future__ import annotations

import re

import paths
from dist_harness import run_scripts

ROOT = paths.ROOT


def test_quickstart_plans_for_the_cluster_and_trains_a_step_here():
    (proc,) = run_scripts([("examples/quickstart.py", [], paths.cpu_subprocess_env())], ROOT)  # as `python SCRIPT`
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    cluster, _, here = out.partition("== the plan for this job")
    assert "ShardingPlan: world_size=64 local_world_size=8" in cluster, cluster[:2000]
    assert re.search(r"^predicted step time [\d.]+ ms", cluster, re.M), cluster[-3000:]
    assert "topology: 64 x h100" in cluster and "table 'user'" in cluster and "<- chosen" in cluster, cluster[-3000:]
    assert "ShardingPlan: world_size=1 local_world_size=1" in here, here
    m = re.search(
        r"pooled outputs \{'user': \(4, 144\), 'item': \(4, 288\)\}; loss (\S+), after one step (\S+)$", here, re.M
    )
    assert m, here
    before, after = float(m.group(1)), float(m.group(2))
    assert 0 < after < before, (before, after)  # the fused optimizer updated the rows inside the backward
