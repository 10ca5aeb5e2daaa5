"""The README's Python example runs as written (one gloo process) and produces the shapes it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import paths

ROOT = paths.ROOT


def test_readme_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code += "\nassert out['user'].shape == (2, 16) and out['cross'].shape == (2, 48), {k: v.shape for k, v in out.items()}\n"
    script = tmp_path / "example.py"
    script.write_text(code)
    from embshard.distributed import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ShardingPlan" in proc.stdout
