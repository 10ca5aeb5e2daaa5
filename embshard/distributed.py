"""Process-group set-up: under torchrun (env vars present) or started locally with `spawn_local`."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from embshard import comm


def init_distributed(collective_timeout_s: float | None = 600.0) -> torch.device:
    """Join the process group described by torchrun's environment (NCCL on GPUs, gloo on CPU); returns the
    device this rank computes on. Without torchrun's variables, a single-process group is created.

    `collective_timeout_s`: embshard's collectives raise `comm.CollectiveTimeout` (naming the step and the
    exchange) after this long; the process group's own timeout, for every other collective, is 60 s longer."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=collective_timeout_s + 60)} if collective_timeout_s else {}
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    comm.set_timeout(collective_timeout_s)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, nproc: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    fn(*args)


def spawn_local(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run fn(*args) on `nproc` local processes with torchrun-style environment variables."""
    import torch.multiprocessing as mp

    mp.start_processes(_entry, args=(nproc, free_port(), fn, args), nprocs=nproc, join=True, start_method="spawn")
