"""`embshard plan` and the planner's packages run where none of torch, triton, fbgemm_gpu, torchrec and pyarrow can
be imported (the base install: pyyaml and numpy): a subprocess whose first import finder refuses those packages
plans configs/dlrm_criteo.yaml for 64 H100s and a raw-id config, and imports embshard, embshard.planner and
embshard.config."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import paths

BLOCKED = ("torch", "triton", "fbgemm_gpu", "torchrec", "pyarrow")

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is refused in this interpreter")
            return None

    sys.meta_path.insert(0, Refuse())
    import embshard, embshard.planner, embshard.config  # noqa: E401
    from embshard.cli import main

    print("== criteo")
    main(["plan", "configs/dlrm_criteo.yaml", "--world-size", "64", "--local-world-size", "8", "--device", "h100"])
    print("== raw")
    main(["plan", "configs/dlrm_criteo_raw.yaml", "--world-size", "2", "--device", "h100", "--format", "yaml"])
    print("== detect")
    try:
        main(["plan", "configs/dlrm_criteo.yaml", "--world-size", "2", "--detect"])
    except SystemExit as e:
        print("exit", e.code)
    print("== loaded", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
    """
)


def test_plan_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(BLOCKED)],
        cwd=paths.ROOT,
        env=paths.cpu_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    criteo, rest = out.split("== raw")
    raw, rest = rest.split("== detect")
    detect, loaded = rest.split("== loaded")
    # the 64-rank plan: its tables, every rank's row, the topology line and the step time
    assert "topology: 64 x h100 (8 host(s) x 8)" in criteo
    for name in ("t_C1", "t_C13", "t_C26"):
        assert f"{name} " in criteo
    rank_rows = [line for line in criteo.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert {int(line.split()[0]) for line in rank_rows} >= set(range(64))
    assert "predicted step time" in criteo
    # the raw-id tables' plan (the planner prices their id -> row maps)
    assert "- table: t_C1" in raw and "sharding_type:" in raw
    # reading this machine needs torch: a clear error, not a traceback
    assert "exit 2" in detect
    assert "needs torch" in proc.stderr and "--device" in proc.stderr
    assert loaded.strip() == "[]"
