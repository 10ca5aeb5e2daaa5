"""`embshard train` for tests that test training rather than the command line.

A Python process importing torch, torchrec and embshard takes seconds of CPU, most of a short run's time, and
`embshard train --nproc 2` starts two (itself, and on machines without CUDA the fork server its ranks fork from;
three interpreters on GPUs). On machines without CUDA, `embshard_train` runs `embshard.training.train`'s job
(what each process of the command line runs) in processes forked for the run from the test harness's server,
which imported those modules once (tests/dist_harness.py, `fresh=True`), from the repository root, with the
command line's thread count, and returns what they wrote to their stdout and stderr (file descriptors 1 and 2:
Python, logging and C++ output alike, and the data workers' too). Elsewhere (where the command line hides the GPUs
for a CPU run) it runs the command line. Tests of the command line itself (its process start, exit statuses,
torchrun restarts) run it in a subprocess (tests/test_train.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
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


@contextlib.contextmanager
def _captured(rank: int, what: str):
    """This process's file descriptors 1 and 2 into temporary files while the block runs; yields a list that
    receives (stdout, stderr) as it ends. A failure raises with what the block printed."""
    printed: list[str] = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield printed
        except BaseException as e:
            sys.stdout.flush()
            sys.stderr.flush()
            out.seek(0)
            err.seek(0)
            raise RuntimeError(f"rank {rank} of {what} failed; it printed:\n{out.read()}{err.read()}") from e
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        printed[:] = [out.read(), err.read()]


def _rank(
    rank: int, world_size: int, device: torch.device, args: list[str], nproc: int | None, exits: bool = False
) -> tuple[str, str] | tuple[str, str, int]:
    """One rank's run; with `exits`, one that stops with a status (sys.exit): (stdout, stderr, status)."""
    from embshard.training.train import _run_or_exit

    os.chdir(paths.ROOT)
    if nproc:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # as embshard.runtime.distributed.spawn_local
    code = None
    with _captured(rank, "`embshard train`") as printed:
        try:
            _run_or_exit(args[0], args[1:])
        except SystemExit as e:
            if not exits:
                raise
            code = e.code
    if exits:
        assert code is not None, f"rank {rank} of `embshard train` did not exit with a status:\n{printed[0]}"
        return printed[0], printed[1], code
    return printed[0], printed[1]


def _module_rank(rank: int, world_size: int, device: torch.device, module: str, argv: list[str], nproc: int):
    from embshard.training.train import _run_or_exit  # noqa: F401  (the modules a command's rank has)

    os.chdir(paths.ROOT)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # as embshard.runtime.distributed.spawn_local
    mod = importlib.import_module(module)
    with _captured(rank, f"`python -m {module}`") as printed:
        mod.run(mod.parse(argv))
    return printed[0], printed[1]


def _command_line(argv: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    """`python ARGV` from the repository root with `env` (default paths.cpu_subprocess_env()), its output kept."""
    return subprocess.run(
        [sys.executable, *argv], cwd=paths.ROOT, env=env or paths.cpu_subprocess_env(), capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip


def _succeeded(res: subprocess.CompletedProcess) -> Ran:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return Ran(res.stdout, res.stderr)


def _train_argv(args: list[str], nproc: int | None) -> list[str]:
    return ["-m", "embshard.cli", "train", *args, *(["--nproc", str(nproc)] if nproc else [])]


def module_ranks(module: str, argv: list[str], nproc: int, env: dict[str, str] | None = None) -> Ran:
    """`python -m MODULE ARGV --nproc N` of a script whose ranks run `MODULE.run(MODULE.parse(ARGV))` (bench/
    train_e2e.py), which must succeed: in processes forked for it where IN_TEST_RANKS (its own start of the ranks
    is embshard.runtime.distributed.spawn_local, as `embshard train --nproc`'s), else by the command line (with
    `env`, default paths.cpu_subprocess_env())."""
    if IN_TEST_RANKS:
        results = run_distributed(_module_rank, nproc, module, list(argv), nproc, fresh=True)
        return Ran("".join(o for o, _ in results), "".join(e for _, e in results))
    return _succeeded(_command_line(["-m", module, *argv, "--nproc", str(nproc)], env))


def embshard_train(args: list[str], nproc: int | None = None, env: dict[str, str] | None = None) -> Ran:
    """`embshard train ARGS [--nproc N]` (ARGS: the config file, then overrides; relative paths from the repository
    root), which must succeed. `env`: the command line's environment (default: paths.cpu_subprocess_env())."""
    if IN_TEST_RANKS:
        results = run_distributed(_rank, nproc or 1, list(args), nproc, fresh=True)
        return Ran("".join(o for o, _ in results), "".join(e for _, e in results))
    return _succeeded(_command_line(_train_argv(args, nproc), env))


def embshard_train_exit(
    args: list[str], env: dict[str, str] | None = None, nproc: int | None = None
) -> tuple[int, Ran]:
    """`embshard train ARGS [--nproc N]`, which must stop with a status after its ranks started (errors the command
    line's own checks cannot see: those are checked in the test's process): (status, what it printed), the status
    every rank ended with (a test fails where they differ). In processes forked for it where IN_TEST_RANKS, else by
    the command line."""
    if IN_TEST_RANKS:
        results = run_distributed(_rank, nproc or 1, list(args), nproc, True, fresh=True)
        codes = {code for _, _, code in results}
        assert len(codes) == 1, f"the ranks of `embshard train` ended with different statuses: {codes}"
        return codes.pop(), Ran("".join(o for o, _, _ in results), "".join(e for _, e, _ in results))
    res = _command_line(_train_argv(args, nproc), env)
    return res.returncode, Ran(res.stdout, res.stderr)
