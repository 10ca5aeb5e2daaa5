"""The README's Python examples run as written and produce what they claim; examples/custom_model.py trains a model
of its own kind on 2 CPU processes (examples/quickstart.py: tests/test_quickstart_example.py).

The README's two ```python blocks (the sharded collection planned by the cost model; a whole model through
TrainPipeline) each run as a script of their own; here both run in one process, one after the other (one start-up
of torch, one gloo group of 1 process), from the repository root as a reader would. The scripts run as `python
SCRIPT` does (their environment, folder, arguments and sys.path), on machines without CUDA in forks of the test
harness's server, which imported torch and embshard once (dist_harness.run_scripts)."""

from __future__ import annotations

import re

import paths
from dist_harness import run_scripts

ROOT = paths.ROOT


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_examples_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 2, f"README.md has {len(blocks)} python blocks; this test runs and checks each: update it"
    sharded, pipeline = blocks
    assert "TrainPipeline" in pipeline and "ShardedEmbeddingBagCollection" in sharded
    assert "plan_with_report" in sharded and "Topology.preset" in sharded  # the cost-model planner, not simple_plan
    checks = [
        "assert (cluster.world_size, plan.world_size) == (64, 64), (cluster, plan.world_size)",
        "assert local_plan.world_size == torch.distributed.get_world_size(), local_plan",
        "assert out['user'].shape == (2, 128) and out['cross'].shape == (2, 384), {k: v.shape for k, v in out.items()}",
        "print('SHARDED_OK')",
    ]
    script = "\n".join([sharded, *checks, pipeline, "assert done is None"])
    (tmp_path / "example.py").write_text(script)
    (proc,) = run_scripts([(str(tmp_path / "example.py"), [], paths.cpu_subprocess_env())], ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ShardingPlan: world_size=64" in proc.stdout and "SHARDED_OK" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^predicted step time [\d.]+ ms", proc.stdout, re.M), proc.stdout[-3000:]  # report.summary()
    losses = [float(m) for m in re.findall(r"^\d+ (\S+)$", proc.stdout, re.M)]
    assert len(losses) == 10 and all(0 < x < 5 for x in losses), proc.stdout[-2000:]


def test_custom_model_example_trains_on_two_processes():
    """Two ranks started the way torchrun starts them (RANK, WORLD_SIZE, ... in the environment; the example's own
    `--nproc` start goes through embshard.runtime.distributed.spawn_local, which `embshard train --nproc` tests use)."""
    from dist_harness import _free_port  # below the kernel's ephemeral range: no other socket takes it meanwhile

    procs = []
    port = str(_free_port())
    for rank in range(2):
        env = paths.cpu_subprocess_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(("examples/custom_model.py", ["--steps", "3"], env))
    ran = run_scripts(procs, ROOT)
    for p in ran:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    outs = [(p.stdout, p.stderr) for p in ran]
    out = outs[0][0]
    steps = re.findall(r"^train step +(\d+) +loss (\S+)", out, re.M)
    assert [int(s) for s, _ in steps] == [1, 2, 3] and all(0 < float(x) < 5 for _, x in steps), out[-2000:]
    evals = re.findall(r"^eval +step +3 +loss (\S+) +auc (\S+) +\((\d+) samples\)", out, re.M)
    assert evals and int(evals[0][2]) == 40, out[-2000:]  # the 40 held-out rows of the Criteo sample, both ranks'
    assert "table_wise" in out  # rank 0 printed the plan
