"""Where things are, for tests in any folder of tests/: the repository root, tests/ (its helpers) and data/."""

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = ROOT / "data"


def cpu_subprocess_env() -> dict[str, str]:
    """The environment for a subprocess that runs this checkout's embshard on the CPU: the repository first on
    PYTHONPATH (the caller's own entries kept after it), no GPU visible."""
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), CUDA_VISIBLE_DEVICES=""
    )
