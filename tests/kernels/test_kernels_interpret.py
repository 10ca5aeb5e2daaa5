"""The Triton kernels on CPU tensors under Triton's interpreter: the cases of tests/kernels_interpret_cases.py.
TRITON_INTERPRET=1 must be set before triton is first imported: on a machine without CUDA tests/suite_plugin.py has
set it for this process, and the cases are collected here; where it is unset they run in a pytest process of their
own, except on a GPU machine, where the device tests of tests/kernels run the same kernels themselves."""

from __future__ import annotations

import os
import subprocess
import sys

import paths
import pytest
import torch

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    from kernels_interpret_cases import *  # noqa: F403  (the cases, collected in this process)
else:

    @pytest.mark.skipif(
        torch.cuda.is_available(), reason="on a GPU the device tests (tests/kernels) run the kernels themselves"
    )
    def test_triton_kernels_under_the_interpreter():
        here = paths.TESTS
        env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                str(here / "kernels_interpret_cases.py"),
            ],
            env=env,
            cwd=here.parent,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
