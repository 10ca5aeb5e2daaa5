"""`embshard train` for tests that test training rather than the command line.

A Python process importing torch, torchrec and embshard takes seconds of CPU, most of a short run's time, and
`embshard train --nproc 2` starts three. On machines without CUDA, `embshard_train` runs `embshard.train`'s job
(what each process of the command line runs) on the test processes' ranks (tests/dist_harness.py), from the
repository root, with the command line's thread count, and returns their console output; elsewhere (where the
command line hides the GPUs for a CPU run) it runs the command line. Tests of the command line itself (its process
start, exit statuses, torchrun restarts) call it in a subprocess (tests/test_train.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass

import paths
import torch
from dist_harness import run_distributed

IN_TEST_RANKS = not torch.cuda.is_available()


@dataclass
class Ran:
    """What a successful run printed: every rank's stdout, then every rank's stderr, in rank order."""

    stdout: str
    stderr: str


def _rank(rank: int, world_size: int, device: torch.device, args: list[str], nproc: int | None) -> tuple[str, str]:
    from embshard.train import _run_or_exit

    cwd, threads, out, err = os.getcwd(), torch.get_num_threads(), io.StringIO(), io.StringIO()
    os.chdir(paths.ROOT)
    if nproc:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # as embshard.distributed.spawn_local
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            _run_or_exit(args[0], args[1:])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return out.getvalue(), err.getvalue()


def embshard_train(args: list[str], nproc: int | None = None, env: dict[str, str] | None = None) -> Ran:
    """`embshard train ARGS [--nproc N]` (ARGS: the config file, then overrides; relative paths from the repository
    root), which must succeed. `env`: the command line's environment (default: paths.cpu_subprocess_env())."""
    if IN_TEST_RANKS:
        results = run_distributed(_rank, nproc or 1, list(args), nproc)
        return Ran("".join(o for o, _ in results), "".join(e for _, e in results))
    cmd = [sys.executable, "-m", "embshard.cli", "train", *args, *(["--nproc", str(nproc)] if nproc else [])]
    res = subprocess.run(
        cmd, cwd=paths.ROOT, env=env or paths.cpu_subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return Ran(res.stdout, res.stderr)
